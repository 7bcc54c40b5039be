"""Chunked prefill shares each step with the decoding sequences: while a long prompt is
prefilled, every step still gives each decoding sequence its next token."""

from common.sampling_params import SamplingParams
from tiny_models import make_model_dir, target_for
from verify_service.engine import Engine


def test_a_long_prompt_never_stalls_the_decoding_streams(tmp_path):
    engine = Engine(target_for(make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3), max_batch_tokens=32,
                               max_model_len=256, kv_cache_gib=None, num_kv_blocks=64))
    short = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True)) for _ in range(2)]
    for _ in range(3):
        engine.step()
    long_id = engine.add_request([3 + i % 90 for i in range(200)], SamplingParams(max_tokens=4, ignore_eos=True))  # 200 tokens
    steps_prefilling = 0
    while engine.sequences[long_id].prefilling or not engine.sequences[long_id].output_ids:
        events = engine.step()
        steps_prefilling += 1
        got = {e.seq_id for e in events if e.token_ids}
        assert set(short) <= got, f"step {steps_prefilling}: a decoding stream got no token"
    assert steps_prefilling >= 200 // 32  # the prompt went in chunks of at most the budget
