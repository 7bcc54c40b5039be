"""The command line (``cli.main``) with the verify engine's host phases timed, for
``services_bench.py --phases`` (``serve-draft``: the draft service's side of each step, see
``instrument_draft``): each engine step and its phases (``step_timeline.patched`` in clock
mode, with the calling thread's CPU time beside the wall time) and the engine thread's loop around
the steps (commands, dispatch, publish). The sums are cumulative and written to
``EAGLE3_PHASES_OUT`` (JSON, replaced whole) every 0.2 s; a reader takes the file before and after
a run, each time with the engine idle for longer than that, and subtracts.
``EAGLE3_SWITCH_INTERVAL_S`` sets the process's ``sys.setswitchinterval`` (how long a thread that
wants the GIL waits before it asks the holder to drop it; Python's default 0.005).

Wall minus CPU time is the time a phase was blocked: waiting for the device, the draft's answer,
or the GIL. Phases that neither touch the device nor the link (building rows, scheduling) are
blocked only on the GIL (or the OS scheduler).

    EAGLE3_PHASES_OUT=/tmp/phases.json python -m benchmarks.phased_serve serve-verify --model ...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENV_OUT = "EAGLE3_PHASES_OUT"
ENV_SWITCH = "EAGLE3_SWITCH_INTERVAL_S"
EVERY_S = 0.2
# (loop_commands holds the engine's idle waits for a command too: the wait before a run's first request
# falls in that run's sums. Read it as the loop's cost only where the engine never idled.)
LOOP_PHASES = (("_drain", "loop_commands"), ("_dispatch", "loop_dispatch"), ("_publish", "loop_publish"))


def _write_every(out: Path, wall: dict, cpu: dict, stop: threading.Event, calls: dict | None = None) -> None:
    tmp = out.with_suffix(".tmp")
    while True:
        tmp.write_text(json.dumps({"wall_s": dict(wall), "cpu_s": dict(cpu), "calls": dict(calls or {}),
                                   "written": time.time()}))
        os.replace(tmp, out)
        if stop.wait(EVERY_S):
            return


def _start_writer(stack: ExitStack, out: Path, wall: dict, cpu: dict, calls: dict | None = None) -> None:
    """The thread that writes the sums to ``out`` until ``stack`` closes."""
    stop = threading.Event()
    writer = threading.Thread(target=_write_every, args=(out, wall, cpu, stop, calls), name="phases-writer",
                              daemon=True)
    writer.start()
    stack.callback(writer.join)
    stack.callback(stop.set)


def instrument(out: Path) -> None:
    """From the engine thread's start on, time its engine's phases and its loop into ``out``. The
    thread's ``phases_stack`` (an ExitStack) undoes it all: the methods, and the writer."""
    from benchmarks.step_timeline import _wrap, patched
    from verify_service import engine_thread

    start = engine_thread.EngineThread.start

    def timed_start(self) -> None:
        wall: dict[str, float] = defaultdict(float)
        cpu: dict[str, float] = defaultdict(float)
        stack = ExitStack()  # entered for the process's life: kept on the thread's object (collected, the
        self.phases_stack = stack  # patching generator would close and restore every method)
        stack.enter_context(patched(self.engine, wall, cpu))
        for name, label in LOOP_PHASES:
            _wrap(self, name, label, stack, wall, cpu)
        _start_writer(stack, out, wall, cpu)
        start(self)

    engine_thread.EngineThread.start = timed_start


def instrument_draft(out: Path) -> ExitStack:
    """The draft service's side, from now on: each step's answer (chained or not), the drafter's work in
    it, the event wait, and the step socket's waits for frames and its sends, with their calls counted
    (``calls``; one answer a step). The returned stack undoes it."""
    import torch

    from benchmarks.step_timeline import _wrap
    from draft_service.drafter import EagleDrafter
    from draft_service.step_answer import StepAnswerer
    from link.step_socket import StepSocket

    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    stack = ExitStack()
    for obj, name, label in ((StepAnswerer, "chain", "answer_chained"), (StepAnswerer, "answer", "answer_step"),
                             (StepAnswerer, "_apply", "apply_frame"), (EagleDrafter, "step_on_device", "step_on_device"),
                             (EagleDrafter, "step", "drafter_step"), (torch.cuda.Stream, "wait_event", "wait_event"),
                             (StepSocket, "recv", "socket_recv"), (StepSocket, "send", "socket_send")):
        _wrap(obj, name, label, stack, wall, cpu, calls)
    _start_writer(stack, out, wall, cpu, calls)
    return stack


def read(path: Path) -> dict:
    """The cumulative sums now: {"wall_s": {label: s}, "cpu_s": {label: s}} (empty before the first write)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"wall_s": {}, "cpu_s": {}}


def per_step(before: dict, after: dict, steps: int) -> dict:
    """Milliseconds a step in each phase over the run between two ``read``s: {label: {wall, cpu, blocked}},
    the largest wall time first."""
    out = {}
    for label, w in after["wall_s"].items():
        dw = w - before["wall_s"].get(label, 0.0)
        dc = after["cpu_s"].get(label, 0.0) - before["cpu_s"].get(label, 0.0)
        if dw > 0:
            out[label] = {"wall": dw * 1e3 / steps, "cpu": dc * 1e3 / steps, "blocked": (dw - dc) * 1e3 / steps}
    return {k: {m: round(x, 4) for m, x in v.items()} for k, v in sorted(out.items(), key=lambda kv: -kv[1]["wall"])}


def main() -> int:
    if os.environ.get(ENV_SWITCH):
        sys.setswitchinterval(float(os.environ[ENV_SWITCH]))
    out = os.environ.get(ENV_OUT)
    if out and sys.argv[1:2] == ["serve-draft"]:
        instrument_draft(Path(out))
    elif out:
        instrument(Path(out))
    from cli.main import main as cli_main
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
