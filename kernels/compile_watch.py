"""Kernel compilations while serving. Triton compiles a kernel on its first launch per
specialisation, which stalls that step for 0.1-2 s; the services compile what they can foresee at
start-up (``ModelRunner.warm_up``, ``EagleDrafter.warm_up``) and, from then on, warn about every
compilation with the kernel and its specialisation, so a shape the warm-up missed shows in the log
and in ``compilations``."""

from __future__ import annotations

import logging


class CompileWatch:
    def __init__(self, log: logging.Logger, after: str):
        """``after``: what the warm-up covered, for the warning's text."""
        self.log, self.after = log, after
        self.compilations = 0

    def start(self) -> bool:
        """Warn on every Triton compilation from now on (this process: one hook). False where Triton
        is not installed."""
        try:
            import triton.knobs
        except ImportError:
            return False
        triton.knobs.runtime.jit_post_compile_hook = self._compiled
        return True

    def _compiled(self, *args, **kwargs) -> None:
        self.compilations += 1
        fn = kwargs.get("fn")
        self.log.warning("Triton compiled %s after %s (this step stalls; the warm-up missed this shape): %s",
                         getattr(fn, "name", fn), self.after, str(kwargs.get("repr"))[:2000])
