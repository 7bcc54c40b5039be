"""Training loop for EAGLE-3 heads: target features per batch, unrolled draft, AdamW.

    out_dir/
      examples.jsonl        self-distilled answers (resumable)
      state.pt              head weights + optimizer + step (resume point, weights_only-loadable)
      head/                 the exported head: config.json + sharded fp16 safetensors + index
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from common.config import ModelConfig, read_config_json
from common.errors import InvalidRequestError, UnsupportedModelError
from draft_service.eagle_config import DraftConfig
from draft_service.eagle_init import draft_raw_config
from draft_service.eagle_loader import load_eagle
from draft_service.eagle_net import EagleNet
from runtime.step_layout import SeqChunk
from tools.train.data import Example, generate_examples, iter_batches, load_prompts, read_examples
from tools.train.distributed import ProcessGroup
from tools.train.ttt import step_token_counts, ttt_forward, ttt_loss
from tools.train.vocab import select_draft_vocab, token_counts
from verify_service.config import EngineConfig
from verify_service.engine import Engine
from verify_service.target import Target

log = logging.getLogger(__name__)
SHARD_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class TrainConfig:
    target_dir: str
    prompts: str | tuple[str, ...]  # one JSONL prompt file or several, used in order
    out_dir: str
    draft_vocab: int = 8192
    steps: int = 1000
    batch: int = 8  # sequences per optimizer step, over all processes together
    lr: float = 3e-4
    ttt_steps: int = 4
    max_new_tokens: int = 256
    num_prompts: int | None = None
    eval_every: int = 100
    eval_examples: int = 16
    seed: int = 0
    device: str = "auto"
    gen_batch: int = 64  # prompts answered together while distilling
    time_limit_s: float | None = None  # stop (state saved) after this long; run again to resume
    dtype: str = "auto"  # the target's dtype while distilling and for features: bfloat16 on CUDA
    kv_cache_gib: float | None = None  # the target's KV cache: 16 GiB on CUDA (room left to train)
    max_prompt_tokens: int = 512  # longer training prompts are skipped (bounds the unroll's T x T scores)
    init_head: str | None = None  # start from this head's weights and vocabulary (fine-tuning)
    new_vocab: bool = False  # with init_head: choose the vocabulary from this run's answers, carry rows over
    draft_intermediate: int | None = None  # the head's MLP width; None: init_head's, else the target's
    warmup_steps: int | None = None  # linear warm-up, then cosine decay to lr/10; None: 5% of steps
    autocast: bool = True  # the head's forward in bfloat16 on CUDA (fp32 weights and optimizer)

    def __post_init__(self):
        object.__setattr__(self, "prompts", (self.prompts,) if isinstance(self.prompts, str) else tuple(self.prompts))
        for name in ("draft_vocab", "steps", "batch", "ttt_steps", "max_new_tokens", "eval_every", "gen_batch",
                     "max_prompt_tokens", "draft_intermediate"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise InvalidRequestError(name, f"must be > 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise InvalidRequestError("lr", f"must be > 0, got {self.lr}")
        if self.new_vocab and self.init_head is None:
            raise InvalidRequestError("new_vocab", "needs init_head (a fresh head always chooses its vocabulary)")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise InvalidRequestError("warmup_steps", f"must be in [0, steps), got {self.warmup_steps}")

    def lr_at(self, step: int) -> float:
        """Learning rate of ``step``: linear warm-up, then cosine decay to a tenth."""
        warmup = self.warmup_steps if self.warmup_steps is not None else self.steps // 20
        if step < warmup:
            return self.lr * (step + 1) / warmup
        done = (step - warmup) / max(1, self.steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


class Trainer:
    def __init__(self, cfg: TrainConfig, progress: bool = True):
        self.cfg = cfg
        self.deadline = None if cfg.time_limit_s is None else time.monotonic() + cfg.time_limit_s
        prompts = [q for path in cfg.prompts for q in load_prompts(path)]  # bad input fails before the model loads
        self.prompts = prompts[:cfg.num_prompts]
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        device = EngineConfig(cfg.target_dir, device=cfg.device).torch_device()
        self.group = ProcessGroup.from_env(cuda=device.type == "cuda")
        if self.group.world > 1 and cfg.batch % self.group.world:
            raise InvalidRequestError("batch", f"{cfg.batch} sequences do not split over {self.group.world} processes")
        if self.group.world > 1 and device.type == "cuda":
            device = torch.device("cuda", self.group.local_rank)  # one GPU per process
        self.progress = progress and self.group.main
        kv_gib = cfg.kv_cache_gib if cfg.kv_cache_gib is not None else (16.0 if device.type == "cuda" else None)
        self.target = Target.from_config(EngineConfig(
            cfg.target_dir, device=str(device), dtype=cfg.dtype, kv_cache_gib=kv_gib,
            max_model_len=min(cfg.max_prompt_tokens + cfg.max_new_tokens + 1,
                              ModelConfig.from_dir(cfg.target_dir).max_position_embeddings),
            max_num_seqs=max(cfg.batch, cfg.gen_batch), max_batch_tokens=max(2048, 2 * cfg.gen_batch),
            exact=False))  # the fastest kernels: the hidden states only teach the head
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # the head trains in float32 on tensor cores
        self.target_raw = read_config_json(cfg.target_dir, "model", UnsupportedModelError)
        if cfg.draft_vocab > self.target.model_config.vocab_size:
            raise InvalidRequestError("draft_vocab", f"{cfg.draft_vocab} exceeds the target vocabulary "
                                                     f"({self.target.model_config.vocab_size})")

    def prepare(self) -> list[Example] | None:
        """The distilled examples, or None when the time limit stopped generation first."""
        if self.group.world > 1:  # distilling is one process's job (or shards' in parallel, concatenated)
            lines = read_examples(self.out / "examples.jsonl")
            if len(lines) < len(self.prompts):
                raise InvalidRequestError("prompts", f"{self.out}/examples.jsonl answers {len(lines)} of "
                                                     f"{len(self.prompts)} prompts: distil first (--generate-only, "
                                                     "one process), then train on several")
            return [e for e in lines[:len(self.prompts)] if len(e.ids) > e.answer_start]
        engine = Engine(self.target)
        lines = generate_examples(engine, self.prompts, self.out / "examples.jsonl", self.cfg.max_new_tokens,
                                  batch=self.cfg.gen_batch, seed=self.cfg.seed, progress=self.progress,
                                  max_prompt_tokens=self.target.max_model_len - self.cfg.max_new_tokens, deadline=self.deadline)
        if len(lines) < len(self.prompts):
            log.warning("answered %d of %d prompts before the time limit; run again to continue",
                        len(lines), len(self.prompts))
            return None
        return [e for e in lines if len(e.ids) > e.answer_start]

    def build_head(self, examples: list[Example]) -> tuple[EagleNet, dict]:
        cfg, embedding = self.cfg, self.target.model.model.embed_tokens.weight.detach()
        start = None if cfg.init_head is None else load_eagle(cfg.init_head, self.target.model_config, embedding,
                                                              torch.float32, self.target.device, self.target.max_model_len)
        width = cfg.draft_intermediate or (start.config.intermediate_size if start is not None
                                           else self.target_raw["intermediate_size"])
        if start is not None and width < start.config.intermediate_size:
            raise InvalidRequestError("draft_intermediate", f"{width} is narrower than {cfg.init_head}'s MLP "
                                                            f"({start.config.intermediate_size}); a head can only widen")
        counts = token_counts((e.ids[e.answer_start:] for e in examples), self.target.model_config.vocab_size)
        d2t, t2d = select_draft_vocab(counts, cfg.draft_vocab, self.target.model_config.eos_token_ids)
        raw = draft_raw_config(self.target_raw, cfg.draft_vocab, intermediate_size=width)
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.target.model_config.default_capture_layers())}
        torch.manual_seed(cfg.seed)
        net = EagleNet(DraftConfig.from_hf(raw)).to(self.target.device)
        net.d2t.copy_(d2t)
        net.t2d.copy_(t2d)
        net.attach_embedding(embedding)
        net.init_rope(self.target.max_model_len + cfg.ttt_steps)  # unrolled steps sit past the rows
        self.group.broadcast_(list(net.parameters()))  # the same start on every process
        if start is None:
            return net, raw
        state = widen_mlp(start.state_dict(), net)
        if start.config.intermediate_size != width:
            log.info("MLP widened from %d to %d (the new units start with no effect on the output)",
                     start.config.intermediate_size, width)
        if cfg.new_vocab:
            carried = carry_over_weights(net, state, self.target.model.lm_head_weight())
            log.info("new draft vocabulary: %d of %d rows carried over from %s", carried, cfg.draft_vocab, cfg.init_head)
            return net, raw
        if start.config.draft_vocab_size != cfg.draft_vocab:
            raise InvalidRequestError("init_head", f"{cfg.init_head} drafts {start.config.draft_vocab_size} "
                                                   f"tokens, not --draft-vocab {cfg.draft_vocab} "
                                                   "(--new-vocab chooses a new vocabulary)")
        net.load_state_dict(state)  # its weights and its vocabulary maps
        return net, raw

    @torch.no_grad()
    def target_batch(self, batch: list[Example], d2t: torch.Tensor):
        """Features [B, T, 3H] and the target's logits over the draft vocabulary [B, T, Vd]
        (both float32), ids and answer mask [B, T]; padded with 0."""
        eng = self.target
        eng.runner.set_capture_layers(eng.model_config.default_capture_layers())
        chunks = []
        for i, ex in enumerate(batch):  # negative ids: never an Engine's sequence
            eng.blocks.ensure_capacity(-1 - i, len(ex.ids))
            chunks.append(SeqChunk(ex.ids, 0, eng.blocks.block_table(-1 - i), logits_rows=()))
        out = eng.runner.step(chunks)
        for i in range(len(batch)):
            eng.blocks.free(-1 - i)
        T, B = max(len(ex.ids) for ex in batch), len(batch)
        feats = torch.zeros(B, T, out.captured.shape[-1], device=eng.device)
        hidden = torch.zeros(B, T, out.hidden.shape[-1], dtype=out.hidden.dtype, device=eng.device)
        ids = torch.zeros(B, T, dtype=torch.int64)  # built on the host, one copy each to the device
        mask = torch.zeros(B, T, dtype=torch.bool)
        for i, ex in enumerate(batch):
            a, b = out.query_start_loc[i], out.query_start_loc[i + 1]
            feats[i, :b - a], hidden[i, :b - a] = out.captured[a:b], out.hidden[a:b]
            ids[i, :b - a] = torch.tensor(ex.ids)
            mask[i, ex.answer_start - 1:b - a - 1] = True  # positions whose next token is an answer token
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        # The target's logits over the draft vocabulary only, and only where a loss reads them:
        # hidden @ lm_head[target ids of the draft vocabulary].T, never the full vocabulary.
        vocab_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        logits = torch.zeros(B, T, d2t.numel(), device=eng.device)
        logits[mask] = torch.nn.functional.linear(hidden[mask], eng.model.lm_head_weight()[vocab_ids]).float()
        return feats, logits, ids, mask.float()

    def train(self) -> Path | None:
        """Run (or resume) to ``steps``; returns the exported head, or None if the time limit
        stopped the run first (state saved: run the same command again)."""
        examples = self.prepare()
        if examples is None:
            return None
        held_out, train_set = examples[:self.cfg.eval_examples], examples[self.cfg.eval_examples:] or examples
        if self.group.main:
            log.info("%d training examples (%d answer tokens), %d held out, %d process(es)", len(train_set),
                     sum(len(e.ids) - e.answer_start for e in train_set), len(held_out), self.group.world)
        net, raw = self.build_head(examples)
        self.net = net
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0)
        start = self._resume(net, opt)
        bar = tqdm(range(start, self.cfg.steps), desc="train", disable=not self.progress, initial=start,
                   total=self.cfg.steps)
        batches = iter_batches(train_set, self.cfg.batch, self.cfg.seed, start)
        for step in bar:
            if self.group.any(self.deadline is not None and time.monotonic() > self.deadline, self.target.device):
                if self.group.main:
                    self._save_state(net, opt, step)
                    export_head(net, raw, self.out / "head")  # the latest weights, usable meanwhile
                    log.warning("time limit reached at step %d of %d; state saved and head/ exported, "
                                "run again to resume", step, self.cfg.steps)
                self.group.barrier()
                return None
            loss, stats = self.step(net, opt, params, step, next(batches))
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{s['acc']:.2f}" for s in stats),
                            lr=f"{self.cfg.lr_at(step):.1e}")
            if (step + 1) % self.cfg.eval_every == 0 or step + 1 == self.cfg.steps:
                if self.group.main:
                    self.last_eval = self.evaluate(net, held_out)
                    log.info("step %d eval: %s", step + 1, self.last_eval)
                    self._save_state(net, opt, step + 1)
                self.group.barrier()  # nobody reads state.pt before it is whole
        return export_head(net, raw, self.out / "head") if self.group.main else self.out / "head"

    def step(self, net: EagleNet, opt: torch.optim.Optimizer, params: list, step: int,
             batch: list[Example]) -> tuple[torch.Tensor, list[dict]]:
        """One optimizer step on a global batch (this process trains on its share). Mutates net and opt."""
        for group in opt.param_groups:
            group["lr"] = self.cfg.lr_at(step)
        loss, stats = self._loss(net, self.group.share(batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        self.group.sum_grads_(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss, stats

    def _loss(self, net: EagleNet, batch: list[Example]) -> tuple[torch.Tensor, list[dict]]:
        """This process's part of the loss of a global batch (normalised by the global token counts)."""
        feats, logits, ids, mask = self.target_batch(batch, net.d2t)
        counts = self.group.sum_(step_token_counts(mask, self.cfg.ttt_steps))
        return ttt_loss(self._unroll(net, ids, feats), logits, mask, denominators=counts)

    @torch.no_grad()
    def evaluate(self, net: EagleNet, examples: list[Example]) -> list[dict]:
        """Per unrolled step: loss and the draft-argmax == target-argmax rate on held-out answers
        (in batches of ``batch``, weighted by answer tokens)."""
        stats = []
        for i in range(0, len(examples), self.cfg.batch):
            feats, logits, ids, mask = self.target_batch(examples[i:i + self.cfg.batch], net.d2t)
            _, part = ttt_loss(self._unroll(net, ids, feats), logits, mask)
            stats.append((float(mask.sum()), part))
        total = sum(n for n, _ in stats)
        return [{key: sum(n * part[s][key] for n, part in stats if s < len(part)) / total for key in ("loss", "acc")}
                for s in range(len(stats[0][1]))]

    def _unroll(self, net: EagleNet, ids: torch.Tensor, feats: torch.Tensor):
        with torch.autocast("cuda", torch.bfloat16, enabled=self.cfg.autocast and self.target.device.type == "cuda"):
            return ttt_forward(net, ids, feats, self.cfg.ttt_steps)

    def _save_state(self, net: EagleNet, opt, step: int) -> None:
        state = {"step": torch.tensor(step), **{f"model.{k}": v for k, v in net.state_dict().items()}}
        tmp = self.out / "state.pt.tmp"
        torch.save({"tensors": state, "optimizer": opt.state_dict()}, tmp)
        tmp.replace(self.out / "state.pt")

    def _resume(self, net: EagleNet, opt) -> int:
        path = self.out / "state.pt"
        if not path.is_file():
            return 0
        saved = torch.load(path, map_location=self.target.device, weights_only=True)
        net.load_state_dict({k.removeprefix("model."): v for k, v in saved["tensors"].items() if k != "step"})
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["tensors"]["step"])
        log.info("resumed from step %d", step)
        return step


