"""The draft service across verify restarts: every re-handshake releases the old session's drafter
and shared mappings, so the draft process stays the size of one session (issue 19).

Linux only: the draft's memory is read from /proc. On the CPU the shared buffers are POSIX
segments, visible in /proc/PID/maps as /dev/shm/eagle3-<verify pid>-...; on a GPU (CUDA IPC)
only the RSS is checked.
"""

import sys
from pathlib import Path

import pytest

from services import Stack
from test_services import expected
from tiny_eagle import make_eagle_dir
from tiny_models import TEST_DEVICE, make_model_dir, tiny_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# 64 sequences of 4096 tokens: a draft KV cache of ~67 MB, so one session left alive is plain in the RSS.
VERIFY_ARGS = ["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3", "--max-model-len", "4096",
               "--max-num-seqs", "64", "--num-kv-blocks", "64"]
PROMPT, TOKENS = [5, 6, 7], 12
RSS_SLACK_MIB = 30  # allocator noise, far below the 67 MB of one leaked KV cache


def draft_memory(pid: int) -> tuple[int, list[str]]:
    """(VmRSS in MiB, paths of the mapped shared segments; a segment its exporter unlinked ends in '(deleted)')."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return rss_kib // 1024, sorted(line.split(maxsplit=5)[5] for line in maps if "/dev/shm/eagle3-" in line)


def test_verify_restarts_leave_the_draft_memory_flat(tmp_path):
    target = make_model_dir(tmp_path / "target", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(tmp_path / "draft", tiny_config("llama3"), draft_vocab=64, seed=1)
    want = expected(target, [PROMPT], [TOKENS])[0]
    s = Stack(tmp_path, target, draft, verify_args=VERIFY_ARGS, draft_args=["--reconnect-max-s", "0.5"])  # quick reconnects
    try:
        def serve():
            c = s.client.complete(PROMPT, max_tokens=TOKENS, ignore_eos=True)
            assert c.speculation["speculated"] and c.token_ids == want

        serve()
        rss0, segments0 = draft_memory(s.draft.proc.pid)
        # CPU: features, embedding, 3 tree tensors, 2 chain buffers; CUDA: the tree tensors (host memory)
        assert len(segments0) == (7 if TEST_DEVICE == "cpu" else 3)
        for i, kill in enumerate([False, True] * 2):  # SIGTERM, kill -9, SIGTERM, kill -9
            s.restart_verify(kill)
            serve()
            rss, segments = draft_memory(s.draft.proc.pid)
            live = f"/dev/shm/eagle3-{s.verify.proc.pid}-"
            assert len(segments) == len(segments0) and all(p.startswith(live) for p in segments), \
                f"restart {i + 1}: {segments}"
            assert rss <= rss0 + RSS_SLACK_MIB, f"restart {i + 1}: draft RSS {rss} MiB, {rss0} MiB after the first"
    finally:
        s.close()
