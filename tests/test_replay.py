"""The replay hook (benchmarks only), the benchmarks that use it and the plot step, small on the CPU."""

import gc
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import plot, policy_host_cost, policy_replay, replay_gates, row_breakdown, speed_report
from benchmarks.record_acceptance import SizeRecorder, check_ranks, counts_of, record, summary
from common.tree_settings import tree_sizes
from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from tiny_eagle import make_eagle_dir
from tiny_models import make_model_dir, target_for, tiny_config
from tools.inprocess import build_engine
from verify_service.config import EngineConfig
from verify_service.adaptive import PolicyConfig
from verify_service.engine import Engine
from verify_service.replay import AcceptanceReplay

TRACE = {"kind": "acceptance_trace", "model": "tiny", "head": "random", "prompts": "none",
         "configs": {"chain:3": {"tree": {"tree": "chain", "depth": 3, "top_k": 8, "max_nodes": 59}, "tau": 2.5,
                                 "acceptance_per_depth": [0.75, 0.5, 0.25], "traces": [[3, 0, 2, 1]]}}}


def test_replayed_path_follows_first_children_then_tree_order():
    #   root(0) ─┬─ 1 ── 3 ── 4        columns; parents in kernel convention (root = column 0)
    #            └─ 2
    parents = np.array([-1, 0, 0, 1, 3, -1])  # column 5: padding
    assert AcceptanceReplay._path(parents, 5, 0) == [0]
    assert AcceptanceReplay._path(parents, 5, 3) == [0, 1, 3, 4]
    assert AcceptanceReplay._path(parents, 5, 4) == [0, 1, 3, 4, 2]  # deeper than the tree: tree order
    assert AcceptanceReplay._path(parents, 5, 9) == [0, 1, 3, 4, 2]  # never more than the nodes


@pytest.mark.parametrize("graphs", [False, True])
def test_an_engine_with_a_replay_accepts_what_the_trace_says(graphs, tmp_path):
    """Eagerly, and on the graphed paths (``graphs_on_cpu``: trees chained behind acceptance and
    verified from the device, whose host copies the replay's acceptance reads)."""
    target_dir = make_model_dir(tmp_path / "t", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    spec = SpecConfig(str(head), tree="chain", depth=3)
    target = target_for(target_dir, graphs_on_cpu=graphs)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels)
    replay = AcceptanceReplay([[3, 0, 2, 1], [1]])
    pool = replay.pool
    assert sorted(pool) == [0, 1, 1, 2, 3] and (replay.start_of(0), replay.start_of(1), replay.start_of(2)) == (0, 2, 1)
    engine = Engine(target, drafter, spec.settings, replay=replay)
    traces = record(engine, [list(range(10, 30)), [5, 6, 7]], max_tokens=40, batch=2)
    # Each sequence walks the pooled steps from its own offset (the end may be cut short).
    assert traces[0][:7] == (pool * 2)[:7] and traces[1][:6] == (pool * 3)[2:8]
    assert summary(traces, 3)["tau"] > 2 and target.blocks.num_used_blocks == 0


def test_a_smaller_tree_replays_what_its_size_accepted_at_the_same_step():
    """Per-size counts: a tree of n nodes takes the count of the largest recorded size it holds; the
    recorded tree (or no size given) the last. Path ranks: any n, the path's nodes ranked below n.
    Without either a tree takes the step's count."""
    replay = AcceptanceReplay([[[0, 1, 1, 2], [1, 1, 3, 5]]], sizes=[1, 2, 4, 8])
    first, second = (replay.pool[0], replay.pool[1])
    assert replay.next_accepted(7, 3) == first[1] and replay.next_accepted(7, 8) == second[3]
    assert replay.next_accepted(8, 1) == replay.pool[replay.start_of(1)][0]
    assert replay.next_accepted(7) == replay.pool[0][3]  # wrapped around: the recorded tree's count
    by_rank = AcceptanceReplay([[[0, 2, 2, 9], []]], ranks=True)
    path = [0, 2, 2, 9] if by_rank.pool[0] else []
    assert by_rank.next_accepted(1, 3) == sum(r < 3 for r in path)
    assert AcceptanceReplay.of_config({"path_ranks": [[[0, 2, 2, 9]]], "per_size": {}, "traces": [[4]]}) \
        .next_accepted(1, 1) == 1
    assert AcceptanceReplay.of_config({"traces": [[4]]}).next_accepted(1, 1) == 4
    plain = AcceptanceReplay([[3, 0, 2]])
    assert plain.next_accepted(1, 1) == plain.pool[0]


