"""The engine thread: one thread owns the Generator and steps it while there is work.

RPC handler threads submit requests and cancellations; each request gets a queue of
events the handler streams to its client. The Generator is not thread-safe, so every call
into it happens under ``_lock`` (held by the loop during a step: a submit waits at most
one step).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from common.sampling_params import SamplingParams
from common.spec_config import TreeSettings
from verify_service.generator import Generator, TokenEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Put on a request's queue when the step loop failed; the handler reports INTERNAL."""

    error: Exception


class EngineLoop:
    def __init__(self, gen: Generator):
        self.gen = gen
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queues: dict[int, queue.Queue] = {}
        self._stopped = False
        self.completed = 0
        self.cancelled = 0
        self.steps_with_trees = 0
        self.plain_steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def submit(self, prompt_ids: list[int], params: SamplingParams, speculate: bool,
               tree: TreeSettings | None) -> tuple[int, queue.Queue]:
        """Validate and queue a request (raises typed errors at once); returns (id, event queue)."""
        events: queue.Queue = queue.Queue()
        with self._wake:
            seq_id = self.gen.add_request(prompt_ids, params, speculate, tree)
            self._queues[seq_id] = events
            self._wake.notify()
        return seq_id, events

    def cancel(self, seq_id: int) -> None:
        """Abort a request (client gone or deadline passed); frees its KV at once."""
        with self._wake:
            if self._queues.pop(seq_id, None) is not None:
                self.gen.abort(seq_id)
                self.cancelled += 1
                log.info("request %d cancelled; its KV is free", seq_id)

    def read(self, fn):
        """Run ``fn(generator)`` under the lock (metrics and info snapshots)."""
        with self._lock:
            return fn(self.gen)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.gen.has_work:
                    self._wake.wait()
                if self._stopped:
                    return
                try:
                    events = self.gen.step()
                except Exception as exc:  # a bug: fail the requests in flight, keep serving
                    log.exception("engine step failed; aborting %d requests", len(self._queues))
                    self._fail_all(exc)
                    continue
                self._count_step()
                self._dispatch(events)

    def _count_step(self) -> None:
        if self.gen.last_step_verified_trees:
            self.steps_with_trees += 1
        else:
            self.plain_steps += 1

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            q = self._queues.get(ev.seq_id)
            if q is None:
                continue
            q.put(ev)
            if ev.finish_reason is not None:
                del self._queues[ev.seq_id]
                self.completed += 1

    def _fail_all(self, exc: Exception) -> None:
        for seq_id, q in list(self._queues.items()):
            self.gen.abort(seq_id)
            q.put(EngineFailure(exc))
        self._queues.clear()
