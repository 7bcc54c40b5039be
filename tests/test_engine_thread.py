"""The engine thread's published counters: what GetMetrics, /metrics and the streams' message
budget read without waiting for a step. Published after commands, after a step that finishes a
request or leaves the engine idle, and otherwise once ``PUBLISH_EVERY_S`` has passed."""

import threading
import time
from types import SimpleNamespace

from verify_service import engine_thread
from verify_service.engine import TokenEvent
from verify_service.engine_thread import EngineThread
from verify_service.event_box import EventBox


class StepsEngine:
    """Steps of ``step_s`` seconds; request ``seq_id`` runs from step ``starts[seq_id]`` (default 1), gets
    a token a step from then and finishes at step ``ends[seq_id]``."""

    def __init__(self, ends: dict[int, int], step_s: float = 0.0, starts: dict[int, int] | None = None):
        self.ends, self.step_s, self.steps, self.starts = dict(ends), step_s, 0, starts or {}
        self.last_step_verified_trees = False
        self.scheduler = SimpleNamespace(running=[])

    def abort(self, seq_id: int) -> None:
        self.ends.pop(seq_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.ends)

    def step(self) -> list[TokenEvent]:
        time.sleep(self.step_s)
        self.steps += 1
        events = []
        for seq_id, end in list(self.ends.items()):
            if self.steps < self.starts.get(seq_id, 1):
                continue
            done = self.steps >= end
            events.append(TokenEvent(seq_id, [self.steps], "", "length" if done else None))
            if done:
                del self.ends[seq_id]
        self.scheduler.running = [i for i in self.ends if self.steps + 1 >= self.starts.get(i, 1)]
        return events


def run(engine, boxes=()) -> tuple[EngineThread, list]:
    """The thread over ``engine`` until it idles; returns it and the (steps, completed) of each publish."""
    loop = EngineThread(engine)
    seen = []
    loop.publish_with(lambda e: seen.append((e.steps, loop.completed)) or len(seen))
    for seq_id in boxes:
        loop._boxes[seq_id] = EventBox()
    requests = len(engine.ends)
    loop.start()
    deadline = time.monotonic() + 30
    while not (seen and seen[-1][1] == requests) and time.monotonic() < deadline:  # the last finish published
        time.sleep(0.01)
    published = list(seen)
    loop.stop()  # (its command publishes once more)
    return loop, published


def test_back_to_back_steps_publish_once_the_interval_passed(monkeypatch):
    monkeypatch.setattr(engine_thread, "PUBLISH_EVERY_S", 0.05)
    engine = StepsEngine({1: 60}, step_s=0.005)  # 0.3 s of steps: about 6 publishes, not 60
    loop, seen = run(engine, boxes=[1])
    assert engine.steps == 60
    assert 3 <= len(seen) <= 20, seen
    assert seen[-1] == (60, 1)  # the step that finished the request (and left the engine idle) published
    assert loop.published == len(seen) + 1  # (and the stop's command)


def test_a_step_that_finishes_a_request_publishes_at_once(monkeypatch):
    monkeypatch.setattr(engine_thread, "PUBLISH_EVERY_S", 3600.0)  # never by time
    engine = StepsEngine({1: 5, 2: 9, 3: 40})
    loop, seen = run(engine, boxes=[1, 2, 3])
    assert seen == [(1, 0), (5, 1), (9, 2), (40, 3)]  # (the first: the first step, nothing published before)


def test_a_step_that_changes_the_running_requests_publishes_at_once(monkeypatch):
    """The streams' message budget divides by the running requests: their number is never stale."""
    monkeypatch.setattr(engine_thread, "PUBLISH_EVERY_S", 3600.0)
    engine = StepsEngine({1: 30, 2: 30}, starts={2: 8})  # request 2 runs from step 8 (scheduled after step 7)
    loop, seen = run(engine, boxes=[1, 2])
    assert seen == [(1, 0), (7, 0), (30, 2)]


def test_the_publish_after_a_failed_step_shows_the_engine_idle():
    class Failing(StepsEngine):
        def step(self):
            raise RuntimeError("a bug")  # (the thread then aborts every request: the engine idles)
    loop = EngineThread(Failing({1: 3}))
    published = threading.Event()
    loop.publish_with(lambda e: published.set() or e.has_work)
    loop._boxes[1] = EventBox()
    loop.start()
    try:
        assert published.wait(10) and loop.published is False
    finally:
        loop.stop()
