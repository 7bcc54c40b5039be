from protos.eagle3.v1 import speculation_pb2 as _speculation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_TRANSPORT_UNSPECIFIED: _ClassVar[StepTransport]
    STEP_TRANSPORT_SESSION_STREAM: _ClassVar[StepTransport]
    STEP_TRANSPORT_UNIX_SOCKET: _ClassVar[StepTransport]

class BufferBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_BACKEND_UNSPECIFIED: _ClassVar[BufferBackend]
    BUFFER_BACKEND_CUDA_IPC: _ClassVar[BufferBackend]
    BUFFER_BACKEND_SHARED_MEMORY: _ClassVar[BufferBackend]
STEP_TRANSPORT_UNSPECIFIED: StepTransport
STEP_TRANSPORT_SESSION_STREAM: StepTransport
STEP_TRANSPORT_UNIX_SOCKET: StepTransport
BUFFER_BACKEND_UNSPECIFIED: BufferBackend
BUFFER_BACKEND_CUDA_IPC: BufferBackend
BUFFER_BACKEND_SHARED_MEMORY: BufferBackend

class StepSocketOffer(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "fingerprint", "vocab_size", "hidden_size", "capture_layers", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., capture_layers: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class PeerLocation(_message.Message):
    __slots__ = ("host_id", "device_type", "gpu_uuid")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_type: str
    gpu_uuid: str
    def __init__(self, host_id: _Optional[str] = ..., device_type: _Optional[str] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class SharedBuffer(_message.Message):
    __slots__ = ("name", "backend", "shape", "dtype", "generation", "cuda_ipc_handle", "offset_bytes", "shm_name", "device_uuid", "host_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: BufferBackend
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    generation: int
    cuda_ipc_handle: bytes
    offset_bytes: int
    shm_name: str
    device_uuid: str
    host_id: str
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[_Union[BufferBackend, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., generation: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., offset_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., device_uuid: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("expected_target", "location", "limits", "draft_name", "step_transport")
    EXPECTED_TARGET_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    expected_target: ModelIdentity
    location: PeerLocation
    limits: _speculation_pb2.SpeculationLimits
    draft_name: str
    step_transport: StepTransport
    def __init__(self, expected_target: _Optional[_Union[ModelIdentity, _Mapping]] = ..., location: _Optional[_Union[PeerLocation, _Mapping]] = ..., limits: _Optional[_Union[_speculation_pb2.SpeculationLimits, _Mapping]] = ..., draft_name: _Optional[str] = ..., step_transport: _Optional[_Union[StepTransport, str]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("session_id", "generation", "target", "buffers", "max_feature_rows", "max_trees", "max_tree_nodes", "target_config_json", "max_model_len", "step_socket", "chained_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    MAX_FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TARGET_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CHAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    generation: int
    target: ModelIdentity
    buffers: _containers.RepeatedCompositeFieldContainer[SharedBuffer]
    max_feature_rows: int
    max_trees: int
    max_tree_nodes: int
    target_config_json: str
    max_model_len: int
    step_socket: StepSocketOffer
    chained_steps: ChainedSteps
    def __init__(self, session_id: _Optional[int] = ..., generation: _Optional[int] = ..., target: _Optional[_Union[ModelIdentity, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[SharedBuffer, _Mapping]]] = ..., max_feature_rows: _Optional[int] = ..., max_trees: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., target_config_json: _Optional[str] = ..., max_model_len: _Optional[int] = ..., step_socket: _Optional[_Union[StepSocketOffer, _Mapping]] = ..., chained_steps: _Optional[_Union[ChainedSteps, _Mapping]] = ...) -> None: ...

class ChainedSteps(_message.Message):
    __slots__ = ("ready_event", "done_event")
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    ready_event: bytes
    done_event: bytes
    def __init__(self, ready_event: _Optional[bytes] = ..., done_event: _Optional[bytes] = ...) -> None: ...

class FeedRows(_message.Message):
    __slots__ = ("seq_id", "start_position", "buffer_row", "next_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ROW_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    buffer_row: int
    next_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., buffer_row: _Optional[int] = ..., next_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposalRequest(_message.Message):
    __slots__ = ("seq_id", "max_depth", "tree_slot", "settings")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_SLOT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    max_depth: int
    tree_slot: int
    settings: _speculation_pb2.TreeSettings
    def __init__(self, seq_id: _Optional[int] = ..., max_depth: _Optional[int] = ..., tree_slot: _Optional[int] = ..., settings: _Optional[_Union[_speculation_pb2.TreeSettings, _Mapping]] = ...) -> None: ...

class TreeRejection(_message.Message):
    __slots__ = ("seq_id", "reason")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: str
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class VerifyMessage(_message.Message):
    __slots__ = ("step_id", "feeds", "proposals", "finished_seq_ids", "rejected_trees")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TREES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    feeds: _containers.RepeatedCompositeFieldContainer[FeedRows]
    proposals: _containers.RepeatedCompositeFieldContainer[ProposalRequest]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    rejected_trees: _containers.RepeatedCompositeFieldContainer[TreeRejection]
    def __init__(self, step_id: _Optional[int] = ..., feeds: _Optional[_Iterable[_Union[FeedRows, _Mapping]]] = ..., proposals: _Optional[_Iterable[_Union[ProposalRequest, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., rejected_trees: _Optional[_Iterable[_Union[TreeRejection, _Mapping]]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("session_id", "generation", "step_transport", "chained_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    generation: int
    step_transport: StepTransport
    chained_steps: bool
    def __init__(self, session_id: _Optional[int] = ..., generation: _Optional[int] = ..., step_transport: _Optional[_Union[StepTransport, str]] = ..., chained_steps: _Optional[bool] = ...) -> None: ...

class TreeRef(_message.Message):
    __slots__ = ("seq_id", "tree_slot", "num_nodes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tree_slot: int
    num_nodes: int
    def __init__(self, seq_id: _Optional[int] = ..., tree_slot: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "trees", "draft_compute_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    trees: _containers.RepeatedCompositeFieldContainer[TreeRef]
    draft_compute_ns: int
    def __init__(self, step_id: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[TreeRef, _Mapping]]] = ..., draft_compute_ns: _Optional[int] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("open", "result")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    result: StepResult
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...
