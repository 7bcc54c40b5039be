"""Property-based fuzzing through real services (hypothesis, derandomized: the same cases every run).

Public API (fuzz_public): hostile requests to every public method as raw bytes; every answer a
typed status, OK streams well formed, greedy ones equal to target-only decoding, and the same
greedy outputs after the fuzzing as before. Internal draft link (fuzz_link): a fake draft with
random handshakes and sessions; typed statuses and exact client outputs. Chat prompts:
special-token text in a message stays text. The long run: benchmarks/fuzz_public_api.py.
"""

import subprocess

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fuzz_link import (HANDSHAKE, Answer, FakeDraft, SessionPlan, corrupt_handshakes, corrupt_session_messages,
                       handshakes, session_plans, socket_plans)
from fuzz_public import TYPED, fuzz_public_api, start_stack
from fuzz_requests import CHAT_ROLES, texts
from hub.tokenizer import Tokenizer
from tiny_tokenizer import write_tokenizer

PUBLIC_CASES, SESSION_CASES, HANDSHAKE_CASES, SOCKET_CASES = 150, 60, 100, 25
fuzz = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
IM_START, IM_END = 257, 258


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """(verify and draft services, the target's directory)."""
    stack, target_dir = start_stack(tmp_path_factory.mktemp("fuzz"))
    yield stack, target_dir
    stack.close()


def test_public_api_answers_typed_statuses_and_exact_outputs(services):
    figures = fuzz_public_api(*services, PUBLIC_CASES, strict=True).figures()
    assert figures["cases"] == PUBLIC_CASES and figures["wrong_outputs_after"] == 0, figures
    assert figures["statuses"]["OK"] > figures["calls"] // 4, figures  # enough of them reached the engine


@pytest.fixture(scope="module")
def fake_draft(tmp_path_factory):
    """A fake draft on the internal socket of a verify service of its own (no real draft; a stalled
    draft is dropped after 2 s)."""
    stack, _ = start_stack(tmp_path_factory.mktemp("link"), draft=False,
                           verify_args=["--draft-timeout-s", "2", "--chain-min-seqs", "1"])
    fake = FakeDraft(stack)
    yield fake
    fake.close()
    stack.client.close()
    stack.verify.proc.terminate()
    try:
        stack.verify.proc.wait(5)
    except subprocess.TimeoutExpired:  # after a corrupt session message it may hang on SIGTERM (see below)
        pass
    stack.verify.kill()


@settings(fuzz, max_examples=SESSION_CASES)
@given(plan=session_plans())
def test_draft_link_sessions_keep_outputs_exact(fake_draft, plan):
    outcome = fake_draft.run_session(plan)
    assert set(outcome.statuses) <= TYPED, outcome
    assert outcome.generate_status == "OK" and outcome.output == fake_draft.expected[plan.prompt], outcome
    assert fake_draft.stack.verify.proc.poll() is None, fake_draft.stack.verify.log()[-3000:]


@settings(fuzz, max_examples=SOCKET_CASES)
@given(plan=socket_plans())
def test_step_socket_sessions_keep_outputs_exact(fake_draft, plan):
    """Steps and chained steps answered with garbage, cut, oversized, flooding, wrong-step frames,
    any tree references or sizes, and random bytes as trees: typed statuses, exact output."""
    outcome = fake_draft.run_socket_session(*plan)
    assert set(outcome.statuses) <= TYPED, outcome
    assert outcome.generate_status == "OK" and outcome.output == fake_draft.expected[plan[0]], outcome
    assert fake_draft.stack.verify.proc.poll() is None, fake_draft.stack.verify.log()[-3000:]


def test_a_socket_session_that_takes_chained_steps_runs_them(fake_draft):
    """The fuzzed sessions above reach chained steps: sound answers, then random trees in the buffer."""
    before = fake_draft.stack.client.metrics()
    outcome = fake_draft.run_socket_session(1, (("right", 1), ("right", 2), ("random_trees", 3), ("random_trees", 4)),
                                            True)
    assert outcome.output == fake_draft.expected[1], outcome
    after = fake_draft.stack.client.metrics()
    assert after["chained_steps"] > before["chained_steps"] and after["draft_errors"] > before["draft_errors"]


@settings(fuzz, max_examples=HANDSHAKE_CASES)
@given(raw=handshakes())
def test_draft_link_handshakes_answer_typed_statuses(fake_draft, raw):
    assert fake_draft.call(HANDSHAKE, [raw]) in TYPED


def test_control_plane_figures_stay_sane_whatever_the_draft_reports(fake_draft):
    plan = SessionPlan(0, "open", (Answer("answer", "right", seed=1, nodes=0),))  # claims up to 2^63 ns of compute
    assert fake_draft.run_session(plan).output == fake_draft.expected[0]
    metrics = fake_draft.stack.client.metrics()
    assert 0 <= metrics["control_plane_p50_us"] <= metrics["control_plane_p99_us"] < 1e12, metrics
    assert 0 <= metrics["draft_compute_p50_us"] <= metrics["draft_compute_p99_us"] < 1e8, metrics  # < its round trip


@settings(fuzz, max_examples=20, phases=(Phase.generate,))
@given(raw=corrupt_handshakes())
def test_corrupt_handshakes_answer_typed_statuses(fake_draft, raw):
    assert fake_draft.call(HANDSHAKE, [raw]) in TYPED


@settings(fuzz, max_examples=10, phases=(Phase.generate,))
@given(requests=corrupt_session_messages())
def test_corrupt_session_messages_answer_typed_statuses(fake_draft, requests):
    assert set(fake_draft.open_after_handshake(requests)) <= TYPED


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(root)
    return Tokenizer(root)


@settings(fuzz, max_examples=200)
@given(messages=st.lists(st.builds(dict, role=st.sampled_from(CHAT_ROLES), content=texts()), min_size=1, max_size=3))
def test_special_token_text_in_chat_content_stays_text(tokenizer, messages):
    """Only the template's own markers are special tokens: content bytes stay bytes (ids 0..255 of
    the byte-level tokenizer), whatever special-token strings they spell."""
    want = []
    for m in messages:  # the template: <|im_start|>{role}\n{content | trim}<|im_end|>\n ... <|im_start|>assistant\n
        want += [IM_START, *f"{m['role']}\n".encode(), *m["content"].strip().encode(), IM_END, *b"\n"]
    assert tokenizer.encode_chat(messages) == [*want, IM_START, *b"assistant\n"]
