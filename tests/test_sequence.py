"""A sequence's token bookkeeping."""

import random

from common.sampling_params import SamplingParams
from verify_service.sequence import Sequence


def test_token_slice_is_the_slice_of_prompt_and_output():
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 12))]
        seq = Sequence(0, prompt, SamplingParams(), seed=0, max_new_tokens=16,
                       output_ids=[rng.randrange(100) for _ in range(rng.randrange(0, 12))])
        whole = prompt + seq.output_ids
        start = rng.randrange(0, len(whole) + 1)
        end = rng.randrange(start, len(whole) + 2)
        assert seq.token_slice(start, end) == whole[start:end], (prompt, seq.output_ids, start, end)
