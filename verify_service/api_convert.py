"""Public API conversions: GenerateRequest -> engine inputs, engine events and stats -> responses."""

from __future__ import annotations

from itertools import chain

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from link.convert import TREE_FROM_PROTO
from protos.eagle3.v1 import generation_pb2 as pb
from protos.eagle3.v1 import speculation_pb2 as spec_pb
from verify_service.engine import TokenEvent
from verify_service.sequence import FinishReason, SpeculationMetrics
from verify_service.stats import VerifyStats
from verify_service.target import Target

_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


def prompt_ids(req: pb.GenerateRequest, target: Target) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
    if kind == "token_ids":
        return list(req.token_ids.ids)
    if kind == "chat":
        return target.encode(messages=[{"role": m.role, "content": m.content} for m in req.chat.messages])
    return target.encode(prompt=req.text)


def sampling_params(req: pb.GenerateRequest, max_tokens_default: int) -> SamplingParams:
    s = req.sampling
    return SamplingParams(
        max_tokens=req.max_tokens or max_tokens_default,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos)


def speculation(req: pb.GenerateRequest, limits: TreeSettings | None) -> tuple[bool, TreeSettings | None]:
    """(speculate, tree settings) for the request, checked against the server's limits."""
    o = req.speculation
    wanted = o.enabled if o.HasField("enabled") else True
    if limits is None:
        if o.HasField("enabled") and o.enabled:
            raise InvalidRequestError("speculation.enabled", "this server runs without speculation")
        return False, None
    opt = lambda name: getattr(o, name) if o.HasField(name) else None  # noqa: E731
    if o.tree != spec_pb.TREE_KIND_UNSPECIFIED and o.tree not in TREE_FROM_PROTO:  # an enum value we do not know
        raise InvalidRequestError("speculation.tree", f"unknown tree kind {o.tree}")
    tree = TREE_FROM_PROTO.get(o.tree)
    return wanted, limits.request(tree, opt("depth"), opt("top_k"), opt("max_nodes"))


def delta(events: list[TokenEvent]) -> pb.GenerateResponse:
    """Consecutive events of one request as one message: their tokens and text, in order."""
    return pb.GenerateResponse(delta=pb.TokenDelta(token_ids=list(chain.from_iterable(ev.token_ids for ev in events)),
                                                   text="".join(ev.text for ev in events)))


def done(ev: TokenEvent, prompt_tokens: int, completion_tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(done=pb.GenerationDone(
        finish_reason=_FINISH.get(ev.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        speculation=speculation_metrics(ev.speculation)))


def speculation_metrics(m: SpeculationMetrics | None) -> pb.SpeculationMetrics:
    if m is None or m.steps == 0:
        return pb.SpeculationMetrics(speculated=False)
    return pb.SpeculationMetrics(
        speculated=True, steps=m.steps, draft_tokens=m.draft_tokens, accepted_tokens=m.accepted_tokens,
        rewound_tokens=m.rewound_tokens, acceptance_rate=m.acceptance_rate, mean_acceptance_length=m.tau,
        accepted_per_depth=m.accepted_per_depth)


def server_metrics(s: VerifyStats) -> pb.ServerMetrics:
    return pb.ServerMetrics(
        running_requests=s.running_requests, waiting_requests=s.waiting_requests,
        kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, draft_connected=s.draft_connected,
        draft_sessions=s.draft_sessions, speculative_steps=s.speculative_steps, plain_steps=s.plain_steps,
        draft_tokens=s.speculation.draft_tokens, accepted_tokens=s.speculation.accepted_tokens,
        draft_errors=s.draft_errors, completed_requests=s.completed_requests, cancelled_requests=s.cancelled_requests,
        control_plane_p50_us=s.control_plane_p50_us, control_plane_p99_us=s.control_plane_p99_us,
        adaptive_speculation=s.adaptive_speculation, adaptive_tree_nodes=s.adaptive_tree_nodes,
        adaptive_steps_by_tree_nodes=s.adaptive_decisions, chained_steps=s.chained_steps,
        draft_compute_p50_us=s.draft_compute_p50_us, draft_compute_p99_us=s.draft_compute_p99_us,
        decode_steps_ahead=s.decode_steps_ahead)
