"""Where a step's wall time goes: host phases against device work, from one torch.profiler trace.

Each engine step and its main host phases are wrapped in profiler ranges (methods patched on
the engine's objects for the run, the code itself unchanged). From the trace:

- per phase: host milliseconds a step, and the device milliseconds of the kernels it launched
  (a CUDA graph's kernels carry its launch's correlation id);
- the device's busy time (the union of kernel and copy intervals) against the wall time, and
  every idle interval of the device attributed to the host phase that was running then: what
  the device waited for.

Used by ``profile_spec_step.py --timeline``; on a CPU only the host phases are reported. The
profiler adds its own cost to every host operation, so ``host_phases`` also times the phases with
the clock alone.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import verify_service.draft_coordinator as coordinator
from link.step_socket import StepSocket
from runtime.static_layout import StaticLayout
from runtime.step_layout import Readback
from verify_service.feed_buffer import StepRows

STEP = "step"


def _wrap(obj, name: str, label: str, stack: ExitStack, clock: dict | None = None, cpu: dict | None = None,
          calls: dict | None = None) -> None:
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        if cpu is not None:  # and the calling thread's CPU time: wall - CPU is time blocked (GIL, device, socket)
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                clock[label] += time.perf_counter() - t
                cpu[label] += time.thread_time() - c
                if calls is not None:
                    calls[label] += 1
        if clock is not None:  # host time only, no profiler: the phases' true cost on the host
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[label] += time.perf_counter() - t
        with record_function(label):
            return fn(*a, **k)

    own = obj.__dict__.get(name) if hasattr(obj, "__dict__") else None
    setattr(obj, name, wrapped)
    stack.callback(lambda: setattr(obj, name, own) if own is not None else delattr(obj, name))


@contextmanager
def patched(engine, clock: dict | None = None, cpu: dict | None = None):
    """The engine's step and phases wrapped in profiler ranges (or timed into ``clock``: label ->
    seconds; with ``cpu`` too, the calling thread's CPU seconds), for the ``with`` block. Methods of
    classes (``torch.Tensor.cpu``, ``StepRows.build``, ``Readback.wait``) are timed in every thread."""
    with ExitStack() as stack:
        phases = [(engine.scheduler, "schedule", "schedule"), (engine, "_chunks", "layout_trees"),
                  (engine.target.runner, "step", "target_forward"), (engine.sampler, "sample", "sample"),
                  (engine, "_launch_decode", "launch_decode"), (engine, "_commit", "commit")]
        if engine.drafter is not None:
            phases += [(engine, "_verify_ahead", "verify_ahead"), (engine.target.runner, "step_trees_on_device",
                                                                    "verify_graph"),
                       (engine, "_commit_trees", "commit_trees"), (engine.speculation, "attach", "attach"),
                       (engine.verifier, "accept", "accept"), (engine.verifier, "finish", "finish"),
                       (engine.speculation, "draft", "draft_call"),
                       (engine.speculation, "draft_on_device", "draft_chained"),
                       (engine, "attach_trees", "attach_trees"), (engine.speculation, "plain_ahead", "plain_ahead"),
                       (StepRows, "build", "step_rows"), (engine.feed_buffer, "add", "feed_add")]
            inner = getattr(engine.drafter, "_extend", None)
            if inner is not None:  # an in-process drafter: its two halves
                phases += [(engine.drafter, "_extend", "draft_extend"), (engine.drafter, "_propose_on_device", "draft_propose")]
        # Finer: the graphs' host sides, the tree checks, and the waits on the device.
        phases += [(engine.target.runner, "_replay", "target_graph"), (coordinator, "invalid_trees", "tree_checks"),
                   (torch.Tensor, "cpu", "wait_cpu"), (torch.Tensor, "tolist", "wait_tolist"),
                   (Readback, "wait", "wait_readback")]
        # The draft link's chained steps (a remote drafter) and what every graphed step shares.
        phases += [(engine.drafter, name, label) for name, label in
                   (("_chain_answer", "chain_answer"), ("_chain_trees", "chain_trees"))
                   if engine.drafter is not None and hasattr(engine.drafter, name)]
        phases += [(torch.cuda.CUDAGraph, "replay", "graph_replay"), (torch.cuda.Stream, "wait_event", "wait_event"),
                   (Readback, "start", "readback_start"), (StepSocket, "recv", "socket_recv"),
                   (StepSocket, "send", "socket_send"), (StaticLayout, "fill_roots", "fill_roots"),
                   (StaticLayout, "write_trees", "write_trees")]
        kernels = getattr(engine.drafter, "kernels", None)
        if kernels is not None:  # the chained trees' check, in the drafter's (frozen) kernel set
            holder = SimpleNamespace(sanitize_trees=kernels.sanitize_trees)
            _wrap(holder, "sanitize_trees", "sanitize_trees", stack, clock, cpu)
            engine.drafter.kernels = dataclasses.replace(kernels, sanitize_trees=holder.sanitize_trees)
            stack.callback(setattr, engine.drafter, "kernels", kernels)
        phases.append((torch, "cat", "torch_cat"))
        graphs = getattr(engine.drafter, "graphs", None)
        if graphs is not None:
            phases.append((graphs, "run_extend", "extend_graph"))
        for proposal in getattr(engine.drafter, "_proposals", {}).values():
            phases.append((proposal, "run", "proposal_run"))
        for chain in getattr(engine.drafter, "_chains", {}).values():
            if chain is not None:
                phases.append((chain, "launch", "chained_graph"))
        for obj, name, label in phases:
            _wrap(obj, name, label, stack, clock, cpu)
        _wrap(engine, "step", STEP, stack, clock, cpu)
        yield


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def analyse(trace: dict) -> dict:
    """Per-step milliseconds from a chrome trace of steps run under ``patched``."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == STEP)
    if not steps:
        raise ValueError("no step ranges in the trace")
    t0, t1 = steps[0][0], steps[-1][1]
    n = len(steps)
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ranges if e["name"] != STEP]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def phase_at(t: float) -> str:
        """The innermost phase running on the host at ``t`` (the step's own time outside them: 'other')."""
        best = None
        for a, b, name in phases:
            if a <= t < b and (best is None or b - a < best[1] - best[0]):
                best = (a, b, name)
        if best is not None:
            return best[2]
        return "step_other" if any(a <= t < b for a, b in steps) else "between_steps"

    host = defaultdict(float)
    for a, b, name in phases:
        if t0 <= a < t1:
            host[name] += (b - a) / 1e3
    device_by_phase = defaultdict(float)
    spans = []
    for e in device:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b < t0 or a > t1 + 50_000:
            continue
        spans.append((max(a, t0), min(b, t1) if b > t1 else b))
        launch = launches.get(e["args"].get("correlation"))
        device_by_phase[phase_at(launch) if launch is not None else "unknown"] += e["dur"] / 1e3
    busy = _union([(a, min(b, t1)) for a, b in spans if a < t1])
    idle_by_phase = defaultdict(float)
    cursor = t0
    for a, b in busy + [(t1, t1)]:
        if a > cursor:  # the device idle over [cursor, a): split by the host phase, 20 us at a time
            t = cursor
            while t < a:
                u = min(a, t + 20.0)
                idle_by_phase[phase_at((t + u) / 2)] += (u - t) / 1e3
                t = u
        cursor = max(cursor, b)
    wall = (t1 - t0) / 1e3
    per = lambda d: {k: round(v / n, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {"steps": n, "wall_ms": round(wall / n, 4),
            "device_busy_ms": round(sum(b - a for a, b in busy) / 1e3 / n, 4),
            "host_ms_by_phase": per(host), "device_ms_by_launching_phase": per(device_by_phase),
            "device_idle_ms_by_host_phase": per(idle_by_phase)}


def host_phases(engine, steps: int, sync) -> dict:
    """Host milliseconds a step in each phase, timed with the clock alone (no profiler overhead;
    a phase's time includes its waits on the device: the proposal's copy, the step's one copy)."""
    clock: dict[str, float] = defaultdict(float)
    with patched(engine, clock):
        engine.step()
        sync()
        clock.clear()
        for _ in range(steps):
            engine.step()
        sync()
    return {k: round(v / steps * 1e3, 4) for k, v in sorted(clock.items(), key=lambda kv: -kv[1])}


def timeline(engine, steps: int, sync, trace_out: str | None = None) -> dict:
    """Run ``steps`` engine steps under the profiler with the phases marked; returns ``analyse``'s dict."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with patched(engine):
        engine.step()  # the wrappers' first call outside the trace
        sync()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync()
    path = trace_out or str(Path(tempfile.mkdtemp(prefix="eagle3-trace-")) / "trace.json")
    prof.export_chrome_trace(path)
    return analyse(json.loads(Path(path).read_text()))
