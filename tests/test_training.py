"""Training EAGLE-3 heads: the unrolled training forward agrees with inference, loss falls,
vocabulary maps are consistent, checkpoints round-trip, bad inputs fail clearly."""

import numpy as np
import pytest
import torch

from link.protocol import DraftFeed
from draft_service.spec_config import SpecConfig
from runtime.step_layout import SeqChunk
from draft_service.drafter import EagleDrafter
from tools.train.ttt import ttt_forward
from tiny_eagle import make_eagle_dir
from tiny_models import target_for, make_model_dir, tiny_config

IDS = [(7 * i + 3) % 90 for i in range(24)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir = make_model_dir(root / "target", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(root / "head", tiny_config("llama3"), draft_vocab=64, seed=2, std=0.1)
    target = target_for(target_dir, dtype="float32", device="cpu")
    drafter = EagleDrafter.from_checkpoint(SpecConfig(str(head), tree="chain", depth=3), target.model_config,
                                           target.model.model.embed_tokens.weight, 4, target.max_model_len)
    target.runner.set_capture_layers(drafter.capture_layers)
    target.blocks.ensure_capacity(0, len(IDS))
    feats = target.runner.step([SeqChunk(IDS, 0, target.blocks.block_table(0))]).captured
    return target, drafter, head, feats


def fresh_drafter(setup):
    target, _, head, _ = setup
    return EagleDrafter.from_checkpoint(SpecConfig(str(head), tree="chain", depth=3), target.model_config,
                                        target.model.model.embed_tokens.weight, 4, target.max_model_len)


@torch.no_grad()
def test_training_unroll_matches_inference_steps_0_and_1(setup):
    target, drafter, head, feats = setup
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


# --- the training tool end to end, on a tiny target with SmolLM2's tokenizer -----------------

import json  # noqa: E402

from common.errors import InvalidRequestError, ModelNotFoundError  # noqa: E402
from draft_service.eagle_loader import load_eagle  # noqa: E402
from tools.train.trainer import Trainer, TrainConfig  # noqa: E402
from tools.train.vocab import select_draft_vocab  # noqa: E402

from tiny_chat import tiny_chat_target  # noqa: E402


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    return tiny_chat_target(tmp_path_factory.mktemp("tt"))


def train_cfg(model, prompts, out, **kw):
    base = dict(draft_vocab=512, steps=40, batch=4, lr=3e-3, ttt_steps=3, max_new_tokens=16, eval_every=40,
                eval_examples=4, device="cpu")
    return TrainConfig(str(model), str(prompts), str(out), **{**base, **kw})


@pytest.mark.slow
def test_training_lowers_the_loss_and_exports_a_loadable_head(tiny_with_tokenizer, tmp_path):
    model, prompts = tiny_with_tokenizer
    trainer = Trainer(train_cfg(model, prompts, tmp_path), progress=False)
    examples = trainer.prepare()
    seen = examples[4:]  # the training split (the first 4 are held out)
    before = trainer.evaluate(trainer.build_head(examples)[0], seen)  # same seed: the run's initial head
    head = trainer.train()
    after = trainer.evaluate(trainer.net, seen)
    assert len(trainer.last_eval) == 3  # held-out metrics for each unrolled step
    assert all(a["loss"] < b["loss"] - 0.5 for a, b in zip(after, before)), (before, after)
    shards = sorted(p.name for p in head.glob("*.safetensors"))
    assert shards and (head / "model.safetensors.index.json").is_file()
    loaded = load_eagle(head, trainer.target.model_config, trainer.target.model.model.embed_tokens.weight,
                        torch.float32, "cpu", 512)
    ids = loaded.d2t + torch.arange(512)
    assert loaded.t2d.sum() == 512 and loaded.t2d[ids].all() and 2 in ids.tolist()  # eos is always drafted
    # resuming a finished run trains no further and exports the same head
    again = Trainer(train_cfg(model, prompts, tmp_path), progress=False)
    again.train()
    assert not hasattr(again, "last_eval")


def test_vocab_selection_is_consistent_and_validated():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = select_draft_vocab(counts, 3, always=(1,))
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [1, 2, 3] and t2d.tolist() == [False, True, True, True, False, False]
    with pytest.raises(InvalidRequestError, match="draft_vocab_size"):
        select_draft_vocab(counts, 7)


def test_bad_training_inputs(tiny_with_tokenizer, tmp_path):
    model, _ = tiny_with_tokenizer
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidRequestError, match="holds no prompts"):
        Trainer(train_cfg(model, empty, tmp_path / "o"), progress=False)
    with pytest.raises(ModelNotFoundError, match="prompt file"):
        Trainer(train_cfg(model, tmp_path / "missing.jsonl", tmp_path / "o"), progress=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    with pytest.raises(InvalidRequestError, match="exceeds the target vocabulary"):
        Trainer(train_cfg(model, prompts, tmp_path / "o", draft_vocab=100_000), progress=False)
    with pytest.raises(InvalidRequestError, match="steps"):
        train_cfg(model, prompts, tmp_path / "o", steps=0)


@pytest.mark.slow
def test_time_limit_stops_with_state_and_the_same_command_resumes(tiny_with_tokenizer, tmp_path):
    model, prompts = tiny_with_tokenizer
    assert Trainer(train_cfg(model, prompts, tmp_path, time_limit_s=0.0), progress=False).train() is None
    assert not (tmp_path / "examples.jsonl").exists() or not (tmp_path / "examples.jsonl").read_text()
    partial = Trainer(train_cfg(model, prompts, tmp_path, steps=10, time_limit_s=None), progress=False)
    assert partial.train() is not None
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert int(saved["tensors"]["step"]) == 10
    longer = Trainer(train_cfg(model, prompts, tmp_path, steps=14), progress=False)
    assert longer.train() is not None  # resumed at 10, ran 4 more
    assert int(torch.load(tmp_path / "state.pt", weights_only=True)["tensors"]["step"]) == 14


def test_learning_rate_warms_up_then_decays_to_a_tenth(tiny_with_tokenizer, tmp_path):
    model, prompts = tiny_with_tokenizer
    cfg = train_cfg(model, prompts, tmp_path, steps=100, lr=1e-3, warmup_steps=10)
    lrs = [cfg.lr_at(s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # non-increasing after warm-up
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    with pytest.raises(InvalidRequestError, match="warmup_steps"):
        train_cfg(model, prompts, tmp_path, steps=10, warmup_steps=10)


# --- the head shipped for the embedded SmolLM2, through the evaluation command ----------------

from draft_service.spec_config import DEFAULT_DRAFT  # noqa: E402
from hub.default_model import shipped_head_dir  # noqa: E402


def test_default_names_the_shipped_head():
    spec = SpecConfig(DEFAULT_DRAFT, tree="chain", depth=3)
    assert spec.draft_path == str(shipped_head_dir())
    assert (shipped_head_dir() / "model.safetensors.index.json").is_file()
    assert (shipped_head_dir() / "README.md").is_file()  # its model card


@pytest.mark.slow
def test_shipped_head_speculates_exactly_and_accepts_tokens(tmp_path):
    from hub.default_model import ensure_default_model
    from tools.evaluate import evaluate, format_table

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in
                               ("What is the capital of France?", "Give three tips for staying healthy.")))
    report = evaluate(str(ensure_default_model(progress=False)), DEFAULT_DRAFT, [str(prompts)], ["chain:3"],
                      max_tokens=48, batch=2, device="cpu", dtype="float32", report=lambda *_: None)
    base, chain = report["results"]["p"]
    assert chain["identical_outputs"] == 2  # greedy speculative output == target-only output (fp32)
    assert chain["tau"] > 1.8, chain  # a random head gives ~1.0; the shipped one 2.12 (CPU, fp32)
    assert len(chain["acceptance_per_depth"]) == 3
    assert 0.9 < base["draft_vocab_coverage"] <= 1.0, base  # the shipped vocabulary holds nearly every token
    assert "| p | chain:3 |" in format_table(report)
    assert "p: the draft vocabulary holds" in format_table(report)


def test_vocab_coverage_counts_output_tokens_inside_the_draft_vocabulary():
    from tools.evaluate import vocab_coverage

    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 2, 3]] = True
    assert vocab_coverage([[1, 2, 9], [3, 0]], mask) == 0.6  # 3 of 5 tokens
    assert vocab_coverage([[]], mask) == 1.0


