"""The engine thread: one thread owns the Engine (the step loop) and steps it while there is work.

RPC handler threads never touch the Engine: they post commands (submit, cancel, read)
to a queue that the engine thread drains before every step, and wait on a future where
they need an answer. Commands are served between steps in arrival order, so no handler
starves behind a busy engine (a plain lock is not fair: the engine thread would re-take it
step after step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from common.errors import CapacityError
from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from verify_service.engine import Engine, TokenEvent
from verify_service.event_box import EventBox

log = logging.getLogger(__name__)

# While steps run back to back, the counters are published once this long has passed since the last
# time (after the step that passes it): the snapshot (about 16 us at 16 requests on a 2-core host,
# the sum of every request's speculation counters included) is pure overhead on a host-bound step of
# 2 ms. After commands, and after a step that changes the running requests (one starts or finishes:
# the streams' message budget reads their number) or leaves the engine without work, at once.
PUBLISH_EVERY_S = 0.01


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Posted to a request's events when the step loop failed; the handler reports INTERNAL."""

    error: Exception


class EngineThread:
    def __init__(self, engine: Engine, on_step: Callable[[float], None] = lambda seconds: None):
        """``on_step(seconds)``: called on this thread after every step with its duration (metrics)."""
        self.engine = engine
        self._on_step = on_step
        self._commands: queue.Queue = queue.Queue()  # (callable, Future | None)
        self._boxes: dict[int, EventBox] = {}
        self._stopped = False
        self.completed = 0
        self.cancelled = 0
        self.generated_tokens = 0
        self.steps_with_trees = 0
        self.plain_steps = 0
        self.published = None  # the publisher's last result (see publish_with)
        self._publisher: Callable[[Engine], object] | None = None
        self._published_at = float("-inf")  # perf_counter() of the last publish ...
        self._published_running = -1  # ... and the running requests then
        self._thread = threading.Thread(target=self._run, name="engine-thread", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish_with(self, fn: Callable[[Engine], object]) -> None:
        """``published = fn(engine)`` (on this thread) after every batch of commands and every step
        that changes the running requests or leaves the engine without work; between those, after
        the first step that ends ``PUBLISH_EVERY_S`` or more after the last publish. Readers that
        must never wait for a step read ``published``."""
        self._publisher = fn
        self.published = None

    def stop(self) -> None:
        self._stopped = True
        self._commands.put((lambda: None, None))  # wake the loop
        self._thread.join(timeout=30)

    def _call(self, fn, timeout_s: float | None = None):
        """Run ``fn()`` on the engine thread between steps; returns its result or raises its error
        (concurrent.futures.TimeoutError after ``timeout_s``)."""
        done: Future = Future()
        self._commands.put((fn, done))
        return done.result(timeout_s)

    def submit(self, prompt_ids: list[int], params: SamplingParams, speculate: bool,
               tree: TreeSettings | None, max_waiting: int | None = None) -> tuple[int, EventBox]:
        """Validate and queue a request (raises typed errors at once); returns (id, its events).
        ``max_waiting``: CapacityError when that many requests already wait for a batch slot."""
        events = EventBox()

        def add():
            waiting = len(self.engine.scheduler.waiting)
            if max_waiting is not None and waiting >= max_waiting:
                raise CapacityError(f"{waiting} requests are queued, the server queues at most {max_waiting}; "
                                    "retry later")
            seq_id = self.engine.add_request(prompt_ids, params, speculate, tree)
            self._boxes[seq_id] = events
            return seq_id
        return self._call(add), events

    def cancel(self, seq_id: int) -> None:
        """Abort a request (client gone or deadline passed); its KV is freed before the next step."""
        self._commands.put((lambda: self._cancel(seq_id), None))

    def _cancel(self, seq_id: int) -> None:
        if self._boxes.pop(seq_id, None) is not None:
            self.engine.abort(seq_id)
            self.cancelled += 1
            log.info("request %d cancelled; its KV is free", seq_id)

    def read(self, fn, timeout_s: float | None = None):
        """``fn(engine)`` evaluated on the engine thread (metrics and info snapshots)."""
        return self._call(lambda: fn(self.engine), timeout_s)

    def _drain(self, block: bool) -> bool:
        """Run the queued commands (waiting for one when ``block``); whether any ran."""
        try:
            item = self._commands.get(block=block)
        except queue.Empty:
            return False
        while True:
            fn, done = item
            try:
                result = fn()
                if done is not None:
                    done.set_result(result)
            except Exception as exc:  # typed request errors travel back to the handler
                if done is None:
                    log.exception("engine command failed")
                else:
                    done.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run(self) -> None:
        while not self._stopped:
            if self._drain(block=not self.engine.has_work):
                self._publish()  # commands changed the state (the step's own publish follows it)
            if self._stopped or not self.engine.has_work:
                continue
            start = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as exc:  # a bug: fail the requests in flight, keep serving
                log.exception("engine step failed; aborting %d requests", len(self._boxes))
                self._fail_all(exc)
                self._publish()
                continue
            end = time.perf_counter()
            self._count_step(end - start)
            finished = self._dispatch(events)
            if finished or end - self._published_at >= PUBLISH_EVERY_S or not self.engine.has_work or \
                    len(self.engine.scheduler.running) != self._published_running:
                self._publish()

    def _publish(self) -> None:
        self._published_at, self._published_running = time.perf_counter(), len(self.engine.scheduler.running)
        if self._publisher is not None:
            try:
                self.published = self._publisher(self.engine)
            except Exception:  # a metrics bug must not stop the engine
                log.exception("publishing the engine's counters failed")

    def _count_step(self, seconds: float) -> None:
        if self.engine.last_step_verified_trees:
            self.steps_with_trees += 1
        else:
            self.plain_steps += 1
        self._on_step(seconds)

    def _dispatch(self, events: list[TokenEvent]) -> bool:
        """Post each request's events to its stream; whether any request finished."""
        completed = self.completed
        for ev in events:
            self.generated_tokens += len(ev.token_ids)
            box = self._boxes.get(ev.seq_id)
            if box is None:
                continue
            last = ev.finish_reason is not None
            box.post(ev, last)
            if last:
                del self._boxes[ev.seq_id]
                self.completed += 1
        return self.completed != completed

    def _fail_all(self, exc: Exception) -> None:
        for seq_id, box in list(self._boxes.items()):
            self.engine.abort(seq_id)
            box.post(EngineFailure(exc), last=True)
        self._boxes.clear()
