"""Where one thread of a py-spy recording spends its time: ``py-spy record --format raw --idle
--threads`` (as ``services_bench.py --py-spy`` writes them) summed per function (inclusive) and per
(last project frame, leaf) pair, as shares of the thread's samples.

    python benchmarks/pyspy_summary.py services.verify_c1.pyspy.txt engine-thread
    python benchmarks/pyspy_summary.py services.verify_c16.pyspy.txt     # samples per thread

A recording made with ``--gil`` (``services_bench.py --py-spy-gil``) samples only the thread holding
the GIL: per thread, how long each held it.
"""

from __future__ import annotations

import argparse
import collections
import re

PROJECT = re.compile(r"\((verify_service|draft_service|runtime|kernels|link|common)/")


def summarize(path: str, thread: str, top: int = 45) -> str:
    inclusive, leaves, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if thread not in frames[0]:
            continue
        n = int(count)
        total += n
        names = [re.sub(r" \(.*?\)$", "", f) for f in frames[1:]]
        for name in set(names):
            inclusive[name] += n
        project = [f for f in frames[1:] if PROJECT.search(f)]
        leaves[f"{project[-1] if project else '-'} :: {names[-1] if names else '(no Python frame)'}"] += n
    lines = [f"{path}, thread {thread!r}: {total} samples"]
    lines += [f"{100 * v / total:5.1f}% {k}" for k, v in inclusive.most_common(top)]
    lines.append("--- by last project frame :: leaf")
    lines += [f"{100 * v / total:5.1f}% {k}" for k, v in leaves.most_common(top)]
    return "\n".join(lines)


def per_thread(path: str) -> str:
    """Samples per thread (with ``--gil`` recordings: how long each thread held the GIL)."""
    counts, total = collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        counts[re.sub(r" \d+$", "", stack.split(";")[0])] += int(count)
        total += int(count)
    return "\n".join([f"{path}: {total} samples"] + [f"{n:7d} {100 * n / total:5.1f}% {t}"
                                                       for t, n in counts.most_common()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recording")
    ap.add_argument("thread", nargs="?", help="part of the thread's name, e.g. engine-thread or MainThread "
                                              "(none: the samples of every thread, per thread)")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    print(summarize(args.recording, args.thread, args.top) if args.thread else per_thread(args.recording))


if __name__ == "__main__":
    main()
