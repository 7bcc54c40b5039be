"""Protobuf conversions shared by both services: tree settings and shared-buffer descriptors."""

from __future__ import annotations

from common.tree_settings import TreeSettings
from link.shared_buffers import BufferDescriptor
from protos.eagle3.v1 import draft_link_pb2 as link_pb
from protos.eagle3.v1 import speculation_pb2 as spec_pb

TREE_TO_PROTO = {"dynamic": spec_pb.TREE_KIND_DYNAMIC, "static": spec_pb.TREE_KIND_STATIC,
                 "chain": spec_pb.TREE_KIND_CHAIN}
TREE_FROM_PROTO = {v: k for k, v in TREE_TO_PROTO.items()}
_BACKENDS = {"cuda_ipc": link_pb.BUFFER_BACKEND_CUDA_IPC, "shm": link_pb.BUFFER_BACKEND_SHARED_MEMORY}
_BACKENDS_BACK = {v: k for k, v in _BACKENDS.items()}


def settings_to_proto(s: TreeSettings | None) -> spec_pb.TreeSettings | None:
    if s is None:
        return None
    return spec_pb.TreeSettings(tree=TREE_TO_PROTO[s.tree], depth=s.depth, top_k=s.top_k, max_nodes=s.max_nodes)


def settings_from_proto(p: spec_pb.TreeSettings) -> TreeSettings | None:
    if p.tree == spec_pb.TREE_KIND_UNSPECIFIED:
        return None
    return TreeSettings(TREE_FROM_PROTO[p.tree], p.depth, p.top_k, p.max_nodes)


def descriptor_to_proto(d: BufferDescriptor) -> link_pb.SharedBuffer:
    return link_pb.SharedBuffer(name=d.name, backend=_BACKENDS[d.backend], shape=list(d.shape), dtype=d.dtype,
                                generation=d.generation, cuda_ipc_handle=d.handle, offset_bytes=d.offset_bytes,
                                shm_name=d.shm_name, device_uuid=d.device_uuid, host_id=d.host_id)


def descriptor_from_proto(p: link_pb.SharedBuffer) -> BufferDescriptor:
    return BufferDescriptor(name=p.name, backend=_BACKENDS_BACK[p.backend], shape=tuple(p.shape), dtype=p.dtype,
                            generation=p.generation, handle=p.cuda_ipc_handle, offset_bytes=p.offset_bytes,
                            shm_name=p.shm_name, device_uuid=p.device_uuid, host_id=p.host_id)
