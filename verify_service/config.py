"""Serving configuration of the target engine (frozen, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.devices import check_device, device_type
from common.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

# Names only: the flags that take these are parsed without importing torch (the client commands
# share the parser). KERNEL_CHOICES equals kernels.KERNEL_CHOICES (a test compares them).
DTYPES = ("float32", "float16", "bfloat16")
KERNEL_CHOICES = ("auto", "triton", "reference")
# How a sampled request verifies a tree: "seeded" accepts a node iff it is the target's own sample
# at its parent (the output is the text plain decoding gives for the same seed); "residual" is the
# SpecInfer/EAGLE residual rule (also exact in distribution, other text for the same seed).
SAMPLING_ACCEPTANCE = ("seeded", "residual")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``dtype``/``device`` "auto": bfloat16 on CUDA, float32 on the CPU.

    ``max_model_len`` None: the model's ``max_position_embeddings``. ``kv_cache_gib`` None:
    90% of the GPU memory left after the weights, or 2 GiB on the CPU; either way capped at
    what ``max_num_seqs`` full-length sequences need. ``num_kv_blocks`` sets the count exactly.
    """

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None  # exact block count; overrides kv_cache_gib
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    kernels: str = "auto"  # "triton", "reference", or "auto" (kernels.select_kernels decides)
    enforce_eager: bool = False  # no CUDA graphs (they need CUDA and the Triton kernels)
    graphs_on_cpu: bool = False  # on a CPU, the graphs' paths with each replay run eagerly (runtime/graphs.py: tests)
    sampling_acceptance: str = "seeded"  # one of SAMPLING_ACCEPTANCE
    # batch-invariant kernels (kernels.exact_set): bf16 speculative == target-only; None: the default,
    # on CUDA with the Triton kernels (kernels.exact_by_default), False: the fastest kernels
    exact: bool | None = None

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError("dtype", f"must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.kernels not in KERNEL_CHOICES:
            raise InvalidRequestError("kernels", f"must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.exact not in (None, True, False):
            raise InvalidRequestError("exact", f"must be true, false or unset, got {self.exact!r}")
        if self.exact:
            self._check_exact()
        if self.sampling_acceptance not in SAMPLING_ACCEPTANCE:
            raise InvalidRequestError("sampling_acceptance", f"must be one of {', '.join(SAMPLING_ACCEPTANCE)}, "
                                                             f"got {self.sampling_acceptance!r}")
        checks = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                  "max_batch_tokens": self.max_batch_tokens}
        for name, value in checks.items():
            if value <= 0:
                raise InvalidRequestError(name, f"must be > 0, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise InvalidRequestError("num_kv_blocks", f"must be > 0, got {self.num_kv_blocks}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise InvalidRequestError("kv_cache_gib", f"must be > 0, got {self.kv_cache_gib}")

    def _check_exact(self) -> None:
        """What kernels.select_kernels would refuse, refused before the model loads."""
        from kernels import exact_refusal  # torch-free until a config asks for the exact kernels

        refusal = exact_refusal(device_type(self.device), self.kernels)
        if refusal is not None:
            raise InvalidRequestError("exact", refusal)

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
