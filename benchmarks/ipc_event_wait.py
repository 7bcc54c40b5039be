"""What a stream's wait for another process's CUDA event costs the waiting host: the mechanism the
draft link's chained steps rest on (verify_service/draft_link.py). Measured in one process against
a local event, then across two processes through an IPC event handle.

    python benchmarks/ipc_event_wait.py --rounds 200 --busy-us 2000 --out ipc_event_wait.json

Each round the recording side queues ``--busy-us`` of GPU work (``torch.cuda._sleep``), records
the event, and tells the waiting side (a pipe); the waiting side times ``stream.wait_event``, then
the launch of a small kernel behind it (both host calls), and the wait until that kernel ran. A
wait that returns at once is a GPU-side wait; one that takes about the recorder's remaining GPU
work blocks the host (the chained step's draft would then launch its work only after acceptance
has run). Reports the medians (us).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def sleep_cycles(busy_us: float) -> int:
    """GPU clock cycles ``torch.cuda._sleep`` spins for about ``busy_us`` microseconds (calibrated)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(busy_us * probe / (start.elapsed_time(end) * 1e3))


def _timed_wait(event: torch.cuda.Event, x: torch.Tensor) -> tuple[float, float, float]:
    """(wait_event call, launch behind it, until that launch ran), in microseconds."""
    stream = torch.cuda.current_stream()
    t0 = time.perf_counter()
    stream.wait_event(event)
    t1 = time.perf_counter()
    x.add_(1)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t0) * 1e6


def _recorder(conn, rounds: int, cycles: int) -> None:
    event = torch.cuda.Event(interprocess=True)
    conn.send(bytes(event.ipc_handle()))
    for _ in range(rounds):
        conn.recv()  # the waiter is ready
        torch.cuda._sleep(cycles)
        event.record()
        conn.send(b"recorded")
        torch.cuda.synchronize()
    conn.recv()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--busy-us", type=float, default=2000.0, help="GPU work queued before each record")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cycles = sleep_cycles(args.busy_us)
    x = torch.zeros(1, device="cuda")

    local = []
    event = torch.cuda.Event()
    for _ in range(args.rounds):
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(cycles)
            event.record()
        local.append(_timed_wait(event, x))

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_recorder, args=(there, args.rounds, cycles))
    proc.start()
    ipc = torch.cuda.Event.from_ipc_handle(torch.device("cuda", torch.cuda.current_device()), here.recv())
    remote = []
    for _ in range(args.rounds):
        here.send(b"ready")
        here.recv()
        remote.append(_timed_wait(ipc, x))
    here.send(b"done")
    proc.join(60)

    def medians(rows):
        return {name: round(statistics.median(r[i] for r in rows), 1)
                for i, name in enumerate(("wait_event_us", "launch_after_us", "until_ran_us"))}

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "busy_us": args.busy_us,
              "rounds": args.rounds, "local_event": medians(local), "ipc_event": medians(remote)}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
