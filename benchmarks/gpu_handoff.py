"""What handing GPU work back and forth costs the device when the two sides are two processes
(the verify and draft services, each with its own CUDA context) against two streams of one
process (the in-process engine): the device-side price of a chained step's two hand-offs.

    python benchmarks/gpu_handoff.py --rounds 400 --work-us 1500:400 --work-us 50:50 --out handoff.json

Each round side A queues ``A`` us of GPU work (``torch.cuda._sleep``) and records an event; side
B's stream waits for it, queues ``B`` us and records its own; A's stream waits for that. The
hosts only tell each other that an event is recorded (a pipe, or nothing within one process), so
they run ahead of the device and every microsecond past A + B a round is the device's: the wait
and, across processes, the switch between contexts. ``two_processes_host_waits``: each host waits
for the other side's event itself before it queues its work. Reports the device time per round and that
excess, for each case, in one run; then this process's host round trips (``_round_trips``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ipc_event_wait import sleep_cycles  # noqa: E402


def _side_b(conn, cycles: int) -> None:
    """The other process: wait for A's event, work, record, tell A."""
    device = torch.device("cuda", torch.cuda.current_device())
    theirs = torch.cuda.Event.from_ipc_handle(device, conn.recv())
    mine = torch.cuda.Event(interprocess=True)
    conn.send(bytes(mine.ipc_handle()))
    stream = torch.cuda.current_stream()
    while True:
        job = conn.recv()
        if job is None:
            break
        n, host_wait = job
        for _ in range(n):
            conn.recv()
            if host_wait:
                theirs.synchronize()
            else:
                stream.wait_event(theirs)
            torch.cuda._sleep(cycles)
            mine.record()
            conn.send(b"")
        torch.cuda.synchronize()
        conn.send(b"synced")


def _across(conn, a_cycles: int, rounds: int, mine: torch.cuda.Event, theirs: torch.cuda.Event,
            host_wait: bool = False) -> float:
    """Seconds of ``rounds`` hand-offs with the other process. ``host_wait``: each side's host waits
    for the other's event before it queues its work (no stream waits on the other's event)."""
    conn.send((rounds, host_wait))
    torch.cuda.synchronize()
    start = time.perf_counter()
    stream = torch.cuda.current_stream()
    for _ in range(rounds):
        torch.cuda._sleep(a_cycles)
        mine.record()
        conn.send(b"")
        conn.recv()
        if host_wait:
            theirs.synchronize()
        else:
            stream.wait_event(theirs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    conn.recv()  # the other side synced too
    return elapsed


def _within(a_cycles: int, b_cycles: int, rounds: int) -> float:
    """Seconds of ``rounds`` hand-offs between two streams of this process."""
    a, b = torch.cuda.current_stream(), torch.cuda.Stream()
    ea, eb = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        torch.cuda._sleep(a_cycles)
        ea.record(a)
        b.wait_event(ea)
        with torch.cuda.stream(b):
            torch.cuda._sleep(b_cycles)
        eb.record(b)
        a.wait_event(eb)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _round_trips(rounds: int) -> dict:
    """One process's host round trips (microseconds a round, median): a tiny kernel and an event
    synchronize; the same with an 8-byte copy to pinned host memory; a CUDA graph of 100 tiny
    kernels, replayed, then synchronized. What a step's launch and its one readback cost here
    (under MPS, every process is a client of its server)."""
    x = torch.zeros(2, device="cuda", dtype=torch.int32)
    host = torch.empty(2, dtype=torch.int32, pin_memory=True)
    done = torch.cuda.Event()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
        with torch.cuda.graph(graph, stream=side):
            for _ in range(100):
                x.add_(1)
    torch.cuda.synchronize()

    def kernel_sync():
        x.add_(1)
        done.record()
        done.synchronize()

    def kernel_copy_sync():
        x.add_(1)
        host.copy_(x, non_blocking=True)
        done.record()
        done.synchronize()

    def graph_sync():
        graph.replay()
        done.record()
        done.synchronize()

    out = {}
    for name, fn in (("kernel_sync_us", kernel_sync), ("kernel_copy_sync_us", kernel_copy_sync),
                     ("graph100_sync_us", graph_sync)):
        times = []
        for i in range(rounds + 20):
            t0 = time.perf_counter()
            fn()
            if i >= 20:
                times.append((time.perf_counter() - t0) * 1e6)
        out[name] = round(sorted(times)[len(times) // 2], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--work-us", action="append", default=None, metavar="A:B",
                    help="GPU microseconds of each side a round (repeatable; default 1500:400 and 50:50)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cases = [tuple(float(x) for x in w.split(":")) for w in (args.work_us or ["1500:400", "50:50"])]
    ctx = mp.get_context("spawn")
    device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.cuda.Event(interprocess=True)
    rows = []
    procs = {}
    try:
        for a_us, b_us in cases:
            a_cycles, b_cycles = sleep_cycles(a_us), sleep_cycles(b_us)
            if b_us not in procs:  # a side B per its work size (the cycles are fixed at its start)
                here_b, there_b = ctx.Pipe()
                p = ctx.Process(target=_side_b, args=(there_b, b_cycles))
                p.start()
                here_b.send(bytes(mine.ipc_handle()))
                theirs = torch.cuda.Event.from_ipc_handle(device, here_b.recv())
                procs[b_us] = (p, here_b, theirs)
            p, conn, theirs = procs[b_us]
            _within(a_cycles, b_cycles, 20)
            _across(conn, a_cycles, 20, mine, theirs)  # warm both
            runs = {"one_process_two_streams": _within(a_cycles, b_cycles, args.rounds),
                    "two_processes": _across(conn, a_cycles, args.rounds, mine, theirs),
                    "two_processes_host_waits": _across(conn, a_cycles, args.rounds, mine, theirs, True)}
            row = {"a_us": a_us, "b_us": b_us}
            for name, secs in runs.items():
                per_round = secs / args.rounds * 1e6
                row[name] = {"round_us": round(per_round, 1), "excess_us": round(per_round - a_us - b_us, 1)}
            row["cross_process_cost_us"] = round(row["two_processes"]["round_us"]
                                                 - row["one_process_two_streams"]["round_us"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p, conn, _ in procs.values():
            conn.send(None)
            p.join(30)
    trips = _round_trips(args.rounds)
    print(json.dumps({"round_trips": trips}), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds, "cases": rows,
              "round_trips": trips}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
