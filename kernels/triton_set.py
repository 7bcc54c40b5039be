"""The Triton kernel set: each entry with a Triton kernel replaces its reference (imports triton)."""

from __future__ import annotations

import dataclasses

from kernels import REFERENCE
from kernels.attention_triton import paged_attention_triton, prepare_attention_triton, write_kv_triton

TRITON = dataclasses.replace(
    REFERENCE,
    prepare_attention=prepare_attention_triton,
    write_kv=write_kv_triton,
    paged_attention=paged_attention_triton,
    name="triton",
)
