"""A short soak (the CI version of benchmarks/soak.py): concurrent clients while the draft is
killed and restarted and the verify service restarts once; outputs stay exact and whole, and
the system ends idle with every KV block free."""

from benchmarks import soak
from tiny_eagle import make_eagle_dir
from tiny_models import make_model_dir, tiny_config


def test_short_soak_with_faults(tmp_path):
    model = make_model_dir(tmp_path / "target", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(tmp_path / "draft", tiny_config("llama3"), draft_vocab=64, seed=1)
    r = soak.main(["--model", str(model), "--draft", str(draft), "--device", "cpu", "--dtype", "float32",
                   "--clients", "4", "--seconds", "20", "--kill-every-s", "4", "--max-tokens", "16",
                   "--sample-every-s", "1", "--max-num-seqs", "8", "--verify-arg=--tree-nodes=12",
                   "--verify-arg=--tree-depth=4", "--verify-arg=--tree-top-k=3", "--trace-heap", "--heap-every-s", "2"])
    assert r["mismatched"] == 0 and r["wrong_length"] == 0 and r["errors"] == 0, r["error_samples"]
    assert r["greedy_completed"] > 10 and r["sampled_completed"] > 0
    assert r["draft_kills"] >= 1 and r["verify_restarts"] == 1
    assert r["kv_blocks_used_idle"] == 0
    heap = r["heap"]  # the first verify service's Python heap, traced until its restart
    assert heap["snapshots"] >= 2 and heap["first_mb"] > 0.2 and heap["last_mb"] > 0.2  # (imports untraced)
    assert all(g["kb"] > 0 and ":" in g["line"] for g in heap["top_growth"])


def test_gpu_memory_readings_and_slopes():
    """The soak's GPU memory per process (nvidia-smi's compute-apps CSV, two contexts of one pid
    summed, unreadable values skipped) and the least-squares slope it reports."""
    text = "1234, 2048\n1234, 512\n99, [N/A]\nNo running processes found\n77, 100\n"
    assert soak.gpu_memory_by_pid(text) == {1234: 2560.0, 77: 100.0}
    flat = [(t, 500.0) for t in range(0, 60, 5)]
    growing = [(t, 500.0 + t / 36) for t in range(0, 60, 5)]  # 100 MB an hour
    assert soak.slope_mb_per_hour(flat) == 0.0
    assert abs(soak.slope_mb_per_hour(growing) - 100.0) < 1e-6
    assert soak.slope_mb_per_hour(flat[:3]) is None  # too few samples
