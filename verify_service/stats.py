"""The verify service's counters as one snapshot, read by GetMetrics and by Prometheus' /metrics.

The snapshot is taken on the engine thread between two steps (``EngineThread.read``): it is
consistent, the engine never waits for a reader, and a reader waits at most one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from verify_service.sequence import SpeculationMetrics

if TYPE_CHECKING:
    from verify_service.draft_link import RemoteDraft
    from verify_service.engine import Engine
    from verify_service.engine_thread import EngineThread


@dataclass(frozen=True, slots=True)
class VerifyStats:
    running_requests: int
    waiting_requests: int
    completed_requests: int
    cancelled_requests: int
    generated_tokens: int  # committed tokens over every request since start
    kv_blocks_used: int
    kv_blocks_total: int
    speculative_steps: int  # engine steps that verified at least one tree
    plain_steps: int  # engine steps without any tree
    speculation: SpeculationMetrics  # totals over every request since start (steps: trees verified)
    draft_connected: bool
    draft_sessions: int
    draft_errors: int  # refused trees, timeouts, lost sessions
    refused_trees: int  # the engine's part of draft_errors
    control_plane_p50_us: float
    control_plane_p99_us: float
    adaptive_speculation: bool = False  # the tree size is chosen per step (verify_service/adaptive.py)
    adaptive_tree_nodes: int = 0  # its latest choice: nodes per tree (0: plain decoding)
    adaptive_decisions: dict[int, int] = field(default_factory=dict)  # choice -> steps it was made for
    detached_requests: int = 0  # requests that started where trees did not pay: run without the draft
    left_draft_requests: int = 0  # running requests that left the draft where plain decoding was chosen
    chained_steps: int = 0  # steps whose draft work went in behind acceptance on the device
    draft_compute_p50_us: float = 0.0  # the draft's own time per step, as it reports it
    draft_compute_p99_us: float = 0.0
    decode_steps_ahead: int = 0  # plain steps launched before the last step's tokens reached the host


def read_stats(loop: EngineThread, remote: RemoteDraft | None, timeout_s: float | None = None) -> VerifyStats:
    """The counters as of the last step (concurrent.futures.TimeoutError after ``timeout_s``)."""
    return loop.read(snapshot_fn(loop, remote), timeout_s)


def latest_stats(loop: EngineThread, remote: RemoteDraft | None) -> VerifyStats:
    """The snapshot the engine thread published after its last step or command: answers at once,
    however long the step in progress takes (a long prefill chunk on a CPU takes seconds)."""
    published = loop.published
    return _with_link(read_stats(loop, remote) if published is None else published, remote)


def _with_link(stats: VerifyStats, remote: RemoteDraft | None) -> VerifyStats:
    """The link's own counters, read live: they move on gRPC threads (a draft lost while the engine
    idles), and their percentiles cost a sort that the snapshot after every step should not pay."""
    if remote is None:
        return stats
    p50, p99 = remote.overhead_percentiles_us()
    c50, c99 = remote.draft_compute_percentiles_us()
    return replace(stats, draft_connected=remote.connected, draft_sessions=remote.sessions_opened,
                   draft_errors=stats.refused_trees + remote.errors, control_plane_p50_us=p50,
                   control_plane_p99_us=p99, draft_compute_p50_us=c50, draft_compute_p99_us=c99)


def snapshot_fn(loop: EngineThread, remote: RemoteDraft | None):
    """engine -> VerifyStats, to run on the engine thread (the link's counters: ``latest_stats``)."""
    def snapshot(engine: Engine) -> VerifyStats:
        blocks = engine.target.blocks
        return VerifyStats(
            running_requests=len(engine.scheduler.running), waiting_requests=len(engine.scheduler.waiting),
            completed_requests=loop.completed, cancelled_requests=loop.cancelled,
            generated_tokens=loop.generated_tokens, kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks, speculative_steps=loop.steps_with_trees, plain_steps=loop.plain_steps,
            speculation=engine.speculation_totals(), draft_connected=False, draft_sessions=0,
            draft_errors=engine.draft_errors, refused_trees=engine.draft_errors,
            control_plane_p50_us=0.0, control_plane_p99_us=0.0,
            chained_steps=engine.speculation.chained_steps if engine.speculation else 0,
            decode_steps_ahead=engine.decode_steps_ahead, **_adaptive(engine))
    return snapshot


def _adaptive(engine: Engine) -> dict:
    policy = engine.policy
    if policy is None:
        return {}
    return {"adaptive_speculation": True, "adaptive_tree_nodes": policy.choice,
            "adaptive_decisions": dict(policy.decisions), "detached_requests": engine.speculation.detacher.detached_requests,
            "left_draft_requests": engine.speculation.detacher.left_requests}
