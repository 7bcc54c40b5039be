"""The garbage collector in a serving process: freeze what startup built, and measure the pauses.

CPython's oldest-generation collection stops the world and walks every tracked container object.
In a serving process nearly all of them are startup state that is never garbage (modules, the model's
modules and parameters, the tokenizer, CUDA graph bookkeeping), so a full collection costs tens of
milliseconds and reclaims nothing, and it lands on whichever step allocated last. ``gc.freeze()``
after startup moves that state out of the collector's reach: later objects are still collected
(cycles included), the frozen ones are still freed by reference counting. The services freeze once,
when they are warmed up; ``GcPauses`` measures what the collector still costs.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_for_exit() -> None:
    """Give the frozen objects back to the collector before the process exits: the interpreter's last
    collections then free them, and C extensions that count their live objects at exit (Triton's
    bindings print "nanobind: leaked N instances!") find none left."""
    gc.unfreeze()


class GcPauses:
    """Collections and the seconds they took, per generation, from ``install`` until ``remove``."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def install(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(collections, seconds) per generation so far."""
        return tuple(self.collections), tuple(self.seconds)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            g = min(int(info.get("generation", 2)), 2)
            self.collections[g] += 1
            self.seconds[g] += time.perf_counter() - self._started
            self._started = None
