"""The step's one device-to-host copy: every engine step (decode, tree verification, either beside
a prefill chunk) reads the device exactly once when a token is due, and never otherwise.

Counted: every way project code can read a tensor on the host (``tolist``, ``item``, ``cpu``,
``numpy``, ``bool``/``int``/``float``/``index`` of a tensor, ``np.asarray``), on the Triton kernel
set (the CUDA default). Not counted: reads from inside Triton (its CPU interpreter reads tensors
by design), the draft's (its own process in production) and ``HOST_SIDE`` functions, which
compute on host tensors.
"""

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from drafters import OracleDrafter
from tiny_models import TRITON_DEVICE, make_model_dir, target_for
from verify_service.engine import Engine

pytest.importorskip("triton")
ROOT = str(Path(__file__).resolve().parent.parent)
READS = ["tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"]
# Functions that compute on host tensors by design (the step layout is built on the host).
HOST_SIDE = {"tree_chunks"}


@contextmanager
def host_reads():
    """Patches the tensor read methods; yields (reads, on): reads collects (method, file:line) of
    project code's calls while ``on["counting"]``."""
    reads, on = [], {"counting": False}
    originals = {m: getattr(torch.Tensor, m) for m in READS}

    def wrap(name, fn):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            where = frame.f_code.co_filename
            if on["counting"] and where.startswith(ROOT) and "/.venv/" not in where \
                    and frame.f_code.co_name not in HOST_SIDE:
                reads.append((name, f"{Path(where).name}:{frame.f_lineno}"))
            return fn(self, *args, **kwargs)
        return read

    for m, fn in originals.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    try:
        yield reads, on
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)


def test_every_step_reads_the_device_once(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    kw = dict(kernels="triton", device=TRITON_DEVICE, max_batch_tokens=24)
    drafter = OracleDrafter(target_for(model_dir, **kw), depth=3, siblings=1)
    engine = Engine(target_for(model_dir, **kw), drafter, TreeSettings("dynamic", depth=3, max_nodes=6))
    drafter.engine = engine
    prompts = [list(range(3, 40)), [5, 6, 7]]  # 2 prefill chunks, and 1
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True)]
    engine.generate(prompts, params)  # first round: staging buffers grow to the workload's size
    engine.add_request(prompts[1], params[1])  # the same again, counted: a steady state; the long
    kinds, steps = set(), 0                       # prompt arrives while the short one verifies trees
    with host_reads() as (reads, on):
        draft_step = drafter.step

        def draft_uncounted(*args):
            on["counting"] = False
            try:
                return draft_step(*args)
            finally:
                on["counting"] = True

        drafter.step = draft_uncounted
        while engine.has_work:
            steps += 1
            if steps == 3:
                engine.add_request(prompts[0], params[0])
            trees = any(s.tree for s in engine.scheduler.running)
            prefill = any(s.prefilling for s in engine.scheduler.running) or bool(engine.scheduler.waiting)
            reads.clear()
            on["counting"] = True
            events = engine.step()
            on["counting"] = False
            kinds.add((trees, prefill))
            assert len(reads) == (1 if any(e.token_ids for e in events) else 0), (trees, prefill, reads)
    assert (True, True) in kinds and (True, False) in kinds  # trees beside a prefill chunk, and alone
    assert (False, True) in kinds
