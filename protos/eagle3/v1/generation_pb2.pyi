from protos.eagle3.v1 import speculation_pb2 as _speculation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("enabled", "tree", "depth", "top_k", "max_nodes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    tree: _speculation_pb2.TreeKind
    depth: int
    top_k: int
    max_nodes: int
    def __init__(self, enabled: _Optional[bool] = ..., tree: _Optional[_Union[_speculation_pb2.TreeKind, str]] = ..., depth: _Optional[int] = ..., top_k: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "speculation")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParameters
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    speculation: SpeculationOptions
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationMetrics(_message.Message):
    __slots__ = ("speculated", "steps", "draft_tokens", "accepted_tokens", "rewound_tokens", "acceptance_rate", "mean_acceptance_length", "accepted_per_depth")
    SPECULATED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    speculated: bool
    steps: int
    draft_tokens: int
    accepted_tokens: int
    rewound_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    accepted_per_depth: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, speculated: _Optional[bool] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., rewound_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., accepted_per_depth: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationDone(_message.Message):
    __slots__ = ("finish_reason", "usage", "speculation")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationMetrics
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationMetrics, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "done")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    done: GenerationDone
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., done: _Optional[_Union[GenerationDone, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "max_model_len", "dtype", "device", "speculation_configured", "draft_connected", "limits", "max_tokens_default", "version", "exact_numerics")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXACT_NUMERICS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    speculation_configured: bool
    draft_connected: bool
    limits: _speculation_pb2.SpeculationLimits
    max_tokens_default: int
    version: str
    exact_numerics: bool
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., speculation_configured: _Optional[bool] = ..., draft_connected: _Optional[bool] = ..., limits: _Optional[_Union[_speculation_pb2.SpeculationLimits, _Mapping]] = ..., max_tokens_default: _Optional[int] = ..., version: _Optional[str] = ..., exact_numerics: _Optional[bool] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerMetrics(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_total", "kv_blocks_used", "draft_connected", "draft_sessions", "speculative_steps", "plain_steps", "draft_tokens", "accepted_tokens", "draft_errors", "completed_requests", "cancelled_requests", "control_plane_p50_us", "control_plane_p99_us", "adaptive_speculation", "adaptive_tree_nodes", "adaptive_steps_by_tree_nodes", "chained_steps", "draft_compute_p50_us", "draft_compute_p99_us", "decode_steps_ahead")
    class AdaptiveStepsByTreeNodesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PLANE_P50_US_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PLANE_P99_US_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_STEPS_BY_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    CHAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_P50_US_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_P99_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    draft_connected: bool
    draft_sessions: int
    speculative_steps: int
    plain_steps: int
    draft_tokens: int
    accepted_tokens: int
    draft_errors: int
    completed_requests: int
    cancelled_requests: int
    control_plane_p50_us: float
    control_plane_p99_us: float
    adaptive_speculation: bool
    adaptive_tree_nodes: int
    adaptive_steps_by_tree_nodes: _containers.ScalarMap[int, int]
    chained_steps: int
    draft_compute_p50_us: float
    draft_compute_p99_us: float
    decode_steps_ahead: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., draft_connected: _Optional[bool] = ..., draft_sessions: _Optional[int] = ..., speculative_steps: _Optional[int] = ..., plain_steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_errors: _Optional[int] = ..., completed_requests: _Optional[int] = ..., cancelled_requests: _Optional[int] = ..., control_plane_p50_us: _Optional[float] = ..., control_plane_p99_us: _Optional[float] = ..., adaptive_speculation: _Optional[bool] = ..., adaptive_tree_nodes: _Optional[int] = ..., adaptive_steps_by_tree_nodes: _Optional[_Mapping[int, int]] = ..., chained_steps: _Optional[int] = ..., draft_compute_p50_us: _Optional[float] = ..., draft_compute_p99_us: _Optional[float] = ..., decode_steps_ahead: _Optional[int] = ...) -> None: ...
