"""Long fuzzing run: the properties of tests/test_fuzz.py on many more cases, counted instead of asserted.

    python benchmarks/fuzz_public_api.py --cases 2000 --link-sessions 300 --link-handshakes 300 \\
        --out benchmarks/results/fuzz_public_api_cpu.json

Verify and draft services run on tiny random models (CPU). Public API: ``--cases`` hostile calls
(derandomized hypothesis: the same calls every run), then the figures: untyped statuses (INTERNAL,
UNKNOWN), other unexpected statuses (a hang, a dead server), malformed OK streams, greedy answers
unlike target-only decoding, crashes, and greedy reference outputs that changed after the run.
Internal draft link (the real draft stopped): ``--link-sessions`` fake-draft sessions with a
greedy client generation through each, and ``--link-handshakes`` handshakes, well formed or corrupt.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hypothesis import HealthCheck, given, settings  # noqa: E402

from fuzz_link import HANDSHAKE, FakeDraft, corrupt_handshakes, handshakes, session_plans  # noqa: E402
from fuzz_public import TYPED, UNTYPED, fuzz_public_api, start_stack  # noqa: E402

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


def link_figures(fake: FakeDraft, sessions: int, handshake_cases: int) -> dict:
    """Statuses of fuzzed link calls, and client outputs through fuzzed sessions that were wrong."""
    statuses = {"sessions": collections.Counter(), "handshakes": collections.Counter(),
                "corrupt_handshakes": collections.Counter()}
    wrong, examples = [0], []

    @settings(FUZZ, max_examples=sessions)
    @given(session_plans())
    def session(plan):
        outcome = fake.run_session(plan)
        statuses["sessions"].update(outcome.statuses)
        exact = outcome.output == fake.expected[plan.prompt]
        wrong[0] += not exact
        if not exact or set(outcome.statuses) - TYPED:
            examples.append(f"{plan} -> {outcome}")

    @settings(FUZZ, max_examples=handshake_cases)
    @given(handshakes())
    def handshake(raw):
        statuses["handshakes"][fake.call(HANDSHAKE, [raw])] += 1

    @settings(FUZZ, max_examples=handshake_cases)
    @given(corrupt_handshakes())
    def corrupt(raw):
        statuses["corrupt_handshakes"][fake.call(HANDSHAKE, [raw])] += 1

    for run, n in ((session, sessions), (handshake, handshake_cases), (corrupt, handshake_cases)):
        if n:
            run()
    return {"sessions": sessions, "handshakes": handshake_cases, "corrupt_handshakes": handshake_cases,
            "untyped_statuses": {k: sum(c[s] for s in UNTYPED) for k, c in statuses.items()},
            "wrong_outputs": wrong[0], "crashed": fake.stack.verify.proc.poll() is not None,
            "statuses": {k: dict(sorted(c.items())) for k, c in statuses.items()}, "examples": examples[:10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="public API calls")
    ap.add_argument("--link-sessions", type=int, default=300, help="fake-draft sessions (0: skip the link)")
    ap.add_argument("--link-handshakes", type=int, default=300, help="well-formed and as many corrupt handshakes")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    result = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "device": f"CPU ({os.cpu_count()} cores)"}
    with tempfile.TemporaryDirectory() as tmp:
        stack, target_dir = start_stack(Path(tmp), verify_args=["--draft-timeout-s", "2"])
        try:
            start = time.perf_counter()
            result["public"] = fuzz_public_api(stack, target_dir, args.cases, strict=False).figures()
            result["public"]["seconds"] = round(time.perf_counter() - start, 1)
            if args.link_sessions or args.link_handshakes:
                stack.draft.stop()
                fake, start = FakeDraft(stack), time.perf_counter()
                result["link"] = link_figures(fake, args.link_sessions, args.link_handshakes)
                result["link"]["seconds"] = round(time.perf_counter() - start, 1)
                fake.close()
        finally:
            stack.close()
    p = result["public"]
    print(f"public API: {p['cases']} cases in {p['seconds']} s, untyped statuses {p['untyped_statuses']}, "
          f"unexpected {p['unexpected_statuses']}, bad streams {p['bad_streams']}, greedy mismatches "
          f"{p['greedy_mismatches']}, crashes {p['crashes']}, wrong outputs after {p['wrong_outputs_after']}")
    print(f"statuses: {p['statuses']}")
    if "link" in result:
        link = result["link"]
        print(f"draft link: {link['sessions']} sessions, {link['handshakes']} + {link['corrupt_handshakes']} "
              f"handshakes in {link['seconds']} s, untyped statuses {link['untyped_statuses']}, wrong outputs "
              f"{link['wrong_outputs']}, crashed {link['crashed']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
