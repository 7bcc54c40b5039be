"""Training EAGLE-3 heads: the unrolled training forward agrees with inference, loss falls,
vocabulary maps are consistent, checkpoints round-trip, bad inputs fail clearly."""

import numpy as np
import pytest
import torch

from common.draft_protocol import DraftFeed
from common.spec_config import SpecConfig
from common.step_layout import SeqChunk
from draft_service.drafter import EagleDrafter
from draft_service.train.ttt import ttt_forward
from tiny_eagle import make_eagle_dir
from tiny_models import engine_for, make_model_dir, tiny_config

IDS = [(7 * i + 3) % 90 for i in range(24)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_model_dir(root / "target", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(root / "head", tiny_config("llama3"), draft_vocab=64, seed=2, std=0.1)
    engine = engine_for(target, dtype="float32", device="cpu")
    drafter = EagleDrafter.from_checkpoint(SpecConfig(str(head), tree="chain", depth=3), engine.model_config,
                                           engine.model.model.embed_tokens.weight, 4, engine.max_model_len)
    engine.runner.set_capture_layers(drafter.capture_layers)
    engine.blocks.ensure_capacity(0, len(IDS))
    feats = engine.runner.step([SeqChunk(IDS, 0, engine.blocks.block_table(0))]).captured
    return engine, drafter, head, feats


def fresh_drafter(setup):
    engine, _, head, _ = setup
    return EagleDrafter.from_checkpoint(SpecConfig(str(head), tree="chain", depth=3), engine.model_config,
                                        engine.model.model.embed_tokens.weight, 4, engine.max_model_len)


@torch.no_grad()
def test_training_unroll_matches_inference_steps_0_and_1(setup):
    engine, drafter, head, feats = setup
    n = len(IDS)
    out = ttt_forward(drafter.net, torch.tensor([IDS]), feats[None], steps=2)
    # step 0, row n-2: the drafter's newest committed row (f_{n-2}, x_{n-1})
    ref = fresh_drafter(setup)
    ref.step([DraftFeed(0, 0, feats[:-1], np.asarray(IDS[1:]))], [])
    torch.testing.assert_close(out.logits[0][0, n - 2].log_softmax(-1), ref.last_logp[0], atol=1e-5, rtol=1e-5)
    # step 1, row n-3: a depth-1 node (token x_{n-1}) below committed rows 0..n-3
    ref = fresh_drafter(setup)
    ref.step([DraftFeed(0, 0, feats[:n - 2], np.asarray(IDS[1:n - 1]))], [])
    m = n - 2
    ref.blocks.ensure_capacity(0, m + 1)
    _, logp = ref._run([SeqChunk([IDS[n - 1]], m, ref.blocks.block_table(0), logits_rows=(0,), positions=[m])],
                       ref.last_out[0][None])
    torch.testing.assert_close(out.logits[1][0, n - 3].log_softmax(-1), logp[0], atol=1e-5, rtol=1e-5)
