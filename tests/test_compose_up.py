"""`docker compose up` for real, on the CPU (compose.cpu.yaml): both services healthy, and the answer
streamed through the published port is the in-process answer, token for token.

benchmarks/compose_startup.py does the work (build the CPU image, `up -d`, time until both health
checks pass, stream, compare, `down -v`); this test runs it once and reports the startup time as
``compose_ci_startup_s`` (printed, and written as JSON to $EAGLE3_COMPOSE_STARTUP_JSON when set).
It skips, saying why, on a machine without a Docker engine, a compose, the base image or the
wheels for it: ``.ci/docker-setup`` provides them (CI runs it before the tests).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import compose_startup  # noqa: E402

pytestmark = pytest.mark.docker


def test_compose_up_serves_the_in_process_answer(tmp_path, capsys):
    lines = []
    try:
        result = compose_startup.run(max_tokens=32, log=lines.append)
    except compose_startup.Unavailable as e:
        with capsys.disabled():
            print(f"\n[docker compose test skipped: {e}]")
        pytest.skip(f"docker compose up on the CPU: {e}")
    out = Path(os.environ.get("EAGLE3_COMPOSE_STARTUP_JSON") or tmp_path / "compose_startup_cpu.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    with capsys.disabled():
        print(f"\ncompose_ci_startup_s={result['compose_ci_startup_s']} (verify healthy at "
              f"{result['verify_healthy_s']} s, build {result['build_s']} s; JSON: {out})")
    assert result["answer_token_ids"] == result["inprocess_token_ids"], "\n".join(lines)
    assert len(result["answer_token_ids"]) > 0
    # The draft container took part: its trees were verified and some of their tokens accepted.
    spec = result["speculation"] or {}
    assert spec.get("speculated") and spec.get("accepted_tokens", 0) > 0, spec
    assert result["server_info"].get("draft_connected") is True, result["server_info"]
