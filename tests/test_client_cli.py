"""``eagle3 client`` as a user runs it (a subprocess) against a real verify service (no draft):
info / metrics as text and JSON, prompts from a file and from stdin, a request error in one line."""

import json
import os
import subprocess
import sys

import pytest

from services import ROOT, Stack
from tiny_chat import tiny_chat_target

pytestmark = pytest.mark.slow  # the target speaks through SmolLM2's tokenizer


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model, _ = tiny_chat_target(tmp_path_factory.mktemp("client_cli"))
    s = Stack(tmp_path_factory.mktemp("stack"), model, None,
              verify_args=["--tree-depth", "4", "--tree-top-k", "3", "--tree-nodes", "12", "--num-kv-blocks", "64"])
    yield s
    s.close()


def eagle3(stack, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``eagle3 ARGS --server <the stack>``; ``stdin`` is fed to it."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args, "--server", stack.public], cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, input=stdin or "",
                          capture_output=True, text=True, timeout=120)


def fields(text: str) -> dict[str, str]:
    """``name  value`` lines as a dict."""
    return dict(line.split(None, 1) if " " in line.strip() else (line.strip(), "") for line in text.splitlines())


def test_info(stack):
    text = eagle3(stack, "client", "info")
    assert text.returncode == 0, text.stderr
    shown = fields(text.stdout)
    assert shown["speculation_configured"] == "yes" and shown["draft_connected"] == "no"
    assert (shown["limits.tree"], shown["limits.max_depth"], shown["limits.max_nodes"]) == ("dynamic", "4", "12")
    as_json = eagle3(stack, "client", "info", "--json")
    assert as_json.returncode == 0, as_json.stderr
    info = json.loads(as_json.stdout)
    assert info == stack.client.server_info()
    assert shown["model_name"] == info["model_name"] and shown["vocab_size"] == "49152"


def test_metrics(stack):
    before = stack.client.metrics()["completed_requests"]
    assert eagle3(stack, "client", "generate", "--max-tokens", "2", "Hello").returncode == 0
    as_json = eagle3(stack, "client", "metrics", "--json")
    assert as_json.returncode == 0, as_json.stderr
    metrics = json.loads(as_json.stdout)
    assert metrics["completed_requests"] == before + 1 and metrics["kv_blocks_total"] == 64
    shown = fields(eagle3(stack, "client", "metrics").stdout)
    assert shown.keys() == metrics.keys()
    assert shown["kv_blocks_total"] == "64" and shown["draft_connected"] == "no"


def test_prompt_file_and_stdin(stack, tmp_path):
    text = "Tell me about the sea.\nIn two lines."
    (tmp_path / "prompt.txt").write_text(text)
    for verb in ("generate", "chat"):
        positional = eagle3(stack, "client", verb, "--max-tokens", "8", text)
        from_file = eagle3(stack, "client", verb, "--max-tokens", "8", "--prompt-file", str(tmp_path / "prompt.txt"))
        from_stdin = eagle3(stack, "client", verb, "--max-tokens", "8", "--prompt-file", "-", stdin=text)
        assert positional.returncode == from_file.returncode == from_stdin.returncode == 0, positional.stderr
        assert from_file.stdout == from_stdin.stdout == positional.stdout != "\n"  # greedy: the same answer


def test_missing_prompt_file_is_one_line(stack, tmp_path):
    missing = str(tmp_path / "none.txt")
    proc = eagle3(stack, "client", "chat", "--prompt-file", missing)
    assert proc.returncode == 2
    assert proc.stderr == f"error: --prompt-file: cannot read {missing!r}: No such file or directory\n"


def test_request_error_is_said_once(stack):
    proc = eagle3(stack, "client", "chat", "--temperature", "-1", "Hi")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: INVALID_ARGUMENT: ") and proc.stderr.count("must be") == 1
    assert "temperature" in proc.stderr
