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


@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
def test_a_draft_proposal_reads_the_device_only_for_its_trees(tmp_path, tree):
    """Draft extend and every tree level run without a host read: the levels' tokens, masks, KV
    slots and positions stay on the device. A proposal reads the finished trees, in one copy."""
    import json

    from draft_service.drafter import EagleDrafter
    from draft_service.spec_config import SpecConfig
    from link.protocol import DraftFeed, ProposeRequest
    from tiny_eagle import make_eagle_dir
    from tiny_models import tiny_config

    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3), kernels="triton",
                         device=TRITON_DEVICE)
    static = tmp_path / "tree.json"
    static.write_text(json.dumps({"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}))
    spec = SpecConfig(str(make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)), tree=tree,
                      depth=4, top_k=3, max_nodes=10, static_tree_file=str(static) if tree == "static" else None)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           4, target.max_model_len, "triton")
    hidden = target.model_config.hidden_size * len(drafter.capture_layers)  # the fed features' width
    g = torch.Generator().manual_seed(0)

    def feed(seq, start, n):
        return DraftFeed(seq, start, torch.randn(n, hidden, generator=g).to(TRITON_DEVICE),
                         torch.randint(0, target.model_config.vocab_size, (n,), generator=g).numpy())

    # Buffers settle: prompts (an eager extend through the step layout's two staging buffers), then
    # steps of the measured shape (on CUDA, the extend graph for two sequences and its ring buffers).
    for f1, f2 in ((feed(1, 0, 9), feed(2, 0, 4)), (feed(1, 9, 9), feed(2, 4, 4)), (feed(1, 18, 2), feed(2, 8, 3))):
        drafter.step([f1, f2], [ProposeRequest(1, 4), ProposeRequest(2, 4)])
    feeds = [feed(1, 20, 2), feed(2, 11, 3)]
    with host_reads() as (reads, on):
        on["counting"] = True
        trees = drafter.step(feeds, [ProposeRequest(1, 4), ProposeRequest(2, 4)])
        on["counting"] = False
    assert set(trees) == {1, 2} and all(len(t.tokens) > 1 for t in trees.values())
    # Only the finished trees come back (the proposal's Readback, step_layout.py): tokens, parents,
    # depths and scores of every tree of the batch packed together, one copy (on CUDA into a pinned
    # buffer, then viewed through .numpy(); off CUDA .cpu() first).
    assert {where.split(":")[0] for _, where in reads} == {"step_layout.py"}, reads
    want = ["numpy"] if torch.device(TRITON_DEVICE).type == "cuda" else ["cpu", "numpy"]
    assert [kind for kind, _ in reads] == want, reads
