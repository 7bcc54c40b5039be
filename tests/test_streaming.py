"""Streaming Generate responses: events handed from the engine thread to the stream (EventBox),
tokens gathered into fewer messages (--stream-interval-ms), every token still delivered in order."""

import threading
import time

import pytest

from client.eagle3_client import ClientError, Eagle3Client
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from tiny_models import TEST_DEVICE, TEST_DTYPE, make_model_dir, target_for
from verify_service import api_convert
from verify_service.config import EngineConfig
from verify_service.engine import Engine, TokenEvent
from verify_service.event_box import EventBox
from verify_service.server import create_server
from verify_service.server_config import VerifyServerConfig
from verify_service.servicers import MAX_STREAM_INTERVAL_S, stream_interval

PROMPT = list(range(10, 30))


def test_take_returns_every_event_posted_in_order_then_waits():
    box = EventBox()
    events = [TokenEvent(0, [i], str(i)) for i in range(3)]
    for ev in events:
        box.post(ev)
    assert box.take(1.0) == events
    start = time.monotonic()
    assert box.take(0.05) == []
    assert time.monotonic() - start >= 0.05


def test_a_post_wakes_a_handler_waiting_for_any_event():
    box = EventBox()
    threading.Timer(0.05, box.post, (TokenEvent(0, [1], ""),)).start()
    start = time.monotonic()
    assert box.take(5.0) == [TokenEvent(0, [1], "")]
    assert time.monotonic() - start < 2.0


def test_tokens_gather_until_the_interval_ends():
    box = EventBox()

    def post_five():
        for i in range(5):
            box.post(TokenEvent(0, [i], ""))
            time.sleep(0.01)
    posts = threading.Thread(target=post_five)
    start = time.monotonic()
    posts.start()
    got = box.take(5.0, gather_s=0.3)
    assert time.monotonic() - start >= 0.3
    assert [ev.token_ids for ev in got] == [[0], [1], [2], [3], [4]]
    posts.join()


def test_the_last_event_ends_the_gathering_at_once():
    box = EventBox()
    last = TokenEvent(0, [2], "", finish_reason="length")
    threading.Timer(0.05, lambda: (box.post(TokenEvent(0, [1], "")), box.post(last, last=True))).start()
    start = time.monotonic()
    assert box.take(5.0, gather_s=5.0) == [TokenEvent(0, [1], ""), last]
    assert time.monotonic() - start < 2.0


def test_a_delta_holds_its_events_tokens_and_text_in_order():
    msg = api_convert.delta([TokenEvent(0, [5, 6], "He"), TokenEvent(0, [], ""), TokenEvent(0, [7], "llo")])
    assert list(msg.delta.token_ids) == [5, 6, 7] and msg.delta.text == "Hello"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("stream") / "target", "llama3", seed=5, std=0.3)


