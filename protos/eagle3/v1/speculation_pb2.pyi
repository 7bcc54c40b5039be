from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TreeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TREE_KIND_UNSPECIFIED: _ClassVar[TreeKind]
    TREE_KIND_DYNAMIC: _ClassVar[TreeKind]
    TREE_KIND_STATIC: _ClassVar[TreeKind]
    TREE_KIND_CHAIN: _ClassVar[TreeKind]
TREE_KIND_UNSPECIFIED: TreeKind
TREE_KIND_DYNAMIC: TreeKind
TREE_KIND_STATIC: TreeKind
TREE_KIND_CHAIN: TreeKind

class SpeculationLimits(_message.Message):
    __slots__ = ("tree", "max_depth", "max_top_k", "max_nodes")
    TREE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    tree: TreeKind
    max_depth: int
    max_top_k: int
    max_nodes: int
    def __init__(self, tree: _Optional[_Union[TreeKind, str]] = ..., max_depth: _Optional[int] = ..., max_top_k: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class TreeSettings(_message.Message):
    __slots__ = ("tree", "depth", "top_k", "max_nodes")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    tree: TreeKind
    depth: int
    top_k: int
    max_nodes: int
    def __init__(self, tree: _Optional[_Union[TreeKind, str]] = ..., depth: _Optional[int] = ..., top_k: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...
