"""Target-only decoding launches each decode step before the last one's tokens reach the host, its
token ids taken from the samples on the device (``Engine._launch_decode``). What it commits, and
when, is what the engine gives without it: sequences finishing on a stop token, at max_tokens, or
cancelled while a step is launched ahead, requests arriving meanwhile, greedy and seeded sampling;
and no KV block outlives the requests. On CUDA the same tests run the decode graphs."""

import pytest

from common.sampling_params import SamplingParams
from tiny_models import make_model_dir, target_for
from verify_service.engine import Engine

PROMPTS = [list(range(10, 22)), list(range(40, 47)), list(range(60, 75)), [5, 6, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("ahead") / "m", "llama3", seed=7, std=0.3)


def engine(model_dir, ahead: bool) -> Engine:
    eng = Engine(target_for(model_dir, max_num_seqs=4))
    eng.decode_ahead = ahead
    return eng


def params(free_run: list[int]) -> list[SamplingParams]:
    """Finishing at different steps: a stop token met mid-run, max_tokens, sampling with a seed."""
    return [SamplingParams(max_tokens=20, stop_token_ids=(free_run[6],)), SamplingParams(max_tokens=5, ignore_eos=True),
            SamplingParams(max_tokens=17, temperature=0.8, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=12, ignore_eos=True)]


def test_decoding_ahead_commits_what_the_engine_commits_without_it(model_dir):
    free_run = engine(model_dir, False).generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    runs = []
    for ahead in (True, False):
        eng = engine(model_dir, ahead)
        results = eng.generate(PROMPTS, params(free_run.token_ids))
        runs.append(([(r.token_ids, r.finish_reason) for r in results], eng.decode_steps_ahead))
        assert eng.target.blocks.num_used_blocks == 0
    (got, launched), (want, none) = runs
    assert got == want and launched > 10 and none == 0
    assert got[0][1].value == "stop" and len(got[0][0]) < 20  # the stop token came mid-run


def step_log(eng: Engine) -> tuple[dict, int]:
    """Step by step: the second request is cancelled after 4 steps and another arrives after 6.
    Returns each request's tokens and finish reason, and the step the late one's first token came."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS[:3], (14, 30, 9))]
    out, steps, first = {}, 0, None
    while eng.has_work:
        for e in eng.step():
            tokens, _ = out.get(e.seq_id, ([], None))
            out[e.seq_id] = (tokens + e.token_ids, e.finish_reason)
            first = steps if e.seq_id == 3 and first is None else first
        steps += 1
        if steps == 4:
            eng.abort(ids[1])
        if steps == 6:
            eng.add_request(PROMPTS[3], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    return out, first


def test_cancelled_and_arriving_requests_between_steps_launched_ahead(model_dir):
    """A request cancelled while the step after it is already launched commits nothing more (its
    row is computed and dropped), and one arriving meanwhile starts one step later (with the step
    after the one already launched), with the same tokens."""
    ahead, plain = engine(model_dir, True), engine(model_dir, False)
    (got, first), (want, want_first) = step_log(ahead), step_log(plain)
    assert got == want and len(got[1][0]) == 4 and ahead.decode_steps_ahead > 5
    assert first == want_first + 1
    assert ahead.target.blocks.num_used_blocks == 0


def test_steps_go_on_being_launched_ahead_as_requests_finish(model_dir):
    """A request reaching its length limit is left out of the step launched ahead, and one that a
    stop token finished is skipped by it: after every decode step with requests left, the next step
    is already launched (when requests finished, it once waited for the host), and the tokens are
    the engine's without decoding ahead."""
    free_run = engine(model_dir, False).generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    ps = [SamplingParams(max_tokens=20, stop_token_ids=(free_run.token_ids[6],)),
          SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=14, ignore_eos=True)]
    runs = {}
    for ahead in (True, False):
        eng = engine(model_dir, ahead)
        first = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, ps)][0]
        out, waited, decode_steps = {}, [], 0
        while eng.has_work:
            decoding = not eng.scheduler.waiting and all(not s.prefilling for s in eng.scheduler.running)
            for e in eng.step():
                out[e.seq_id] = out.get(e.seq_id, []) + e.token_ids
            if decoding:
                decode_steps += 1
                if eng.has_work and eng._ahead_decode is None:
                    waited.append(decode_steps)
        runs[ahead] = out
        assert eng.target.blocks.num_used_blocks == 0
        if ahead:
            assert waited == [] and decode_steps >= 13, (waited, decode_steps)
    assert runs[True] == runs[False]
    stopped = runs[True][first]
    assert len(stopped) < 20 and stopped[-1] == free_run.token_ids[6]  # the stop token came mid-run
