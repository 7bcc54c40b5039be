"""The command line (``cli.main``) under ``tracemalloc``, for the soak's ``--trace-heap``: every
``SOAK_HEAP_EVERY_S`` seconds a snapshot of the Python heap (after a full collection) goes to
``SOAK_HEAP_DIR``/heap_NNN.pickle, each allocation with its line.

    SOAK_HEAP_DIR=/tmp/h python -m benchmarks.traced_serve serve-verify --model ... --listen ...
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _dump_every(folder: Path, every_s: float) -> None:
    for i in range(10**6):
        time.sleep(every_s)
        gc.collect()
        # Written whole or not at all: the process may be stopped mid-dump (the soak ends it, or
        # kills it), and the reader takes the last snapshot it finds.
        partial = folder / f"heap_{i:03d}.pickle.partial"
        tracemalloc.take_snapshot().dump(str(partial))
        os.replace(partial, folder / f"heap_{i:03d}.pickle")


def main() -> int:
    """(Without ``SOAK_HEAP_DIR``: the command line untraced.) The heavy imports come before the
    tracing starts: traced, importing torch takes seconds, and modules imported once never grow."""
    import importlib.util

    import grpc  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (what the service's start imports of torch)

    import verify_service.server  # noqa: F401
    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401
    from cli.main import main as cli_main

    if os.environ.get("SOAK_HEAP_DIR"):
        folder = Path(os.environ["SOAK_HEAP_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        tracemalloc.start(1)  # (the allocating line: what the report groups by; deeper traces cost more)
        threading.Thread(target=_dump_every, args=(folder, float(os.environ.get("SOAK_HEAP_EVERY_S", "60"))),
                         daemon=True).start()
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