@pytest.fixture(scope="module")
def want(model):
    return Engine(target_for(model)).generate([PROMPT], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids


def _server(model, tmp_path, interval_ms: float, messages_per_s: float = 0.0):
    engine = EngineConfig(str(model), device=TEST_DEVICE, dtype=TEST_DTYPE, num_kv_blocks=64)
    cfg = VerifyServerConfig(engine, None, listen=f"unix:{tmp_path}/api.sock", stream_interval_ms=interval_ms,
                             stream_messages_per_s=messages_per_s)
    return create_server(cfg), Eagle3Client(cfg.listen, timeout_s=60)


def test_a_stream_interval_grows_with_the_open_streams_past_the_message_budget():
    assert stream_interval(0.01, 1, 400.0) == 0.01
    assert stream_interval(0.01, 4, 400.0) == 0.01  # 4 streams every 10 ms: 400 messages a second
    assert stream_interval(0.01, 16, 400.0) == pytest.approx(0.04)
    assert stream_interval(0.01, 10_000, 400.0) == MAX_STREAM_INTERVAL_S
    assert stream_interval(0.5, 10_000, 400.0) == 0.5  # never shorter than asked
    assert stream_interval(0.01, 10_000, 0.0) == 0.01  # 0: no bound
    assert stream_interval(0.0, 1, 400.0) == pytest.approx(0.0025)


def test_concurrent_streams_keep_to_the_message_budget_and_lose_no_token(model, want, tmp_path):
    """4 messages a second in all: every stream waits the longest interval between messages (a
    message per step without the budget: 64), and still gets every token in order."""
    server, client = _server(model, tmp_path, 0.0, messages_per_s=4.0)
    got: dict[int, list] = {}

    def one(i):
        got[i] = list(client.generate(PROMPT, max_tokens=64, ignore_eos=True))
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        elapsed = time.monotonic() - start
        for events in got.values():
            deltas = events[:-1]
            assert [t for ev in deltas for t in ev.token_ids] == want and events[-1].done
            assert len(deltas) <= 2 + elapsed / MAX_STREAM_INTERVAL_S
        assert len(got) == 4
    finally:
        client.close()
        server.stop(0)


def test_the_budget_counts_the_streams_sending_tokens_not_those_waiting_for_a_slot():
    from types import SimpleNamespace

    from verify_service.servicers import GenerationServicer
    loop = SimpleNamespace(engine=SimpleNamespace(target=None), published=None)
    servicer = GenerationServicer(loop, None, None, 16, "m", stream_interval_s=0.01, stream_messages_per_s=400.0)
    servicer.open_streams = 200
    assert servicer.streaming() == 200  # (nothing published yet)
    loop.published = SimpleNamespace(running_requests=16)  # 16 decode, 184 wait for a batch slot
    assert servicer.streaming() == 16
    loop.published.running_requests, servicer.open_streams = 16, 3  # (requests from elsewhere count not)
    assert servicer.streaming() == 3


@pytest.mark.parametrize("field, value", [("stream_interval_ms", -1.0), ("stream_interval_ms", 1001.0),
                                          ("stream_messages_per_s", -1.0), ("stream_messages_per_s", 2e6)])
def test_a_stream_setting_out_of_range_is_refused(model, field, value):
    engine = EngineConfig(str(model), device=TEST_DEVICE, dtype=TEST_DTYPE)
    with pytest.raises(InvalidRequestError) as info:
        VerifyServerConfig(engine, None, **{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("interval_ms", [0.0, 200.0])
def test_every_token_arrives_in_order_whatever_the_interval(model, want, tmp_path, interval_ms):
    server, client = _server(model, tmp_path, interval_ms)
    try:
        start = time.monotonic()
        events = list(client.generate(PROMPT, max_tokens=64, ignore_eos=True))
        elapsed = time.monotonic() - start
        deltas, done = events[:-1], events[-1]
        assert [t for ev in deltas for t in ev.token_ids] == want
        assert done.done and done.finish_reason == "length" and done.usage.completion_tokens == 64
        if interval_ms:  # the first token at once, the rest gathered: a message per interval at most
            assert len(deltas[0].token_ids) == 1 and len(deltas) <= 2 + elapsed / (interval_ms / 1e3)
    finally:
        client.close()
        server.stop(0)


def test_cancelling_while_tokens_gather_frees_the_request(model, tmp_path):
    server, client = _server(model, tmp_path, 1000.0)
    try:
        stream = client.generate(PROMPT, max_tokens=200, ignore_eos=True)
        assert next(stream).token_ids
        stream.close()
        deadline = time.monotonic() + 10
        while client.metrics()["cancelled_requests"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        m = client.metrics()
        assert m["cancelled_requests"] == 1 and m["kv_blocks_used"] == 0 and m["running_requests"] == 0
    finally:
        client.close()
        server.stop(0)


def test_tokens_before_an_engine_failure_arrive_then_internal(model, want, tmp_path, monkeypatch):
    server, client = _server(model, tmp_path, 200.0)
    steps, step = [0], server.loop.engine.step

    def failing_step():
        steps[0] += 1
        if steps[0] > 10:
            raise RuntimeError("boom")
        return step()
    monkeypatch.setattr(server.loop.engine, "step", failing_step)
    try:
        tokens = []
        with pytest.raises(ClientError) as err:
            for ev in client.generate(PROMPT, max_tokens=64, ignore_eos=True):
                tokens += ev.token_ids
        assert err.value.code == "INTERNAL" and "boom" in err.value.message
        assert tokens == want[:10]
    finally:
        client.close()
        server.stop(0)
