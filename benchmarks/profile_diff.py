"""Where one engine's host time goes beyond another's: two cProfile dumps of the same work (say
``row_breakdown.py --profile``'s target-only and adaptive rounds), each function's own time and
calls in both, the largest differences first.

    python benchmarks/profile_diff.py base.pstats other.pstats [--top 40] [--per 131]

``--per N``: divide by N (the steps of a round: microseconds a step).
"""

from __future__ import annotations

import argparse
import pstats


def own_times(path: str) -> dict[str, tuple[int, float]]:
    """Function -> (calls, own seconds)."""
    stats = pstats.Stats(path).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    return {f"{f.rsplit('/', 2)[-1] if '/' in f else f}:{line}({name})": (nc, tt)
            for (f, line, name), (_, nc, tt, _, _) in stats.items()}


def diff(base: str, other: str, top: int = 40, per: float = 1.0) -> list[tuple[str, int, int, float, float]]:
    """(function, base calls, other calls, base us, other us), by |other - base| own time, largest first."""
    a, b = own_times(base), own_times(other)
    rows = []
    for key in a.keys() | b.keys():
        (na, ta), (nb, tb) = a.get(key, (0, 0.0)), b.get(key, (0, 0.0))
        rows.append((key, na, nb, ta * 1e6 / per, tb * 1e6 / per))
    rows.sort(key=lambda r: -abs(r[4] - r[3]))
    return rows[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--per", type=float, default=1.0, help="divide times by this (steps: us a step)")
    args = ap.parse_args(argv)
    total = [sum(t for _, t in own_times(p).values()) * 1e6 / args.per for p in (args.base, args.other)]
    print(f"total own time: {total[0]:.1f} -> {total[1]:.1f} us ({total[1] - total[0]:+.1f})")
    print(f"{'us base':>10} {'us other':>10} {'diff':>9} {'calls':>14}  function")
    for key, na, nb, ta, tb in diff(args.base, args.other, args.top, args.per):
        print(f"{ta:10.1f} {tb:10.1f} {tb - ta:+9.1f} {na:>6}->{nb:<7}  {key}")


if __name__ == "__main__":
    main()
