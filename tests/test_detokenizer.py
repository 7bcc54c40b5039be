"""Incremental detokenization: streamed text equals the full decode, stop strings cut where the
full text would be cut, and the work per token does not grow with the output's length."""

import time

import pytest

from hub.default_model import ensure_default_model
from hub.tokenizer import Tokenizer
from verify_service.detokenizer import StopStringDetokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_default_model(progress=False))


def stream(tok, ids, stop=(), chunk=3):
    d = StopStringDetokenizer(tok, [1, 2, 3], stop)
    out = "".join(d.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk) if not d.stopped)
    return out + d.finish(), d.stopped


def test_streamed_text_equals_the_full_decode(tok):
    ids = tok.encode("Héllo wörld! 日本語のテキスト, emoji 🙂🙂 and spaces   here. " * 40)
    text, stopped = stream(tok, ids)
    assert text == tok.decode(ids) and not stopped


@pytest.mark.parametrize("stop", [("wörld",), ("テキスト", "zzz"), ("   here. Hé",)])
def test_stop_strings_cut_where_the_full_text_is_cut(tok, stop):
    ids = tok.encode("Héllo wörld! 日本語のテキスト, emoji 🙂🙂 and spaces   here. " * 3)
    full = tok.decode(ids)
    text, stopped = stream(tok, ids, stop, chunk=1)
    assert stopped and text == full[:min(full.find(s) for s in stop if s in full)]


def test_the_state_does_not_grow_with_the_output(tok):
    """What a step works on (the window of ids the tokenizer decodes, the text searched for stop
    strings) stays a few tokens long however long the output gets: the work per token is constant
    (a window growing with the output would make the 20,000th token ~20x dearer than the 2,000th)."""
    stop = ("never appears in this text",)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 2000)  # about 20,000 tokens
    d = StopStringDetokenizer(tok, [1], stop)
    seconds, pending = [], []
    for at in range(0, len(ids) - 999, 1000):
        start = time.perf_counter()
        d.add_tokens(ids[at:at + 1000])
        seconds.append(time.perf_counter() - start)
        pending.append(len(d._pending))
    early, late = sorted(seconds[1:4])[1], sorted(seconds[-3:])[1]  # medians of three thousand-token runs
    assert late < 4 * early, (early, late)
    assert max(pending) < len(stop[0]), pending
