"""Kernel compilations after the warm-up are warned about and counted (each stalls its step)."""

import logging

import pytest
import torch

from kernels.compile_watch import CompileWatch


def test_a_compilation_is_warned_about_and_counted(caplog):
    watch = CompileWatch(logging.getLogger("test"), "the warm-up")
    with caplog.at_level(logging.WARNING):
        watch._compiled(fn=type("F", (), {"name": "_attention_kernel"})(), repr="BLOCK_M=64")
    assert watch.compilations == 1
    assert "_attention_kernel after the warm-up" in caplog.text and "BLOCK_M=64" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter compiles nothing)")
def test_the_hook_sees_a_first_launch_and_not_a_second():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)

    watch = CompileWatch(logging.getLogger("test"), "the warm-up")
    try:
        assert watch.start()
        x = torch.zeros(16, device="cuda")
        _add_one[(1,)](x, BLOCK=16)
        _add_one[(1,)](x, BLOCK=16)
        torch.cuda.synchronize()
        assert watch.compilations == 1 and x.tolist() == [2.0] * 16
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
