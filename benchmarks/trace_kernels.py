"""The device kernels of a chrome trace (``profile_spec_step.py --trace T.json``), in order: each
kernel's start (us, from the window's first), duration and gap to the one before, then the window's
span, busy time and kernel count, then the kernels by total time::

    python benchmarks/trace_kernels.py T.json              # the last fifth of the trace (one step of five)
    python benchmarks/trace_kernels.py T.json --parts 1    # all of it

With PDL (dependent launches) a kernel starts before the one ahead of it ends: a negative gap, and
its duration includes its wait. So the last table splits the window's span instead: each kernel is
charged the time from the latest end before it (or its own start, if later) to its own end, the
device's idle time before its start apart. Those charges and the idle time sum to the span: where
a step's time goes, overlaps counted once.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--parts", type=int, default=5, help="the trace holds this many steps: show the last")
    ap.add_argument("--width", type=int, default=70, help="characters of a kernel's name")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    window = events[-(len(events) // max(1, args.parts)):] if events else []
    print(f"kernels in the trace: {len(events)}; in the window: {len(window)}")
    if not window:
        return
    t0 = end = window[0]["ts"]
    for e in window:
        print(f"{e['ts'] - t0:9.1f} {e['dur']:7.1f} gap {e['ts'] - end:6.1f}  {e['name'][:args.width]}")
        end = e["ts"] + e["dur"]
    totals, idle, span = critical_path(window, args.width)
    print(f"span {span:.1f} us, busy {sum(e['dur'] for e in window):.1f} us, {len(window)} kernels, "
          f"idle {idle:.1f} us")
    print(" calls  duration  charged  name (by charged time: the span, overlaps counted once)")
    for name, (count, us, charged) in sorted(totals.items(), key=lambda kv: -kv[1][2]):
        print(f"{count:6d} {us:9.1f} {charged:8.1f}  {name}")


def critical_path(window: list[dict], width: int = 70) -> tuple[dict[str, list], float, float]:
    """Kernels (trace events sorted by start) -> ({name: [calls, summed duration, charged us]}, idle
    us, span us). A kernel is charged from the latest end before it (its own start, if the device
    was idle until then) to its own end, nothing if it ends before that; idle time is charged to no
    kernel. Charges and idle time sum to the span."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    if not window:
        return totals, 0.0, 0.0
    frontier, idle = window[0]["ts"], 0.0
    for e in window:
        start, stop = e["ts"], e["ts"] + e["dur"]
        row = totals[e["name"][:width]]
        row[0] += 1
        row[1] += e["dur"]
        if start > frontier:
            idle += start - frontier
            frontier = start
        if stop > frontier:
            row[2] += stop - frontier
            frontier = stop
    return totals, idle, frontier - window[0]["ts"]


if __name__ == "__main__":
    main()