MLP_IN, MLP_OUT = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"), "midlayer.mlp.down_proj.weight"


@torch.no_grad()
def widen_mlp(state: dict[str, torch.Tensor], net: EagleNet) -> dict[str, torch.Tensor]:
    """``state`` with its MLP as wide as ``net``'s, computing the same function: the first rows
    of gate/up and columns of down_proj are ``state``'s; the extra gate/up rows keep ``net``'s
    random initialisation and the extra down_proj columns are zero, so the new units add
    nothing until training moves them. A state as wide as ``net`` comes back as it is."""
    width = net.midlayer.mlp.down_proj.weight.shape[1]
    old = state[MLP_OUT].shape[1]
    if old == width:
        return state
    own = net.state_dict()
    out = dict(state)
    for name in MLP_IN:
        out[name] = torch.cat((state[name], own[name][old:].to(state[name])))
    out[MLP_OUT] = torch.cat((state[MLP_OUT], torch.zeros_like(own[MLP_OUT][:, old:]).to(state[MLP_OUT])), dim=1)
    return out


@torch.no_grad()
def carry_over_weights(net: EagleNet, start: dict[str, torch.Tensor], target_lm_head: torch.Tensor) -> int:
    """Mutates ``net``: every weight of the state ``start`` except the vocabulary, which stays
    ``net``'s. An ``lm_head`` row follows its target id: ids in both vocabularies keep
    ``start``'s row; ids new to the vocabulary start from the target's own output row for that
    id, scaled to the mean norm of the carried rows (the draft's hidden is not the target's, so
    only the direction is borrowed). Returns how many rows were carried."""
    vocab_maps = ("lm_head.weight", "d2t", "t2d")
    net.load_state_dict({k: v for k, v in start.items() if k not in vocab_maps}, strict=False)
    new_ids = torch.arange(net.d2t.numel(), device=net.d2t.device) + net.d2t
    old_ids = torch.arange(start["d2t"].numel(), device=start["d2t"].device) + start["d2t"]
    row_of = torch.full((net.t2d.numel(),), -1, dtype=torch.int64, device=new_ids.device)
    row_of[old_ids] = torch.arange(old_ids.numel(), device=new_ids.device)
    src = row_of[new_ids]  # start's row for each new draft id, -1 where the id is new
    kept = src >= 0
    w = net.lm_head.weight
    w[kept] = start["lm_head.weight"][src[kept]]
    if kept.any() and not kept.all():
        fresh = target_lm_head[new_ids[~kept]].float()
        w[~kept] = fresh * (w[kept].norm(dim=1).mean() / fresh.norm(dim=1).mean().clamp(min=1e-12))
    return int(kept.sum())


def export_head(net: EagleNet, raw_config: dict, out_dir: Path, dtype=torch.float16,
                shard_bytes: int = SHARD_BYTES) -> Path:
    """Standard EAGLE-3 names, floating tensors in ``dtype``, safetensors shards of at most
    ``shard_bytes`` (a single larger tensor gets a shard of its own) with the standard
    ``model.safetensors.index.json``. The embedding is the target's and is not written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in net.state_dict().items()}
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps({**raw_config, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                    indent=2))
    return out_dir
