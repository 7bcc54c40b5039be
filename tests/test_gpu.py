"""GPU-only checks (skipped without CUDA): defaults pick the GPU and bf16; bf16 on the GPU
tracks the float32 CPU run; a paged tree-masked attention call agrees across devices."""

import pytest
import torch

from kernels.attention import paged_attention_ref
from kernels.metadata import AttentionMetadata
from tiny_models import target_for, make_model_dir, tolerance
from verify_service.model_runner import SeqChunk

pytestmark = pytest.mark.gpu


def logits_of(target, ids):
    target.blocks.ensure_capacity(0, len(ids))
    return target.runner.step([SeqChunk(ids, 0, target.blocks.block_table(0), tuple(range(len(ids))))]).logits


def test_auto_settings_choose_cuda_and_bfloat16(tmp_path):
    target = target_for(make_model_dir(tmp_path / "m", "qwen3"), device="auto", dtype="auto")
    assert target.device.type == "cuda" and target.dtype == torch.bfloat16
    assert target.kv_cache.data.is_cuda and target.kv_cache.data.dtype == torch.bfloat16


def test_bf16_cuda_logits_track_fp32_cpu(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "llama3", std=0.05)
    ids = list(range(3, 50))
    cpu = logits_of(target_for(model_dir, device="cpu", dtype="float32"), ids)
    gpu = logits_of(target_for(model_dir, device="cuda", dtype="bfloat16"), ids)
    assert gpu.dtype == torch.bfloat16  # (logits come in the model's dtype)
    torch.testing.assert_close(gpu.float().cpu(), cpu, **tolerance("bfloat16"))


def test_tree_masked_paged_attention_agrees_across_devices():
    gen = torch.Generator().manual_seed(0)
    blocks, bs, kvh, h, d = 6, 4, 2, 4, 16
    k_cache, v_cache = (torch.randn(blocks, bs, kvh, d, generator=gen) for _ in range(2))
    q = torch.randn(5, h, d, generator=gen)
    # one sequence: 9 cached tokens, then a 5-node tree (root, two children, a grandchild each)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    meta = lambda dev: AttentionMetadata(
        query_start_loc=torch.tensor([0, 5], device=dev), seq_lens=torch.tensor([14], device=dev),
        block_tables=torch.tensor([[5, 0, 3, 1]], device=dev), slot_mapping=torch.arange(5, device=dev),
        positions=torch.tensor([9, 10, 10, 11, 11], device=dev), token_seq=torch.zeros(5, dtype=torch.long, device=dev),
        token_q_idx=torch.arange(5, device=dev), max_query_len=5, max_seq_len=14, custom_mask=tree.to(dev),
        mask_start=torch.tensor([9], device=dev))
    cpu = paged_attention_ref(q, k_cache, v_cache, meta("cpu"), d ** -0.5)
    gpu = paged_attention_ref(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta("cuda"), d ** -0.5)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)
