"""Sampling maths (hand-computed), the exponential race, and seeded reproducibility."""

import math

import pytest
import torch

from common.errors import InvalidRequestError
from common.sampling_params import MIN_TEMPERATURE, SamplingParams
from kernels.sampling import logits_to_probs_ref, mix_seed, sample_ref
from tiny_models import target_for, make_model_dir
from verify_service.engine import Engine
from verify_service.model_runner import SeqChunk


def probs_for(logits, temperature=1.0, top_p=1.0, top_k=0):
    t = lambda x, d: torch.tensor([x], dtype=d)
    return logits_to_probs_ref(torch.tensor([logits]), t(temperature, torch.float32),
                               t(top_p, torch.float32), t(top_k, torch.int64))[0]


def test_temperature_zero_is_one_hot_argmax():
    assert probs_for([0.1, 2.0, 1.9], temperature=0.0).tolist() == [0.0, 1.0, 0.0]


def test_temperature_scales_logits():
    logits = [0.0, math.log(2.0), math.log(4.0)]
    expected = torch.tensor([1.0, 2.0 ** 0.5, 2.0]) / (1 + 2.0 ** 0.5 + 2.0)  # p ~ exp(l / 2)
    torch.testing.assert_close(probs_for(logits, temperature=2.0), expected)


def test_top_k_keeps_the_k_largest():
    logits = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
    torch.testing.assert_close(probs_for(logits, top_k=2), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
    # sorted: 0.4, 0.3 (mass 0.7 >= 0.6 -> stop): keep {0.4, 0.3}
    torch.testing.assert_close(probs_for(logits, top_p=0.6), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))
    # p just above 0.7 needs the third token too
    torch.testing.assert_close(probs_for(logits, top_p=0.75), torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9]))


def test_exponential_race_samples_the_distribution():
    p = torch.tensor([0.05, 0.15, 0.3, 0.5])
    n = 40000
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 4).exponential_(generator=gen)
    counts = torch.bincount(sample_ref(p.expand(n, 4), noise), minlength=4).double()
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_mix_seed_spreads_neighbouring_inputs():
    values = {mix_seed(s, o) for s in range(20) for o in range(20)}
    assert len(values) == 400 and all(0 <= v < 2**63 for v in values)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("s") / "m", "qwen2", std=0.5)


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = Engine(target_for(model_dir)).generate([[3, 4, 5]], sp)[0].token_ids
    again = Engine(target_for(model_dir)).generate([[3, 4, 5]], sp)[0].token_ids
    others = [SamplingParams(max_tokens=5, temperature=0.7, seed=9), SamplingParams(max_tokens=30)]
    batch = Engine(target_for(model_dir)).generate([[3, 4, 5], [9, 9], [1, 2, 3, 4]], [sp, *others])
    assert alone == again == batch[0].token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True)
    assert Engine(target_for(model_dir)).generate([[3, 4, 5]], other_seed)[0].token_ids != alone


def test_sampled_first_token_follows_the_model_distribution(model_dir):
    """Empirical first-token frequencies over many seeds match softmax(logits / T)."""
    target = target_for(model_dir, max_num_seqs=64)
    gen = Engine(target)
    prompt = [7, 8, 9]
    greedy = gen.generate([prompt], SamplingParams(max_tokens=1))
    target.blocks.ensure_capacity(999, 3)
    row = target.runner.step([SeqChunk(prompt, 0, target.blocks.block_table(999), (2,))]).logits[0].cpu()
    target.blocks.free(999)
    p = torch.softmax(row / 2.0, dim=-1).double()
    n = 1500
    params = [SamplingParams(max_tokens=1, temperature=2.0, seed=s) for s in range(n)]
    firsts = [r.token_ids[0] for r in gen.generate([prompt] * n, params)]
    counts = torch.bincount(torch.tensor(firsts), minlength=p.numel()).double()
    tv = 0.5 * (counts / n - p).abs().sum().item()
    assert greedy[0].token_ids[0] == int(row.argmax())
    # Sampling noise alone gives about 0.06 here; sampling at T=1 instead of T=2 gives 0.31.
    assert tv < 0.1, tv


def test_tiny_temperatures_are_refused_and_the_smallest_allowed_gives_finite_probabilities():
    with pytest.raises(InvalidRequestError, match="temperature: must be 0 .greedy. or at least"):
        SamplingParams(temperature=1e-37)
    logits = torch.tensor([[100.0, -100.0, 99.9999, 0.0]])
    probs = logits_to_probs_ref(logits, torch.tensor([MIN_TEMPERATURE]), torch.tensor([1.0]), torch.tensor([0]))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(1))


def test_an_unfiltered_row_does_not_depend_on_its_batch():
    """A row without top-k / top-p is a plain softmax, bit for bit the same next to a filtered row,
    alone, and with the sort skipped (``any_filtered=False``, the sampler's call when no row filters)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 500, generator=gen) * 3
    both = logits_to_probs_ref(logits, torch.tensor([0.7, 0.7]), torch.tensor([1.0, 0.9]), torch.tensor([0, 20]))
    alone = logits_to_probs_ref(logits[:1], torch.tensor([0.7]), torch.tensor([1.0]), torch.tensor([0]))
    unsorted = logits_to_probs_ref(logits[:1], torch.tensor([0.7]), torch.tensor([1.0]), torch.tensor([0]),
                                   any_filtered=False)
    assert torch.equal(both[0], alone[0]) and torch.equal(alone, unsorted)
    torch.testing.assert_close(alone[0], (logits[0] / 0.7).softmax(-1))
    assert (both[1] > 0).sum() <= 20 and abs(float(both[1].sum()) - 1) < 1e-5  # the filtered row still filters


def _splitmix53(key: int, i: int) -> float:
    """The counter-based generator, entry i of a row, in plain Python integers."""
    m = (1 << 64) - 1
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return ((z >> 11) + 0.5) * 2.0 ** -53


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_noise_is_counter_based_and_batch_independent(device):
    """Exp(1) and uniform noise: entry [r, i] from SplitMix64 of (mix_seed(seed, offset), i) exactly as
    plain integers give it (int64 tensors wrap the same way on every device), each row the same
    whatever rows share its call, and distributed as it should be."""
    import math
    from kernels.sampling import exponential_noise_ref, uniform_noise_ref
    seeds, offsets = [3, 11, 3], [0, 5, 1]
    e = exponential_noise_ref(seeds, offsets, 4096, device).cpu()
    for r, (s, o) in enumerate(zip(seeds, offsets)):
        for i in (0, 1, 4095):
            assert abs(float(e[r, i]) + math.log(_splitmix53(mix_seed(s, o), i))) < 1e-6 * max(1.0, float(e[r, i]))
    assert torch.equal(exponential_noise_ref([11], [5], 4096, device).cpu()[0], e[1])
    assert abs(float(e.mean()) - 1) < 0.05 and float(e.min()) > 0
    u = uniform_noise_ref(seeds, offsets, 4096, device).cpu()
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u, torch.exp(-e))  # a stream of its own
