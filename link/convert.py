"""Protobuf conversions shared by both services: tree settings, shared-buffer descriptors, and a
step on the Session stream (``StepCall`` <-> VerifyMessage, ``StepReply`` <-> StepResult)."""

from __future__ import annotations

import numpy as np

from common.errors import EagleError, LinkProtocolError
from common.tree_settings import TreeSettings
from link.protocol import FeedRows, ProposeRequest, StepCall, StepReply, TreeRef
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


def step_call_to_proto(call: StepCall) -> link_pb.VerifyMessage:
    msg = link_pb.VerifyMessage(step_id=call.step_id, finished_seq_ids=call.finished)
    msg.rejected_trees.extend(link_pb.TreeRejection(seq_id=i, reason=r) for i, r in call.rejections)
    for f in call.feeds:
        msg.feeds.add(seq_id=f.seq_id, start_position=f.start, buffer_row=f.buffer_row,
                      next_tokens=f.next_tokens.tolist())
    for slot, p in enumerate(call.proposals):
        msg.proposals.add(seq_id=p.seq_id, max_depth=p.max_depth, tree_slot=slot,
                          settings=settings_to_proto(p.settings))
    return msg


def step_call_from_proto(msg: link_pb.VerifyMessage) -> StepCall:
    """Raises LinkProtocolError for a proposal out of its slot or with tree settings that do not parse."""
    proposals = []
    for slot, p in enumerate(msg.proposals):
        if p.tree_slot != slot:
            raise LinkProtocolError(f"step {msg.step_id}: proposal {slot} names tree slot {p.tree_slot}")
        try:
            settings = settings_from_proto(p.settings)
        except (KeyError, EagleError) as exc:
            raise LinkProtocolError(f"step {msg.step_id}: proposal {slot} has bad tree settings: {exc}") from exc
        proposals.append(ProposeRequest(p.seq_id, p.max_depth, settings))
    feeds = [FeedRows(f.seq_id, f.start_position, f.buffer_row, np.asarray(f.next_tokens, dtype=np.int64))
             for f in msg.feeds]
    return StepCall(msg.step_id, feeds, proposals, list(msg.finished_seq_ids),
                    [(r.seq_id, r.reason) for r in msg.rejected_trees])


def step_reply_to_proto(reply: StepReply) -> link_pb.StepResult:
    return link_pb.StepResult(step_id=reply.step_id, draft_compute_ns=reply.draft_compute_ns,
                              trees=[link_pb.TreeRef(seq_id=t.seq_id, tree_slot=t.tree_slot, num_nodes=t.num_nodes)
                                     for t in reply.trees])


def step_reply_from_proto(result: link_pb.StepResult) -> StepReply:
    return StepReply(result.step_id, [TreeRef(t.seq_id, t.tree_slot, t.num_nodes) for t in result.trees],
                     result.draft_compute_ns)
