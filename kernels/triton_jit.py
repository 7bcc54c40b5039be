"""``jit_unspecialized``: ``triton.jit`` that compiles one variant whatever the integer sizes and the
arrays' alignment.

Triton specialises an integer argument on its value being 1 and on its divisibility by 16, and a
pointer on its 16-byte alignment: a kernel whose sizes follow the batch (1 sequence, 16, any other)
or whose arrays are slices at step-dependent offsets would otherwise compile new variants in the
middle of serving, each a stall of a second or so.
"""

from __future__ import annotations

import triton


def jit_unspecialized(*names: str):
    """``triton.jit`` with none of ``names`` (integer and pointer arguments) specialised; alignment
    too where this Triton offers the option."""
    try:
        return triton.jit(do_not_specialize=list(names), do_not_specialize_on_alignment=list(names))
    except TypeError:  # an older Triton: integer arguments only
        return triton.jit(do_not_specialize=list(names))
