"""The step timeline (benchmarks/step_timeline.py): its trace analysis on a hand-made trace, and
its phase timing on a tiny speculative engine (CPU)."""

import time

import pytest

from benchmarks.step_timeline import analyse, host_phases, patched
from common.sampling_params import SamplingParams
from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from tiny_eagle import make_target_and_head
from tiny_models import target_for
from verify_service.engine import Engine


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_device_time_goes_to_the_phase_that_launched_it_and_idle_time_to_the_phase_running():
    """Two steps of 1,000 us. Step 1: the forward (host 0-300) launches a kernel (400-900, a graph: two
    kernels of one correlation); the device idles 0-300 (forward), 300-400 and 900-1000 (other). Step 2:
    the draft (host 1000-1600) launches 1700-1800, idle 1000-1600 draft, 1600-1700 and 1800-2000 other."""
    trace = {"traceEvents": [
        _x("step", "user_annotation", 0, 1000), _x("step", "user_annotation", 1000, 1000),
        _x("target_forward", "user_annotation", 0, 300), _x("draft_call", "user_annotation", 1000, 600),
        _x("cudaGraphLaunch", "cuda_runtime", 250, 10, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 1500, 10, correlation=2),
        _x("k1", "kernel", 400, 300, correlation=1), _x("k2", "kernel", 700, 200, correlation=1),
        _x("k3", "kernel", 1700, 100, correlation=2),
    ]}
    got = analyse(trace)
    assert got["steps"] == 2 and got["wall_ms"] == 1.0
    assert got["device_busy_ms"] == pytest.approx(0.3)  # (500 + 100) us over 2 steps
    assert got["host_ms_by_phase"] == {"draft_call": 0.3, "target_forward": 0.15}
    assert got["device_ms_by_launching_phase"] == {"target_forward": 0.25, "draft_call": 0.05}
    idle = got["device_idle_ms_by_host_phase"]
    assert idle["draft_call"] == pytest.approx(0.3) and idle["target_forward"] == pytest.approx(0.15)
    assert idle["step_other"] == pytest.approx(0.25)  # 300-400, 900-1000, 1600-1700, 1800-2000: 500 us / 2
    with pytest.raises(ValueError):
        analyse({"traceEvents": []})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("timeline"))


@pytest.mark.parametrize("chain", [False, True])
def test_host_phases_time_a_speculative_step_and_leave_the_engine_as_it_was(dirs, chain):
    spec = SpecConfig(str(dirs[1]), tree="dynamic", depth=3, top_k=2, max_nodes=6)
    target = target_for(dirs[0])
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len)
    engine = Engine(target, drafter, spec.settings)
    engine.speculation.chain = chain  # the draft behind acceptance (a step of trees), or after the sync
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    phases = host_phases(engine, 4, lambda: None)
    call = "draft_chained" if chain else "draft_call"
    for name in ("step", "target_forward", "accept", call, "draft_extend", "draft_propose", "commit_trees"):
        assert phases[name] > 0, name
    assert not chain or phases["verify_ahead"] > 0  # (trees from the last step's chained draft)
    assert phases["step"] >= phases[call] >= phases["draft_propose"]
    assert "step" not in engine.__dict__ and "accept" not in engine.verifier.__dict__  # unpatched again
    assert "_verify_ahead" not in engine.__dict__ and "step_trees_on_device" not in engine.target.runner.__dict__
    with patched(engine):
        assert "step" in engine.__dict__
    assert "step" not in engine.__dict__


def test_patched_with_a_cpu_clock_times_both_and_restores_the_shared_methods(dirs):
    """Clock mode with the thread's CPU time too (``services_bench.py --phases``): every phase gets
    both; the class-level methods it wraps for the run (``torch.cat``, ``Tensor.cpu``, graph replays)
    are the originals again after it."""
    import torch
    from collections import defaultdict

    engine = Engine(target_for(dirs[0]))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    originals = torch.cat, torch.Tensor.cpu, torch.cuda.CUDAGraph.replay
    wall, cpu = defaultdict(float), defaultdict(float)
    with patched(engine, wall, cpu):
        assert torch.cat is not originals[0]
        for _ in range(4):
            engine.step()
    assert (torch.cat, torch.Tensor.cpu, torch.cuda.CUDAGraph.replay) == originals
    assert wall["step"] > 0 and cpu["step"] > 0 and set(cpu) == set(wall)
    assert wall["step"] >= wall["target_forward"] > 0


def test_phased_serve_times_the_engine_thread_and_undoes_it(dirs, tmp_path, monkeypatch):
    """``benchmarks/phased_serve.py``: an engine thread started after ``instrument`` writes its steps'
    and loop's cumulative phase times to the file; ``per_step`` subtracts two reads; closing the
    thread's ``phases_stack`` restores the engine and stops the writer."""
    from benchmarks import phased_serve
    from verify_service.engine_thread import EngineThread

    monkeypatch.setattr(EngineThread, "start", EngineThread.start)  # (restored after the test)
    out = tmp_path / "phases.json"
    phased_serve.instrument(out)
    loop = EngineThread(Engine(target_for(dirs[0])))
    loop.start()
    try:
        before = phased_serve.read(out)
        _, events = loop.submit([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), False, None)
        got = 0
        while got < 5:
            got += sum(len(e.token_ids) for e in events.take(30.0))
        time.sleep(3 * phased_serve.EVERY_S)
        after = phased_serve.read(out)
    finally:
        loop.stop()
        loop.phases_stack.close()
    steps = phased_serve.per_step(before, after, 5)
    assert steps["step"]["wall"] > 0 and steps["loop_dispatch"]["wall"] > 0
    assert list(steps) == sorted(steps, key=lambda k: -steps[k]["wall"])  # the largest first
    assert "step" not in loop.engine.__dict__ and "_dispatch" not in loop.__dict__
    written = out.stat().st_mtime
    time.sleep(3 * phased_serve.EVERY_S)
    assert out.stat().st_mtime == written  # the writer stopped
    assert phased_serve.per_step({"wall_s": {"a": 1.0}, "cpu_s": {"a": 0.5}},
                                 {"wall_s": {"a": 3.0, "b": 0.0}, "cpu_s": {"a": 1.5}}, 2) == \
        {"a": {"wall": 1000.0, "cpu": 500.0, "blocked": 500.0}}
    assert phased_serve.read(tmp_path / "absent.json") == {"wall_s": {}, "cpu_s": {}}


def test_phased_serve_draft_side_wraps_the_answers_and_undoes_it(tmp_path):
    """The draft service's side (``instrument_draft``): the answer and socket methods wrapped, their
    calls counted into the file, all restored when the returned stack closes."""
    from benchmarks import phased_serve
    from draft_service.step_answer import StepAnswerer
    from link.step_socket import StepSocket

    originals = StepAnswerer.chain, StepAnswerer.answer, StepSocket.recv
    out = tmp_path / "draft_phases.json"
    stack = phased_serve.instrument_draft(out)
    try:
        assert StepAnswerer.chain is not originals[0] and StepSocket.recv is not originals[2]
        time.sleep(2 * phased_serve.EVERY_S)
        assert phased_serve.read(out)["calls"] == {}
    finally:
        stack.close()
    assert (StepAnswerer.chain, StepAnswerer.answer, StepSocket.recv) == originals
