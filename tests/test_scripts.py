"""Every benchmark script starts and parses its arguments (its imports resolve after moves)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())


def test_scripts_were_found():
    assert len(SCRIPTS) >= 6


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_pyspy_summary_shares_one_threads_samples(tmp_path):
    from benchmarks.pyspy_summary import summarize
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (1): engine-thread;run (engine_thread.py:1);step (verify_service/engine.py:9);wait (x.py:2) 3\n"
        "thread (1): engine-thread;run (engine_thread.py:1);idle (verify_service/engine_thread.py:5) 1\n"
        "thread (2): other;run (engine_thread.py:1) 100\n")
    text = summarize(str(raw), "engine-thread")
    assert "4 samples" in text
    assert " 75.0% step" in text and "100.0% run" in text
    assert " 75.0% step (verify_service/engine.py:9) :: wait" in text


def test_pyspy_summary_counts_each_threads_samples(tmp_path):
    from benchmarks.pyspy_summary import per_thread
    raw = tmp_path / "raw.txt"
    raw.write_text("thread (1): engine-thread;step (verify_service/engine.py:9) 3\n"
                   "thread (1): engine-thread 2;idle (x.py:5) 1\n"  # (py-spy numbers a repeated name)
                   "thread (2): ThreadPoolExecutor-0_1;send (grpc/_server.py:1) 4\n")
    lines = per_thread(str(raw)).splitlines()
    assert lines[0].endswith("8 samples")
    assert lines[1].split() == ["4", "50.0%", "thread", "(1):", "engine-thread"]
    assert lines[2].split() == ["4", "50.0%", "thread", "(2):", "ThreadPoolExecutor-0_1"]


def test_profile_diff_puts_the_largest_difference_first(tmp_path):
    import cProfile
    import time
    from benchmarks.profile_diff import diff

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def slow():
        busy(0.03)

    def fast():
        busy(0.001)

    paths = []
    for work in ((fast,), (fast, slow)):
        prof = cProfile.Profile()
        prof.enable()
        for fn in work:
            fn()
        prof.disable()
        paths.append(str(tmp_path / f"{len(paths)}.pstats"))
        prof.dump_stats(paths[-1])
    rows = diff(*paths, top=5, per=1.0)
    name, calls_a, calls_b, us_a, us_b = rows[0]
    assert "busy" in name or "perf_counter" in name  # the loop's own time, only in the second
    slow_row = next(r for r in diff(*paths, top=50) if r[0].endswith("(slow)"))
    assert slow_row[1:3] == (0, 1)  # slow: absent from the first, called once in the second


def test_services_bench_request_timings():
    from benchmarks.services_bench import request_timings
    rows = [(1.0, 1.01, 1.1), (0.0, 0.02, 0.5)]  # (start, first token, end), seconds, out of order
    t = request_timings(rows)
    assert t == pytest.approx({"ttft_ms": 15.0, "after_first_ms": 285.0, "client_gap_ms": 500.0}, abs=0.002)
    assert request_timings([]) == {}


def test_run_continuous_keeps_the_requests_in_flight_and_counts_every_token(tmp_path):
    from common.sampling_params import SamplingParams
    from tiny_models import make_model_dir, target_for
    from tools.evaluate import run_continuous
    from verify_service.engine import Engine
    engine = Engine(target_for(make_model_dir(tmp_path / "t", "llama3", seed=5, std=0.3), max_num_seqs=4))
    prompts = [list(range(10 + i, 20 + i)) for i in range(5)]
    in_flight = []
    add = engine.add_request
    engine.add_request = lambda p, sp: in_flight.append(len(engine.sequences) + 1) or add(p, sp)
    tokens, seconds, steps = run_continuous(engine, prompts, SamplingParams(max_tokens=6, ignore_eos=True), 2)
    assert tokens == 30 and seconds > 0 and steps >= 15  # two at a time, one token a step each
    assert max(in_flight) == 2 and len(in_flight) == 5 and not engine.has_work


def _stand_in(tmp_path, monkeypatch, attr: str, switch: str, cases: str):
    """switch_ab.py with a stand-in for the script it runs (its ``attr``): the stand-in writes ``cases``
    (a Python expression of ``ms``, 1 plus the ``switch`` it saw) as its JSON."""
    from benchmarks import switch_ab
    fake = tmp_path / f"fake_{attr.lower()}.py"
    fake.write_text("import json, os, sys\n"
                    "out = sys.argv[sys.argv.index('--out') + 1]\n"
                    f"ms = float(os.environ.get('{switch}', '0')) + 1.0\n"
                    f"json.dump({{'cases': {cases}}}, open(out, 'w'))\n")
    monkeypatch.setattr(switch_ab, attr, fake)
    monkeypatch.delenv(switch, raising=False)
    return switch_ab


def test_switch_ab_runs_each_variant_in_its_own_environment(tmp_path, monkeypatch):
    """switch_ab.py: one process per variant and round, each with its switches set, the step times
    side by side (a stand-in for decode_baseline.py reports the switch it saw)."""
    switch_ab = _stand_in(tmp_path, monkeypatch, "BASELINE", "EAGLE3_PDL_ALL",
                          "[{'case': sys.argv[2], 'kernels': 'triton', 'ms_per_step': ms}]")
    result = switch_ab.main(["--variant", "base=", "--variant", "all=EAGLE3_PDL_ALL=1", "--rounds", "2",
                             "--out", str(tmp_path / "ab.json"), "--", "--case", "smollm2:1:512"])
    assert result["ms_per_step"] == {"smollm2:1:512 triton": {"base": [1.0, 1.0], "all": [2.0, 2.0]}}
    assert [r["variant"] for r in result["runs"]] == ["base", "all", "base", "all"]
    with pytest.raises(SystemExit):
        switch_ab.main(["--variant", "x=PDL_ALL=1"])  # not an EAGLE3_ switch


def test_switch_ab_replays(tmp_path, monkeypatch):
    """switch_ab.py --script replay: replay_gates.py once per variant and round, each case's median
    step (target-only and each tree) side by side."""
    switch_ab = _stand_in(tmp_path, monkeypatch, "REPLAY", "EAGLE3_PDL",
                          "[{'context': 512, 'batch': 1, 'config': 'target-only', 'step_ms_median': ms}, "
                          "{'context': 512, 'batch': 1, 'config': 'chain:3 (replay)', 'step_ms_median': 2 * ms}]")
    result = switch_ab.main(["--script", "replay", "--variant", "base=", "--variant", "on=EAGLE3_PDL=1",
                             "--rounds", "2", "--", "--case", "512:1"])
    assert result["script"] == "replay" and result["script_args"] == ["--case", "512:1"]
    assert result["ms_per_step"] == {"512:1 target-only": {"base": [1.0, 1.0], "on": [2.0, 2.0]},
                                     "512:1 chain:3 (replay)": {"base": [2.0, 2.0], "on": [4.0, 4.0]}}


def test_switch_ab_times_the_speculative_step(tmp_path, monkeypatch):
    """switch_ab.py --script spec: profile_spec_step.py with --timeline once per variant and round, the
    step's unprofiled host time and the device's busy time side by side."""
    from benchmarks import switch_ab
    fake = tmp_path / "fake_spec.py"
    fake.write_text("import json, os, sys\n"
                    "assert '--timeline' in sys.argv\n"
                    "out = sys.argv[sys.argv.index('--out') + 1]\n"
                    "ms = float(os.environ.get('EAGLE3_PDL_SMALL', '1'))\n"
                    "json.dump({'model': sys.argv[1], 'context': 512, 'batch': 1, 'config': 'dynamic:7:10:59',\n"
                    "           'host_ms_by_phase_unprofiled': {'step': 1.5 - ms / 4}, 'device_busy_ms': 1.25 + ms / 4},\n"
                    "          open(out, 'w'))\n")
    monkeypatch.setattr(switch_ab, "SPEC", fake)
    monkeypatch.delenv("EAGLE3_PDL_SMALL", raising=False)
    result = switch_ab.main(["--script", "spec", "--variant", "off=EAGLE3_PDL_SMALL=0", "--variant", "on=",
                             "--rounds", "2", "--", "smollm2", "--exact"])
    assert result["script_args"] == ["smollm2", "--exact", "--timeline"]
    case = "smollm2 512:1 dynamic:7:10:59"
    assert result["ms_per_step"] == {f"{case} step": {"off": [1.5, 1.5], "on": [1.25, 1.25]},
                                     f"{case} device busy": {"off": [1.25, 1.25], "on": [1.5, 1.5]}}
    assert result["spread"] == {}


def test_switch_ab_flags_a_variant_whose_processes_disagree(tmp_path, monkeypatch, capsys):
    """A variant whose processes land more than ``SPREAD`` apart (a stand-in whose third run is 20%
    slower) is flagged in the table and in the JSON; one within it is not."""
    switch_ab = _stand_in(tmp_path, monkeypatch, "BASELINE", "EAGLE3_PDL_ALL",
                          "[{'case': 'c', 'kernels': 'k', 'ms_per_step': ms * (1.2 if os.path.exists(sys.argv[-1] + "
                          "'.slow') else 1.0)}]")
    runs = []
    real_run = switch_ab.subprocess.run

    def run(cmd, **kw):  # the base variant's second process: the slow one
        runs.append(cmd)
        if len(runs) == 3:
            Path(cmd[-1] + ".slow").touch()
        return real_run(cmd, **kw)

    monkeypatch.setattr(switch_ab.subprocess, "run", run)
    result = switch_ab.main(["--variant", "base=", "--variant", "all=EAGLE3_PDL_ALL=1", "--rounds", "2"])
    assert result["ms_per_step"] == {"c k": {"base": [1.0, 1.2], "all": [2.0, 2.0]}}
    assert result["spread"] == {"c k": {"base": 0.2}}
    assert "base's processes 20.0% apart" in capsys.readouterr().out


def test_exact_attention_tile_argument():
    """``decode_baseline.py --exact-attention-tile``: ROWSxWARPS[xSTAGES] -> the overrides it names."""
    import argparse

    from benchmarks.decode_baseline import attention_tile
    assert attention_tile("64x8") == {"BLOCK_M": 64, "NUM_WARPS": 8}
    assert attention_tile("16X4x2") == {"BLOCK_M": 16, "NUM_WARPS": 4, "NUM_STAGES": 2}
    for bad in ("64", "64x3", "48x4", "64x8x9", "axb", "64x8x2x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            attention_tile(bad)


def test_attention_benchmark_trees():
    """``attention_kernel.py --tree-depth``: a tree of that depth whose rows are each node's
    ancestors and itself (the root's, then the parent's, plus its own), depths from the root; without
    it, a causal chain."""
    import torch

    from benchmarks.attention_kernel import tree_of

    table, depths = tree_of(60, 7)
    assert depths.max() == 7 and (depths == 1).sum() == 9 and (depths == 7).sum() == 8
    assert torch.equal(table.sum(1), depths + 1)
    for j in range(1, 60):
        parent = max(i for i in range(j) if table[j, i] and depths[i] == depths[j] - 1)
        assert torch.equal(table[j] & ~torch.nn.functional.one_hot(torch.tensor(j), 60).bool(), table[parent])
    chain, chain_depths = tree_of(5, None)
    assert torch.equal(chain, torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert chain_depths.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(tree_of(3, 7)[0], chain[:3, :3])  # fewer nodes than levels: a chain
    with pytest.raises(ValueError, match="depth"):
        tree_of(8, 0)


def test_attention_benchmark_exact_settings():
    """``attention_kernel.py --exact-settings``: NAME=INT pairs of the exact kernel's constants; a
    name the module lacks, or a value that is no integer, is a usage error before anything runs."""
    import argparse

    from benchmarks.attention_kernel import parse_settings

    ap = argparse.ArgumentParser()
    assert parse_settings(ap, "TREE_WIDE_PROGRAMS_PER_SM=4,TREE_TILES=1") == {"TREE_WIDE_PROGRAMS_PER_SM": 4,
                                                                               "TREE_TILES": 1}
    for bad in ("NO_SUCH_CONSTANT=1", "TREE_TILES=two", "TREE_TILES", "TREE_TILES=1,"):
        with pytest.raises(SystemExit):
            parse_settings(ap, bad)


@pytest.mark.parametrize("mode", ["ab", "plain"])
def test_profile_spec_step_decodes_plainly_with_the_draft_attached(tmp_path, mode):
    """``profile_spec_step.py --mode ab|plain``: its always-plain policy is one the engine accepts
    (it failed once the engine asked policies whether a request starts without the draft)."""
    import json

    from tiny_models import make_model_dir
    model = make_model_dir(tmp_path / "t", "llama3", seed=1)
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_spec_step.py"), str(model),
                          "--head", "random", "--draft-vocab", "64", "--mode", mode, "--batch", "2",
                          "--context", "16", "--steps", "2", "--kernel-rows", "2", "--stats-rows", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result, _ = json.JSONDecoder().raw_decode(out.read_text())  # (--mode plain: the profiles follow it)
    assert result["mode"] == mode and result["batch"] == 2
    if mode == "ab":
        assert set(result["step_ms_median"]) == {"target", "plain", "detached"}
        assert result["plain_over_target"] > 0 and result["detached_over_target"] > 0


def test_warm_up_coverage_runs_its_serving_scenario_on_a_cpu(tmp_path):
    """The warm-up coverage benchmark on a CPU: a tiny model, no compilation (the reference kernels),
    every request served."""
    sys.path.insert(0, str(ROOT / "tests"))
    from benchmarks.warm_up_coverage import main
    from tiny_models import make_model_dir

    model = make_model_dir(tmp_path / "m", "llama3", seed=4)
    report = main(["--model", str(model), "--device", "cpu", "--dtype", "float32", "--long", "90", "--waves", "1,2",
                   "--pieces", "12,2", "--out", str(tmp_path / "r.json")])
    assert report["compilations_after_warm_up"] == 0 and report["warm_pieces"] == [12, 2]
    assert report["warm_up_s"] == 0.0 and (tmp_path / "r.json").exists()


def test_link_rtt_runs_both_transports_on_a_cpu(tmp_path):
    """``link_rtt.py`` end to end on a CPU, a few steps of each transport: its stand-in verify side
    offers every buffer the draft's handshake asks for (it lacked the chained steps' two once, and the
    draft refused every session)."""
    import json

    out = tmp_path / "rtt.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "link_rtt.py"), "--batch", "2", "--steps", "20",
                          "--warmup", "5", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["transport"] for r in rows} == {"stream", "socket"}
    assert all(r["steps"] == 20 and r["link_us"]["p50"] > 0 for r in rows)
