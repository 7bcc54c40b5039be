"""One forward step of the target over a batch of sequence chunks.

The scheduler decides *what* runs (``SeqChunk`` per sequence); ``layout_step`` turns it into
flat device tensors plus ``AttentionMetadata``; the runner runs the model and returns logits
only for the rows that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import UnsupportedModelError
from kernels import KernelSet
from runtime.kv_cache import PagedKVCache
from runtime.step_layout import SeqChunk, Staging, layout_step
from verify_service.model import CausalLM

__all__ = ["ModelRunner", "SeqChunk", "StepOutput"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    logits: torch.Tensor  # [sum(len(logits_rows)), vocab] float32, in chunk order
    hidden: torch.Tensor  # [T, hidden] final-normed hidden of every new token
    captured: torch.Tensor | None  # [T, k * hidden] EAGLE-3 features, when capture layers are set
    query_start_loc: list[int]  # chunk i owns rows query_start_loc[i]:query_start_loc[i+1]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, kernels: KernelSet,
                 capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.kv_cache = kv_cache
        self.kernels = kernels
        self.device = kv_cache.data.device
        self.staging = Staging(self.device)  # one host-to-device copy per step, reused buffers
        self.set_capture_layers(capture_layers)

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        """Layers whose input hidden states ``step`` returns, concatenated in the given order."""
        bad = [i for i in layers if not 0 <= i < self.model.config.num_layers]
        if bad:
            raise UnsupportedModelError(f"capture layers {bad} outside [0, {self.model.config.num_layers})")
        self.capture_layers = tuple(layers)

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk]) -> StepOutput:
        lay = layout_step(chunks, self.kv_cache.block_size, self.device, self.kernels, self.staging)
        out = self.model(lay.input_ids, lay.meta, self.kv_cache, self.kernels, self.capture_layers)
        logits = self.model.compute_logits(out.hidden[lay.logits_rows])
        return StepOutput(logits, out.hidden, out.captured, lay.query_start_loc.tolist())