def test_batches_are_deterministic_in_seed_and_step_across_epochs():
    from tools.train.data import Example, iter_batches

    examples = [Example([i], 0) for i in range(23)]
    run = iter_batches(examples, 5, seed=3)
    batches = [next(run) for _ in range(12)]  # 4 batches an epoch: 3 epochs
    resumed = iter_batches(examples, 5, seed=3, start_step=6)
    assert [next(resumed) for _ in range(6)] == batches[6:]  # a resumed run sees the same order
    epochs = [sorted(e.ids[0] for b in batches[i:i + 4] for e in b) for i in (0, 4, 8)]
    assert all(len(set(e)) == 20 for e in epochs)  # no example twice within an epoch
    assert batches[:4] != batches[4:8]  # each epoch reshuffled


def test_batches_group_similar_lengths():
    import random

    from tools.train.data import Example, iter_batches

    rng = random.Random(0)
    examples = [Example(list(range(rng.randint(20, 700))), 10) for _ in range(640)]
    padded = lambda batches: sum(len(b) * max(len(e.ids) for e in b) for b in batches)  # noqa: E731
    bucketed = iter_batches(examples, 16, seed=1, bucket_batches=20)
    mixed = iter_batches(examples, 16, seed=1, bucket_batches=1)
    first, plain = [next(bucketed) for _ in range(40)], [next(mixed) for _ in range(40)]  # one epoch each
    real = sum(len(e.ids) for e in examples)
    assert sorted(id(e) for b in first for e in b) == sorted(id(e) for e in examples)  # each example once
    assert padded(first) < 1.1 * real < 1.5 * real < padded(plain)  # padding: <10% bucketed, >50% mixed
    assert {len(b) for b in first} == {16}  # full batches
    lengths = [max(len(e.ids) for e in b) for b in first]
    assert lengths != sorted(lengths)  # batch order is shuffled, not longest-last


