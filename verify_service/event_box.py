"""One request's events on their way from the engine thread to the RPC handler that streams them.

Every response message wakes the handler thread and gRPC's polling thread (three wake-ups), each
taking the GIL from the engine thread mid-step (torch releases it at every op). So the handler
takes every event posted since it last looked in one go (one message however many steps they
span), and may let tokens gather for a while after a message: meanwhile only the request's last
event wakes it, the others cost the engine thread a list append.
"""

from __future__ import annotations

import threading


class EventBox:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._items: list = []
        self._ended = False  # the request's last event (its finish, or a failure) is in
        self._waiting = False  # the handler waits for any event, not only the last one

    def post(self, item, last: bool = False) -> None:
        """Engine thread: never waits. ``last``: nothing follows ``item`` (wake the handler at once)."""
        with self._cond:
            self._items.append(item)
            self._ended |= last
            if self._waiting or last:
                self._cond.notify()

    def take(self, timeout_s: float, gather_s: float = 0.0) -> list:
        """Handler: every event posted and not taken yet, in order; [] when none came in ``timeout_s``.
        ``gather_s`` > 0: first lets events gather that long, unless the last one comes sooner."""
        with self._cond:
            if gather_s > 0:
                self._cond.wait_for(lambda: self._ended, gather_s)
            self._waiting = True
            self._cond.wait_for(lambda: self._items, timeout_s)
            self._waiting = False
            items, self._items = self._items, []
        return items