def test_a_replayed_tree_cut_to_fewer_levels_accepts_a_node_a_level_at_most(monkeypatch):
    """``EAGLE3_TREE_LEVELS``: a size cut to fewer levels replays the path's nodes ranked within it, at
    most one a level (the tree holds no deeper node); a size without a cut, as before."""
    from common import tree_settings

    monkeypatch.setattr(tree_settings, "TREE_LEVELS", ((3, 1),))
    replay = AcceptanceReplay([[[0, 1, 2]]], ranks=True)
    assert replay.next_accepted(1, 3) == 1 and replay.next_accepted(2, 4) == 3 and replay.next_accepted(3) == 3


def test_depths_cut_each_sizes_count_at_the_levels(tmp_path, capsys):
    """``policy_replay.py depths``: a size's accepted count cut at d levels (one path node a level),
    for d up to the levels the size's tree grows (``TreeSettings.capped``: 3 nodes, 3 levels)."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"sizes": [1, 3, 7], "steps": [[0, [1, 2, 5]], [0, [0, 0, 0]], [1, [1, 3, 7]]]}))
    table = policy_replay.main(["depths", str(trace)])
    assert table[1] == {1: round(2 / 3, 3)}
    assert table[3] == {1: round(2 / 3, 3), 2: round(4 / 3, 3), 3: round(5 / 3, 3)}
    assert table[7][1] == round(2 / 3, 3) and table[7][4] == round(8 / 3, 3) and table[7][7] == 4.0
    assert list(table[7]) == list(range(1, 8)) and "3 steps" in capsys.readouterr().out


def test_recorder_keeps_what_every_size_would_have_accepted(tmp_path):
    """``record_acceptance``'s recorder: the full dynamic tree every step, and per step the accepted
    path's ranks: a rank a node, never decreasing (``check_ranks``), from which a smaller size never
    accepts more; a request's last trees (cut short, not shown to a policy) ranked 0, 1, ... ."""
    target_dir = make_model_dir(tmp_path / "t", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    spec = SpecConfig(str(head), tree="dynamic", depth=4, top_k=3, max_nodes=12)
    recorder = SizeRecorder(spec.settings)
    engine = build_engine(EngineConfig(str(target_dir), device="cpu", dtype="float32", max_model_len=256,
                                       max_num_seqs=2), spec, policy=recorder)
    ranks: list = []
    traces = record(engine, [list(range(10, 30)), [5, 6, 7]], max_tokens=24, batch=2, ranks=ranks)
    check_ranks(traces, ranks)
    assert recorder.sizes == tree_sizes(spec.settings) and sum(len(t) for t in ranks) == sum(len(t) for t in traces) > 4
    assert recorder.decisions and set(recorder.decisions) == {12} and recorder.cut_short_trees >= 1
    assert all(r == sorted(r) and all(x < 12 for x in r) for t in ranks for r in t) and any(r for t in ranks for r in t)
    steps = [c for t in counts_of(ranks, recorder.sizes) for c in t]
    assert all(c == sorted(c) and all(a <= n for a, n in zip(c, recorder.sizes)) for c in steps)
    with pytest.raises(RuntimeError, match="disagree"):
        check_ranks([[1, 2]], [[[0], [0]]])


def test_replay_gates_runs_small_and_says_replay(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(TRACE))
    out = tmp_path / "gates.json"
    report = replay_gates.main(["--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--case", "32:1",
                                "--case", "24:2", "--steps", "6", "--trace", str(trace), "--out", str(out)])
    assert "REPLAY" in report and "meaningless" in report["REPLAY"] and json.loads(out.read_text()) == report
    rows = {(r["context"], r["batch"], r["config"]): r for r in report["cases"]}
    assert set(rows) == {(c, b, n) for c, b in ((32, 1), (24, 2)) for n in ("target-only", "chain:3 (replay)")}
    spec = rows[(32, 1, "chain:3 (replay)")]
    assert spec["tau"] > 1.5 and spec["efficiency"] == pytest.approx(spec["speedup"] / spec["tau"], abs=2e-3)
    if plot_available():
        assert [p.name for p in plot.main([str(out), "--out-dir", str(tmp_path / "png")])] == ["replay_gates.png"]


def test_replay_gates_adaptive_rows_say_why(tmp_path):
    """``--adaptive``: the policy's row carries its decisions and why: the calibrated forward costs
    it priced them with, its switches, probes and vetoes, the requests that ran without the draft,
    and what its cost model learned."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(TRACE))
    report = replay_gates.main(["--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--case", "32:1",
                                "--steps", "6", "--trace", str(trace), "--adaptive",
                                "--adaptive-variant", "prior_acceptance=0.9,leave_from=0", "--adaptive-warm", "1"])
    configs = [r["config"] for r in report["cases"]]
    assert "chain:3 (replay+adaptive prior_acceptance=0.9,leave_from=0)" in configs
    row = next(r for r in report["cases"] if r["config"].endswith("(replay+adaptive)"))
    policy = row["policy"]
    assert sum(row["decisions"].values()) >= 1
    assert set(policy["forward_ms"]) >= {"b1 q1", "b1 q4"} and all(v > 0 for v in policy["forward_ms"].values())
    assert policy["detached_requests"] >= 0 and "draft_ms" in policy["costs"] and "steps" in policy["costs"]
    assert len(row["speedups_before"]) == 1 and row["speedups_before"][0] > 0  # --adaptive-warm 1
    assert all("speedups_before" not in r for r in report["cases"] if "adaptive" not in r["config"])
    dynamic = {**TRACE, "configs": {"dynamic:3:2:4": {"tree": {"tree": "dynamic", "depth": 3, "top_k": 2,
                                                                 "max_nodes": 4}, "tau": 2.0,
                                                        "acceptance_per_depth": [0.5, 0.3, 0.2], "traces": [[1, 2]]}}}
    old_trace = tmp_path / "dynamic.json"
    old_trace.write_text(json.dumps(dynamic))
    with pytest.raises(SystemExit):  # no per-size counts: the policy's smaller trees cannot be replayed
        replay_gates.main(["--geometry", "tiny", "--device", "cpu", "--case", "32:1", "--trace", str(old_trace),
                           "--adaptive"])
    dynamic["configs"]["dynamic:3:2:4"]["per_size"] = {"sizes": [1, 4], "traces": [[[0, 1], [1, 2]]]}
    old_trace.write_text(json.dumps(dynamic))
    with pytest.raises(SystemExit):  # counts for sizes 1 and 4, the policy picks 1, 2 and 4 too
        replay_gates.main(["--geometry", "tiny", "--device", "cpu", "--case", "32:1", "--trace", str(old_trace),
                           "--adaptive"])
    for bad in (["--adaptive-variant", "leave_from=0"], ["--adaptive", "--adaptive-variant", "no_such_field=1"],
                ["--adaptive-warm", "1"],
                ["--config", "chain:9"]):
        with pytest.raises(SystemExit):
            replay_gates.main(["--geometry", "tiny", "--device", "cpu", "--case", "32:1", "--trace", str(trace), *bad])


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_speed_report_runs_small(tmp_path):
    target_dir = make_model_dir(tmp_path / "t", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    out = tmp_path / "report.json"
    try:
        report = speed_report.main(["--model", str(target_dir), "--head", str(head), "--batch", "1", "--batch", "2",
                                    "--min-prompts", "2", "--max-tokens", "5", "--tree", "chain:2", "--no-hf",
                                    "--verify-tokens", "1", "--verify-tokens", "3", "--verify-contexts", "16",
                                    "--verify-batches", "1", "--device", "cpu", "--dtype", "float32", "--rounds",
                                    "2", "--profile-batch", "2", "--adaptive-variant", "stay_margin=0.5,hold_steps=4",
                                    "--control", "--build-order", "reversed", "--out", str(out)])
        assert gc.get_freeze_count() > 0  # the heap frozen after the warm-up, as the services freeze theirs
    finally:
        gc.unfreeze()  # (this test process's heap is not a service's)
    assert report["gc_freeze"] == "on" and all(set(r["gc"]) == {"full_collections", "ms"} for r in report["throughput"])
    assert "=== eagle3 adaptive (limits chain:2), batch 2" in (tmp_path / "report.json.profile.txt").read_text()
    assert all(len(r["seconds_per_round"]) == 2 for r in report["throughput"])  # every engine ran twice
    assert all(len(r["prompt_steps_ms_per_round"]) == len(r["other_steps_ms_per_round"]) == 2
               and min(r["prompt_steps_per_round"]) >= 1 and min(r["other_steps_ms_per_round"]) > 0
               for r in report["throughput"])  # every round prefills its prompts, then decodes
    assert all(len(r["slowest_step_ms_per_round"]) == 2 and min(r["slowest_step_ms_per_round"]) > 0
               and r["allocator"]["num_alloc_retries"] == 0 for r in report["throughput"])
    assert all(("speedup_paired" in r) == ("speedup_best" in r) == (r["config"] != "target-only")
               for r in report["throughput"])
    configs = {(r["batch"], r["config"]) for r in report["throughput"]}
    assert configs == {(b, c) for b in (1, 2) for c in ("target-only", "eagle3 chain:2", "target-only (control)",
                                                         "eagle3 adaptive (limits chain:2)",
                                                         "eagle3 adaptive (stay_margin=0.5,hold_steps=4)")}
    # the default policy's decisions since start: at least those of its own rows (not a variant's)
    rows = [r["adaptive"]["decisions"] for r in report["throughput"] if r["config"] == "eagle3 adaptive (limits chain:2)"]
    assert all(report["adaptive_decisions"].get(k, 0) >= sum(r.get(k, 0) for r in rows) for d in rows for k in d)
    assert all(r["identical_outputs"] == r["prompts"] for r in report["throughput"])  # fp32: exact
    assert report["verify_cost"]["tokens"] == [1, 3] and report["hf"] == {"ran": False, "why": "--no-hf"}
    assert "eagle3 chain:2" in report["tau_per_depth"]
    assert report["build_order"] == ["eagle3 adaptive (stay_margin=0.5,hold_steps=4)", "eagle3 adaptive (limits chain:2)",
                                     "target-only (control)", "eagle3 chain:2", "target-only"]


SMALL_REPORT = {
    "kind": "speed_report", "model": "m", "device": "cpu", "dtype": "float32", "batches": [1, 4],
    "throughput": [{"batch": b, "config": c, "tokens_per_s": t, **({"speedup_vs_target": t / 10} if c != "base" else {})}
                   for b, c, t in ((1, "base", 10), (4, "base", 30), (1, "spec", 20), (4, "spec", 25))],
    "verify_cost": {"batches": [1, 4], "tokens": [1, 8], "contexts": [64, 256],
                    "ms": [[[1, 2], [3, 4]], [[2, 3], [4, 5]]]},
    "tau_per_depth": {"spec": {"tau": 2.1, "acceptance_per_depth": [0.6, 0.3, 0.2]}},
}


def test_plot_step_writes_the_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(SMALL_REPORT))
    files = plot.main([str(src)])
    assert sorted(p.name for p in files) == ["speedup_vs_batch.png", "tau_per_depth.png", "throughput_vs_batch.png",
                                             "verify_cost.png"]
    assert all(p.parent == tmp_path and p.read_bytes()[:4] == b"\x89PNG" for p in files)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(SystemExit, match="no plots for kind"):
        plot.main([str(bad)])


def test_row_breakdown_splits_each_round_by_kind_of_step(tmp_path):
    target_dir = make_model_dir(tmp_path / "t", "llama3", seed=5, std=0.3)
    head = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    out = tmp_path / "breakdown.json"
    report = row_breakdown.main(["--model", str(target_dir), "--head", str(head), "--tree", "chain:2", "--batch", "2",
                                 "--min-prompts", "2", "--max-tokens", "5", "--rounds", "2", "--fixed", "--profile",
                                 "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"target-only", "fixed tree", "adaptive"} and "policy" in rows["adaptive"]
    for row in rows.values():
        m = row["median_round"]
        steps_ms = sum(m[k]["ms"] for k in row_breakdown.KINDS)
        assert len(row["seconds_per_round"]) == 2 and m["tokens"] == 10  # two prompts, five tokens each
        assert abs(steps_ms + m["outside_steps_ms"] - m["seconds"] * 1e3) < 1e-6
        assert m["prefill"]["steps"] >= 1
    assert rows["target-only"]["median_round"]["draft_calls"]["calls"] == 0
    fixed = rows["fixed tree"]["median_round"]
    assert fixed["tree"]["steps"] + fixed["chained"]["steps"] >= 1 and fixed["draft_calls"]["calls"] >= 1
    assert "=== adaptive, batch 2" in (tmp_path / "breakdown.json.profile.txt").read_text()


def test_the_policy_replayed_at_batch_1_keeps_most_of_the_fixed_trees_gain_and_never_loses():
    """The recorded MT-bench trace (24 first turns, what every tree size accepted at each step) through
    the policy at batch 1, with the H100 step costs (``policy_replay.py``): after a warm pass its choices
    keep most of the fixed tree's speed-up (nearly all of it where a tree chosen inside a recorded step
    accepts what that step's did), and where nothing is ever accepted it decodes plainly, about as fast
    as target-only (the fixed tree: half as fast)."""
    trace = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "speculation" /
                        "policy_trace_mtbench24_fp32_cpu.json").read_text())
    costs = policy_replay.ReplayCosts()
    zero = {"sizes": trace["sizes"], "steps": [[s, [0.0] * len(a)] for s, a in trace["steps"][:400]]}
    for t, inside, least_of_fixed, least_of_target in ((trace, "passed", 0.88, 1.3), (trace, "whole", 0.95, 1.5),
                                                       (zero, "passed", 1.5, 0.94)):
        base, _ = policy_replay.replay(t, PolicyConfig(), "target", costs, 0, inside)
        fixed, _ = policy_replay.replay(t, PolicyConfig(), "fixed", costs, 0, inside)
        policy, kinds = policy_replay.replay(t, PolicyConfig(), "policy", costs, 1, inside)
        assert policy >= least_of_fixed * fixed and policy >= least_of_target * base, (fixed / base, policy / base, kinds)


def test_policy_host_cost_runs_small(tmp_path):
    out = tmp_path / "cost.json"
    rows = policy_host_cost.main(["--batch", "1", "--batch", "2", "--steps", "50", "--variant", "hold_steps=1",
                                  "--out", str(out)])
    assert [r["batch"] for r in rows] == [1, 2] and all(r["us_per_step"] > 0 for r in rows)
    assert all(sum(r["decisions"].values()) == 250 for r in rows)  # 200 warm steps, 50 timed: one decision each
    assert json.loads(out.read_text())["variant"] == "hold_steps=1"
    waves = policy_host_cost.main(["--wave", "--batch", "16", "--steps", "20"])
    assert [r["batch"] for r in waves] == [16] and waves[0]["detaches_us"] > 0 and waves[0]["trees_pay_us"] > 0


def test_trace_kernels_charges_the_span_once():
    from benchmarks.trace_kernels import critical_path
    events = [{"name": "a", "ts": 0.0, "dur": 10.0},
              {"name": "b", "ts": 6.0, "dur": 10.0},  # dependent launch: starts inside a, charged 10 -> 16
              {"name": "c", "ts": 7.0, "dur": 2.0},  # ends inside b: charged nothing
              {"name": "a", "ts": 20.0, "dur": 5.0}]  # 4 us idle before it
    totals, idle, span = critical_path(events)
    assert span == 25.0 and idle == 4.0
    assert {k: v[2] for k, v in totals.items()} == {"a": 15.0, "b": 6.0, "c": 0.0}
    assert totals["a"][:2] == [2, 15.0] and sum(v[2] for v in totals.values()) + idle == span


def test_batch_prompts_repeat_the_file_to_fill_the_batch(tmp_path):
    """A batch larger than the prompt file (128 against MT-bench's 80) still puts that many requests in
    flight: the prompts repeat in order."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(3)))
    assert speed_report.batch_prompts(str(path), 2) == (["q0", "q1"], 2)
    assert speed_report.batch_prompts(str(path), 7) == (["q0", "q1", "q2", "q0", "q1", "q2", "q0"], 3)


def test_the_policy_replay_reads_record_acceptances_path_ranks_for_its_own_sizes():
    """``policy_replay.load_trace`` on the shipped H200 trace (``record_acceptance.py``'s: path ranks):
    counts for the policy's sizes, the full tree's and the one-node tree's matching the trace's own
    per-size tau; the replay runs the policy on those sizes (a trace's sizes, not the module's default,
    index its counts) and keeps the fixed tree's speed-up where a tree chosen inside a recorded step
    accepts what that step's did. A size list that is not increasing up to the budget is refused."""
    path = Path(__file__).parent.parent / "benchmarks" / "results" / "acceptance_smollm2_mtbench80_h200.json"
    trace = policy_replay.load_trace(str(path))
    sizes = list(tree_sizes(policy_replay.LIMITS))
    assert trace["sizes"] == sizes and len(trace["steps"]) == 3830
    per_size = json.loads(path.read_text())["configs"]["dynamic:7:10:59"]["per_size"]
    for n in (1, 59):
        tau = 1 + np.mean([counts[sizes.index(n)] for _, counts in trace["steps"]])
        assert abs(tau - per_size["tau"][per_size["sizes"].index(n)]) < 1e-3, (n, tau)
    costs = policy_replay.ReplayCosts()
    fixed, _ = policy_replay.replay(trace, PolicyConfig(), "fixed", costs, 0, "whole")
    policy, kinds = policy_replay.replay(trace, PolicyConfig(), "policy", costs, 1, "whole")
    assert policy >= 0.95 * fixed, (policy / fixed, kinds)
    with pytest.raises(ValueError, match="increasing"):
        policy_replay.AdaptivePolicy(policy_replay.flat_table(), policy_replay.LIMITS, sizes=(1, 4, 2, 59))
    for sizes in ((1, 2, 32), ()):
        with pytest.raises(ValueError, match="budget"):
            policy_replay.AdaptivePolicy(policy_replay.flat_table(), policy_replay.LIMITS, sizes=sizes)