def test_training_step_profiler_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tiny_models import make_model_dir

    model = make_model_dir(tmp_path / "m", "smollm2", vocab_size=512, max_position_embeddings=512)
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "train_step_profile.py"
    run = subprocess.run([sys.executable, str(script), "--geometry", str(model), "--batch", "2", "--prompt-len", "12",
                          "--answer-len", "8", "--draft-vocab", "64", "--steps", "2", "--ttt-steps", "2", "--device",
                          "cpu", "--no-profile"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "whole step" in run.stdout and "target forward + logits" in run.stdout


@pytest.mark.slow
def test_a_new_vocabulary_carries_the_init_heads_rows_over(tiny_with_tokenizer, tmp_path):
    from tools.train.vocab import token_counts

    model, prompts = tiny_with_tokenizer
    first = Trainer(train_cfg(model, prompts, tmp_path, steps=4), progress=False)
    old = load_eagle(first.train(), first.target.model_config, first.target.model.model.embed_tokens.weight,
                     torch.float32, "cpu", 512)
    second = Trainer(train_cfg(model, prompts, tmp_path, draft_vocab=600, init_head=str(tmp_path / "head"),
                               new_vocab=True), progress=False)
    examples = second.prepare()  # the same answers, read back
    net, _ = second.build_head(examples)
    counts = token_counts((e.ids[e.answer_start:] for e in examples), 49152)
    d2t, _ = select_draft_vocab(counts, 600, second.target.model_config.eos_token_ids)
    assert torch.equal(net.d2t, d2t)  # chosen from this run's answers
    for name, t in old.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            torch.testing.assert_close(net.state_dict()[name], t, rtol=0, atol=0, msg=name)
    new_ids, old_ids = (torch.arange(600) + net.d2t).tolist(), (torch.arange(512) + old.d2t).tolist()
    assert set(old_ids) <= set(new_ids)  # the 512 most frequent ids are among the 600 most frequent
    row = {t: i for i, t in enumerate(new_ids)}
    carried = torch.tensor([row[t] for t in old_ids])
    assert torch.equal(net.lm_head.weight[carried], old.lm_head.weight)  # each row followed its target id
    fresh = torch.ones(600, dtype=torch.bool)
    fresh[carried] = False
    norms = net.lm_head.weight.detach().norm(dim=1)
    assert norms[fresh].mean().item() == pytest.approx(norms[~fresh].mean().item(), rel=1e-4)
    with pytest.raises(InvalidRequestError, match="--new-vocab"):
        Trainer(train_cfg(model, prompts, tmp_path, draft_vocab=600, init_head=str(tmp_path / "head")),
                progress=False).build_head(examples)
    with pytest.raises(InvalidRequestError, match="new_vocab"):
        train_cfg(model, prompts, tmp_path, new_vocab=True)


@pytest.mark.slow
def test_widening_the_mlp_keeps_the_heads_output_and_round_trips(tiny_with_tokenizer, tmp_path):
    model, prompts = tiny_with_tokenizer
    import shutil

    first = Trainer(train_cfg(model, prompts, tmp_path, steps=4), progress=False)
    old = load_eagle(first.train(), first.target.model_config, first.target.model.model.embed_tokens.weight,
                     torch.float32, "cpu", 512)  # the exported (fp16) head, as the next run reads it
    width = old.config.intermediate_size
    for run in ("wide", "again"):  # the same answers: no second distillation
        (tmp_path / run).mkdir()
        shutil.copy(tmp_path / "examples.jsonl", tmp_path / run / "examples.jsonl")
    wide = Trainer(train_cfg(model, prompts, tmp_path / "wide", init_head=str(tmp_path / "head"),
                             draft_intermediate=2 * width, steps=3), progress=False)
    examples = wide.prepare()
    net, raw = wide.build_head(examples)
    assert raw["intermediate_size"] == net.midlayer.mlp.down_proj.weight.shape[1] == 2 * width
    assert net.midlayer.mlp.gate_proj.weight[width:].abs().sum() > 0  # new units are live, their output is zeroed
    ex = examples[0]
    feats, _, ids, _ = wide.target_batch([ex], net.d2t)
    with torch.no_grad():
        before, after = ttt_forward(old, ids, feats, 3), ttt_forward(net, ids, feats, 3)
    for a, b in zip(before.logits, after.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)  # the same head, only wider
    head = wide.train()  # trains and exports the wider head; the runtime loader reads its width
    loaded = load_eagle(head, wide.target.model_config, wide.target.model.model.embed_tokens.weight,
                        torch.float32, "cpu", 512)
    assert loaded.config.intermediate_size == 2 * width
    resumed = Trainer(train_cfg(model, prompts, tmp_path / "again", init_head=str(head)), progress=False)
    assert resumed.build_head(examples)[1]["intermediate_size"] == 2 * width  # fine-tuning keeps the width
    with pytest.raises(InvalidRequestError, match="narrower"):
        Trainer(train_cfg(model, prompts, tmp_path / "narrow", init_head=str(head), draft_intermediate=width),
                progress=False).build_head(examples)
    with pytest.raises(InvalidRequestError, match="draft_intermediate"):
        train_cfg(model, prompts, tmp_path, draft_intermediate=0)


def test_the_attached_target_embedding_is_not_a_draft_weight(setup):
    target, drafter, _, _ = setup  # the drafter was given the target's embedding Parameter
    assert "embed_weight" not in drafter.net.state_dict()
    assert all(p.data_ptr() != target.model.model.embed_tokens.weight.data_ptr() for p in drafter.net.parameters())
    assert drafter.net.embed_weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()  # shared, no copy


def test_head_misses_lines_positions_up_with_the_answers(tiny_with_tokenizer, tmp_path):
    from benchmarks.head_misses import analyze, format_report
    from common.sampling_params import SamplingParams
    from draft_service.eagle_init import write_random_head
    from tools.evaluate import draft_vocab_mask
    from tools.train.data import load_prompts
    from verify_service.config import EngineConfig
    from tools.inprocess import build_engine

    model, prompts = tiny_with_tokenizer
    head = write_random_head(tmp_path / "head", json.loads((model / "config.json").read_text()), 40000, seed=4)
    rep = analyze(str(model), str(head), str(prompts), max_tokens=12, limit=6, batch=4, device="cpu")
    # independently: the target's greedy answers, and how many of their tokens the draft vocabulary lacks
    engine = build_engine(EngineConfig(str(model), device="cpu", dtype="float32"))
    asked = [engine.target.encode(messages=[{"role": "user", "content": q}]) for q in load_prompts(prompts, 6)]
    answers = [r.token_ids for r in engine.generate(asked, SamplingParams(max_tokens=12))]
    tokens = torch.tensor([t for a in answers for t in a])
    assert rep["answers"] == 6 and rep["positions"] == tokens.numel()  # one position per answer token
    assert rep["outside_vocab"] == round(float((~draft_vocab_mask(str(head))[tokens]).float().mean()), 4) > 0
    assert sum(g["positions"] for g in rep["groups"]) == rep["positions"]
    for g in rep["groups"]:  # a draft token is always inside its vocabulary: no agreement outside it
        assert g["positions"] == 0 or g["agreement"] <= 1 - g["outside_vocab"] + 1e-9, g
    ranks = rep["miss_rank_2"] + rep["miss_rank_3_10"] + rep["miss_rank_over_10"]
    assert rep["misses_inside_vocab"] > 0 and abs(ranks - 1) < 1e-3
    assert "| target's top-1 probability |" in format_report(rep)


def test_head_misses_groups_positions_by_the_targets_confidence():
    from benchmarks.head_misses import summarize

    p_top = torch.tensor([0.1, 0.2, 0.4, 0.6, 0.95, 1.0])
    hit = torch.tensor([False, True, False, True, True, False])
    inside = torch.tensor([False, True, True, True, True, True])
    rank = torch.tensor([1, 1, 2, 1, 1, 12])  # misses inside the vocabulary: ranks 2 and 12
    rep = summarize(p_top, hit, inside, rank, "h", "p.jsonl", 2)
    assert [g["positions"] for g in rep["groups"]] == [2, 1, 1, 0, 2]  # 1.0 falls in the last group
    assert rep["groups"][0] == {"target_top1": "0.0-0.3", "positions": 2, "share": 0.3333, "agreement": 0.5,
                                "outside_vocab": 0.5}
    assert rep["groups"][3]["agreement"] is None and rep["groups"][4]["agreement"] == 0.5
    assert rep["agreement"] == 0.5 and rep["outside_vocab"] == 0.1667 and rep["misses_inside_vocab"] == 2
    assert (rep["miss_rank_2"], rep["miss_rank_3_10"], rep["miss_rank_over_10"]) == (0.5, 0.0, 0.5)
