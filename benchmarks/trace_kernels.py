"""The device kernels of a chrome trace (``profile_spec_step.py --trace T.json``), in order: each
kernel's start (us, from the window's first), duration and gap to the one before, then the window's
span, busy time and kernel count, then the kernels by total time::

    python benchmarks/trace_kernels.py T.json              # the last fifth of the trace (one step of five)
    python benchmarks/trace_kernels.py T.json --parts 1    # all of it

With PDL (dependent launches) a kernel starts before the one ahead of it ends: a negative gap, and
its duration includes its wait.
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
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in window:
        name = e["name"][:args.width]
        print(f"{e['ts'] - t0:9.1f} {e['dur']:7.1f} gap {e['ts'] - end:6.1f}  {name}")
        end = e["ts"] + e["dur"]
        totals[name][0] += 1
        totals[name][1] += e["dur"]
    print(f"span {end - t0:.1f} us, busy {sum(e['dur'] for e in window):.1f} us, {len(window)} kernels")
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{count:4d} {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
