"""Data-parallel head training: two processes (torchrun, gloo on the CPU) with a global batch
of 4 follow the same trajectory as one process with the same batch."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.train.trainer import Trainer, TrainConfig
from tiny_chat import tiny_chat_target

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(draft_vocab=512, steps=6, batch=4, lr=3e-3, ttt_steps=3, max_new_tokens=16, eval_every=6)


def saved_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "state.pt", weights_only=True)["tensors"]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_the_whole_batch(tmp_path):
    model, prompts = tiny_chat_target(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    Trainer(TrainConfig(str(model), str(prompts), str(one), device="cpu", **SETTINGS), progress=False).train()
    two.mkdir()
    shutil.copy(one / "examples.jsonl", two / "examples.jsonl")  # distilled once, trained on by both
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "cli.main", "train-draft", "--target", str(model), "--prompts", str(prompts),
           "--out", str(two), "--device", "cpu", *flags]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "autograd kernel was not registered" not in run.stderr  # the start-up broadcast is not in the graph
    a, b = saved_weights(one), saved_weights(two)
    assert int(a["step"]) == int(b["step"]) == 6
    for name, t in a.items():
        if t.is_floating_point():
            torch.testing.assert_close(b[name], t, atol=2e-5, rtol=1e-4, msg=name)
    start = Trainer(TrainConfig(str(model), str(prompts), str(tmp_path / "fresh"), device="cpu", **SETTINGS),
                    progress=False)
    net, _ = start.build_head(start.prepare())
    moved = sum(not torch.equal(p.detach(), a[f"model.{n}"]) for n, p in net.named_parameters())
    assert moved >= 10  # the weights did train (the comparison is not between two starting points)
    assert (two / "head" / "model.safetensors.index.json").is_file()  # exported once, by rank 0
