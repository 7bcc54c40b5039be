"""Adaptive speculation: the policy's choices on hand-made costs and acceptance, the cost table, the
feed buffer, and end to end: greedy output equals target-only output whatever the policy picks."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from drafters import OracleDrafter
from link.protocol import DraftFeed
from runtime.tree import CandidateTree
from tiny_eagle import make_eagle_dir
from tiny_models import make_model_dir, target_for, tiny_config
from common.tree_settings import TREE_SIZES, tree_sizes
from verify_service.acceptance_estimate import accepted_within
from verify_service.adaptive import AdaptivePolicy, PolicyConfig, batch_key, policy_for, policy_variant
from verify_service.cost_table import CostGrid, CostTable, calibrate, interp1
from verify_service.engine import Engine
from verify_service.feed_buffer import FeedBuffer, FeedRows, StepRows
from verify_service.learned_costs import DraftCost, learned_at
from verify_service.realized_rates import MIN_STEPS, RealizedRates
from verify_service.step_costs import head_weight_fraction

PROMPTS = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]
TOKENS = (1, 2, 3, 4, 5, 6, 9, 17, 33, 60)


def table(per_token_ms: float, base_ms: float = 10.0, batches=(1, 64)) -> CostTable:
    """Forward = base + per_token * (tokens - 1) * batch: how much a tree's nodes cost."""
    ms = np.array([[[base_ms + per_token_ms * (q - 1) * b for q in TOKENS] for b in batches]])
    return CostTable(tuple(batches), TOKENS, (1024,), ms)


def chain(n: int) -> CandidateTree:
    return CandidateTree.chain(np.arange(n), log_probs=-np.arange(1, n + 1, dtype=np.float32))


def seen(policy: AdaptivePolicy, accepted: int, seq_id: int = 0, times: int = 100, nodes: int = 5) -> None:
    """``times`` verified chains of ``nodes`` nodes, each accepting its first ``accepted``."""
    for _ in range(times):
        policy.observe_tree(seq_id, chain(nodes), list(range(accepted)), nodes)


# --- the policy -----------------------------------------------------------------------------------

def test_the_best_nodes_of_a_tree_show_what_each_smaller_tree_accepts():
    #   root ─┬─ 0 (-0.1) ── 2 (-0.5) ── 4 (-0.7)        ranks by score: 0, 2, 4, 1, 3
    #         └─ 1 (-1.0) ── 3 (-2.0)
    tree = CandidateTree.from_lists([1, 2, 3, 4, 5], [-1, -1, 0, 1, 2],
                                    log_probs=np.array([-0.1, -1.0, -0.5, -2.0, -0.7], dtype=np.float32))
    assert accepted_within(tree, [0, 2, 4], [1, 2, 3, 4, 5, 8]).tolist() == [1, 2, 3, 3, 3, 3]
    assert accepted_within(tree, [1, 3], [1, 2, 3, 4, 5]).tolist() == [0, 0, 0, 1, 2]
    assert accepted_within(tree, [], [1, 5]).tolist() == [0, 0]


def test_capped_settings_keep_the_best_nodes_and_fewer_levels():
    dyn = TreeSettings("dynamic", 7, 10, 59)
    assert dyn.capped(59) == dyn and dyn.capped(100) == dyn
    assert dyn.capped(16) == TreeSettings("dynamic", 7, 10, 16)
    assert dyn.capped(4) == TreeSettings("dynamic", 4, 10, 4)
    assert TreeSettings("chain", 5).capped(2).depth == 2 and TreeSettings("chain", 5).capped(2).node_budget == 2
    assert TreeSettings("static", 3).capped(1) == TreeSettings("static", 3)
    assert tree_sizes(dyn, "powers") == (1, 2, 4, 8, 16, 32, 59)
    assert tree_sizes(dyn, "tiles") == (1, 3, 7, 15, 31, 59)
    assert tree_sizes(dyn) == tree_sizes(dyn, TREE_SIZES)  # 2, 4, ... 32 query tokens with the root
    assert tree_sizes(TreeSettings("chain", 3)) == (1, 2, 3)
    assert tree_sizes(TreeSettings("static", 5, 10, 20)) == (20,)


def test_tree_levels_cut_the_small_dynamic_trees_below_the_budget(monkeypatch):
    """``EAGLE3_TREE_LEVELS`` (off by default): a dynamic tree of a size below the budget grows at most
    the levels of the least entry that holds it; the budget's tree, chains and static trees do not
    change; the policy prices and credits the cut sizes with their levels."""
    from common import tree_settings

    assert tree_settings.TREE_LEVELS == () and tree_settings.level_cap(7) is None  # (the default: off)
    assert tree_settings.parse_tree_levels(" 15:5,7:4 ") == ((7, 4), (15, 5)) and tree_settings.parse_tree_levels("") == ()
    for bad in ("7", "7:0", "x:4", "7:4;15:5", "-3:2"):
        with pytest.raises(ValueError, match="SIZE:LEVELS"):
            tree_settings.parse_tree_levels(bad)
    monkeypatch.setattr(tree_settings, "TREE_LEVELS", ((7, 4), (15, 5)))
    dyn = TreeSettings("dynamic", 7, 10, 59)
    assert [dyn.capped(n).depth for n in (1, 3, 5, 7, 8, 15, 16, 31)] == [1, 3, 4, 4, 5, 5, 7, 7]
    assert dyn.capped(59) == dyn and TreeSettings("chain", 9).capped(7).depth == 7
    policy = AdaptivePolicy(table(1.0), dyn)
    assert policy._levels.tolist() == [1, 3, 4, 5, 7, 7]  # sizes 1, 3, 7, 15, 31, 59
    deep = chain(59)  # a verified chain of 59 accepting its first 6: sizes 7 and 15 hold 4 and 5 of them
    assert accepted_within(deep, list(range(6)), [1, 3, 7, 15, 31], policy._levels[:5]).tolist() == [1, 3, 4, 5, 6]
    assert accepted_within(deep, list(range(6)), [1, 3, 7, 15, 31]).tolist() == [1, 3, 6, 6, 6]
    credited = []  # what the policy learns from that tree for each of its sizes
    policy.observe_accepted = lambda seq_id, acc, nodes: credited.append(acc.tolist())
    policy.observe_tree(0, deep, list(range(6)), 59)
    assert credited == [[1, 3, 4, 5, 6, 6]]


def test_plain_decoding_where_trees_cost_more_than_they_bring():
    policy = AdaptivePolicy(table(per_token_ms=0.05), TreeSettings("chain", 5), PolicyConfig(probe_every=0))
    seen(policy, accepted=1)  # tau 2
    # batch 1: five nodes cost 0.25 ms on 10: speculation pays
    assert policy.best(1, 1024, [0], [5]) > 0
    # batch 64: every node of every sequence costs 0.05 ms (a 2-node tree: +6.4 ms on 10), tau 2 cannot pay
    # for a tree beyond one node, and not even one node when the forward doubles per node
    ids = list(range(64))
    policy64 = AdaptivePolicy(table(per_token_ms=0.2), TreeSettings("chain", 5), PolicyConfig(probe_every=0))
    for i in ids:
        seen(policy64, accepted=1, seq_id=i, times=20)
    assert policy64.best(64, 1024, ids, [5] * 64) == 0


def test_bigger_trees_when_acceptance_is_high_smaller_when_low():
    limits = TreeSettings("chain", 5)
    high = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0))
    seen(high, accepted=5)
    assert high.best(1, 1024, [0], [5]) == 5
    low = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0))
    seen(low, accepted=1)
    assert low.best(1, 1024, [0], [5]) == 1
    none = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0))
    seen(none, accepted=0)
    assert none.best(1, 1024, [0], [5]) == 0
    # a request's own smaller tree caps what it may gain
    assert high.expected_accepted(0, 5) == pytest.approx(5, abs=1e-3)
    assert high.expected_tokens(1, [0], [2], 5) == pytest.approx(1 + 2, abs=1e-3)


def test_each_sequence_keeps_its_own_acceptance():
    policy = AdaptivePolicy(table(per_token_ms=1.0), TreeSettings("chain", 5), PolicyConfig(probe_every=0))
    seen(policy, accepted=5, seq_id=1)
    seen(policy, accepted=0, seq_id=2)
    assert policy.best(1, 1024, [1], [5]) == 5 and policy.best(1, 1024, [2], [5]) == 0
    policy.release(1)
    assert policy.expected_accepted(1, 5) == policy.expected_accepted(99, 5)  # back to the global prior


def test_on_trees_the_batch_pays_for_a_sequences_dip_leaves_them_only_by_the_stay_margin():
    """A sequence whose own estimate dips just below break-even (a hard passage) while the global
    estimate picks trees: from trees, the policy stays on them (``stay_margin``); from plain decoding,
    or with the margin off, it decodes plainly; where the global estimate says plain decoding too, it
    leaves trees at once."""
    limits = TreeSettings("chain", 5)

    def policy(stay: float, dip: int) -> AdaptivePolicy:
        p = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0, stay_margin=stay))
        seen(p, accepted=4, seq_id=1, times=100)  # the batch's trees pay
        seen(p, accepted=0, seq_id=2, times=dip)  # this sequence: trees that accepted nothing
        return p

    dip = next(k for k in range(1, 60) if policy(0.0, k).best(1, 1024, [2], [5]) == 0)  # just below break-even
    stays_on_trees_only_by_the_margin(policy, 0.2, dip, seq_id=2)
    low = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0, stay_margin=0.2))
    seen(low, accepted=0, seq_id=1, times=100)  # the global estimate: trees do not pay, by far
    low.choice = 5
    assert low.best(1, 1024, [1], [5]) == 0


def test_on_trees_the_global_estimate_picks_no_more_plain_decoding_leaves_them_only_by_stay_global():
    """Where the global estimate too dips just below break-even, the policy on trees stays on them
    unless plain decoding wins by ``stay_global`` (each switch costs a step not launched ahead, one not
    chained and the draft's catch-up); with it off it leaves at once, as it does from plain decoding."""
    limits = TreeSettings("chain", 5)

    def policy(stay_global: float, dip: int) -> AdaptivePolicy:
        p = AdaptivePolicy(table(per_token_ms=1.0), limits, PolicyConfig(probe_every=0, stay_global=stay_global))
        seen(p, accepted=1, seq_id=1, times=40)
        seen(p, accepted=0, seq_id=1, times=dip)  # the global estimate follows it down
        return p

    # just below break-even for the global estimate (sequence 2, with no trees of its own, is priced on it)
    dip = next(k for k in range(1, 400) if policy(0.0, k)._global_pick(1, 1024, 1)[0] == 0)
    stays_on_trees_only_by_the_margin(policy, 0.1, dip, seq_id=2)


def stays_on_trees_only_by_the_margin(policy, margin: float, dip: int, seq_id: int) -> None:
    """``policy(margin, dip)``: a chain-of-5 policy whose estimate for ``seq_id`` dipped just below
    break-even. From plain decoding it decodes plainly; from trees it stays on them with ``margin``,
    and leaves them with none."""
    on_trees = policy(margin, dip)
    assert on_trees.best(1, 1024, [seq_id], [5]) == 0  # from plain decoding: no margin to stay by
    on_trees.choice = 5
    assert on_trees.best(1, 1024, [seq_id], [5]) > 0
    off = policy(0.0, dip)
    off.choice = 5
    assert off.best(1, 1024, [seq_id], [5]) == 0


def test_above_its_own_sizes_a_sequence_follows_the_global_gains():
    """A sequence that only saw small trees, accepting all of them, against global trees of every size
    that gain little past 2 nodes: its guess for the larger sizes is its own at 2 plus the global gain
    from 2 (not its steep gain per node carried on), so the large tree is not chosen; where nobody saw
    larger trees, the optimistic guess stays."""
    limits = TreeSettings("chain", 8)
    own_only = PolicyConfig(probe_every=0, seq_shrink=0.0)  # a sequence's own estimate, not pulled to the batch's
    policy = AdaptivePolicy(table(per_token_ms=0.5), limits, own_only)
    seen(policy, accepted=2, seq_id=1, nodes=8)  # the batch's large trees: 2 of 8 nodes accepted
    seen(policy, accepted=2, seq_id=2, nodes=2)  # this sequence: trees of 2, both nodes accepted
    assert policy._global.trusted_reach() == 7
    own = policy.expected_accepted(2, 2)
    assert own == pytest.approx(2.0, abs=1e-3)
    for m in (4, 8):
        assert policy.expected_accepted(2, m) == pytest.approx(own + policy.expected_accepted(1, m)
                                                               - policy.expected_accepted(1, 2), abs=1e-3)
    assert policy.expected_accepted(2, 8) < 2.5
    alone = AdaptivePolicy(table(per_token_ms=0.5), limits, own_only)
    seen(alone, accepted=2, seq_id=2, nodes=2)  # no larger tree seen anywhere: 1 node per node carried on
    assert alone.expected_accepted(2, 8) == pytest.approx(8.0, abs=1e-3)
    # One unlucky large tree somewhere (nothing accepted) is no ground yet: the guess stays optimistic,
    # or a plain-decoding batch whose probes try the smallest tree would never try a large one again.
    seen(alone, accepted=0, seq_id=3, nodes=8, times=1)
    assert alone._global.trusted_reach() == 1
    assert alone.expected_accepted(2, 8) == pytest.approx(8.0, abs=1e-3)


def test_a_sequences_estimate_is_pulled_toward_the_batchs():
    """One tree that accepted nothing does not send a sequence to plain decoding while the batch's
    trees accept well: its estimate is its own mean pulled toward the batch's, which weighs as much
    as ``seq_shrink`` of its trees. A sequence that keeps accepting nothing gets there (its own trees
    outweigh the pull, up to the running mean's worth of trees); without the pull one tree decides."""
    limits, cfg = TreeSettings("chain", 4), PolicyConfig(probe_every=0, draft_prior_fraction=0.0)
    policy = AdaptivePolicy(table(per_token_ms=1.0), limits, cfg)
    seen(policy, accepted=4, seq_id=1, nodes=4)  # the batch's trees: every node accepted
    seen(policy, accepted=0, seq_id=2, nodes=4, times=1)

    def batch():  # the global estimate at 4 nodes (every tree of every sequence moves it)
        return policy._global.curve(policy.sizes, policy._levels)[-1]
    assert policy.expected_accepted(2, 4) == pytest.approx(cfg.seq_shrink * batch() / (1 + cfg.seq_shrink), abs=1e-3)
    assert policy.best(1, 1024, [2], [4]) == 4
    seen(policy, accepted=0, seq_id=2, nodes=4, times=60)
    most = (2 - cfg.seq_weight) / cfg.seq_weight  # trees a running mean holds
    assert policy.expected_accepted(2, 4) == pytest.approx(cfg.seq_shrink * batch() / (most + cfg.seq_shrink),
                                                           abs=1e-3)
    assert policy.best(1, 1024, [2], [4]) == 0
    alone = AdaptivePolicy(table(per_token_ms=1.0), limits, dataclasses.replace(cfg, seq_shrink=0.0))
    seen(alone, accepted=4, seq_id=1, nodes=4)
    seen(alone, accepted=0, seq_id=2, nodes=4, times=1)
    assert alone.expected_accepted(2, 4) == 0.0 and alone.best(1, 1024, [2], [4]) == 0


def test_measured_draft_and_step_costs_change_the_choice():
    policy = AdaptivePolicy(table(per_token_ms=0.1), TreeSettings("chain", 3), PolicyConfig(probe_every=0,
                                                                                         cost_weight=1.0))
    seen(policy, accepted=3, nodes=3)
    assert policy.best(1, 1024, [0], [3]) == 3
    for _ in range(3):  # a stall (50 ms a level, 1,000x the prior): not the draft's cost
        policy.observe_draft(1, 3, 200.0)
        assert policy.best(1, 1024, [0], [3]) == 3
    assert policy.outliers == 3
    policy.observe_draft(1, 3, 200.0)  # the fourth in a row: the draft turns out slow
    assert policy.best(1, 1024, [0], [3]) == 0
    policy.observe_draft(1, 3, 0.4)
    policy.observe_step(1, 3, 1024, 500.0)  # tree steps cost far more than the table says
    assert policy.best(1, 1024, [0], [3]) == 0
    policy.observe_step(1, 3, 1024, 10.2)
    assert policy.best(1, 1024, [0], [3]) == 3


def test_probes_from_plain_decoding_alternate_the_smallest_and_the_largest_tree():
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=4, probe_share=1.0))
    seen(policy, accepted=0)
    choices = [policy.choose(1, 1024, [0], [4]) for _ in range(8)]
    assert choices == [0, 0, 0, 1, 0, 0, 0, 4]
    assert policy.decisions == {0: 6, 1: 1, 4: 1} and policy.choice == 4 and policy.probes == 2


def test_a_global_estimate_early_trees_put_low_comes_back_through_probes_of_the_largest_tree():
    """Early trees that accepted nothing put every size's estimate low, the batch's too: plain decoding.
    Then every tree accepts whole. Probes of the smallest tree alone bring back only its own size (the
    largest stays priced at what the smallest accepts, and plain decoding stays); every other probe
    is the largest tree, whose estimate then climbs back until the largest tree is chosen again."""
    policy = AdaptivePolicy(table(per_token_ms=0.1), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=8, probe_share=1.0, draft_prior_fraction=0.0))
    for levels in (1, 2, 4) * 4:  # the draft: 12 ms a call whatever its depth (a tree of 1 never pays)
        policy.observe_draft(1, levels, 12.0)
    seen(policy, accepted=0, seq_id=1, nodes=4, times=200)  # released: the global estimate keeps them
    policy.release(1)
    choices = []
    for i in range(600):
        seq = 10 + i // 50  # a new sequence every 50 decisions, none with trees of its own at first
        if choices and choices[-1] == 0 and i % 50 == 0:
            policy.release(seq - 1)
        choice = policy.choose(1, 1024, [seq], [4])
        choices.append(choice)
        if choice:
            policy.observe_tree(seq, chain(choice), list(range(choice)), choice)  # accepted whole
    assert choices[:8] == [0] * 7 + [1]
    assert choices[-50:].count(4) >= 45, choices[-50:]


def test_probes_stay_within_their_share_of_the_time():
    """A probe costs a 20 ms step against 10 ms plain ones: with a 10% share, the first probe waits
    until the plain steps' time covers it (decision 9, not 3), and each later one as long again."""
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=4, probe_share=0.1, draft_prior_fraction=0.0))
    seen(policy, accepted=0)
    choices = [policy.choose(1, 1024, [0], [4]) for _ in range(40)]
    probes = [i for i, c in enumerate(choices) if c]
    assert probes == [9, 18, 27, 36], probes
    diag = policy.diagnostics()
    assert policy.probes == len(probes) and diag["probes"] == len(probes)
    assert 0 < diag["probe_share_modelled"] <= 0.1


def test_a_probe_from_plain_decoding_tries_the_size_the_global_estimate_picks():
    """A sequence whose own trees accepted nothing decodes plainly; its probes try the size the batch's
    trees show pays (the largest here), which alone can bring its estimate of that size back: a probe
    of the smallest tree updates no larger size. Where the batch's trees pay, such probes come four
    times as often, and cost only what they take beyond plain decoding's time for the tokens the
    global estimate expects of them (nothing here: a tight budget does not hold them back). Where the
    global estimate says plain decoding too, the probe is the smallest tree, at the usual period."""
    policy = AdaptivePolicy(table(per_token_ms=1.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=8, probe_share=0.001, draft_prior_fraction=0.0, seq_shrink=0.0))
    seen(policy, accepted=4, seq_id=1, nodes=4)  # the batch's trees: every node accepted
    seen(policy, accepted=0, seq_id=2, nodes=4, times=5)  # this sequence's: nothing
    choices = [policy.choose(1, 1024, [2], [4]) for _ in range(8)]
    assert choices == [0, 4, 0, 4, 0, 4, 0, 4]
    low = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                         PolicyConfig(probe_every=4, probe_share=1.0, draft_prior_fraction=0.0))
    seen(low, accepted=0, seq_id=1, nodes=4)
    assert [low.choose(1, 1024, [1], [4]) for _ in range(4)] == [0, 0, 0, 1]


def test_the_probes_budget_counts_recent_steps_not_the_time_since_start():
    """A long stretch at batch 1 where the largest tree is best (no probes) leaves no slack to batch 64,
    where a probe's tree step costs 74 ms against 10 ms plain ones: its probes stay within their share
    of its own time (counted since start, the stretch would fund a probe at every 4th decision)."""
    policy = AdaptivePolicy(table(per_token_ms=1.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=4, probe_share=0.1, probe_window=64, draft_prior_fraction=0.0))
    seen(policy, accepted=4, seq_id=1, nodes=4)  # every node accepted: the 4-node chain pays at batch 1
    assert {policy.choose(1, 1024, [1], [4]) for _ in range(2000)} == {4}
    choices = [policy.choose(64, 1024, [1], [4]) for _ in range(400)]
    probes = [i for i, c in enumerate(choices) if c]
    assert 1 <= len(probes) <= 8, probes  # 64 ms extra per 576 ms of plain steps: ~6 in 400 decisions


def test_a_probe_from_plain_decoding_pays_for_the_rows_the_draft_must_catch_up():
    """Leaving plain decoding, the draft first extends every row the plain steps left it (its cost
    learned per row from such calls): with thousands waiting, that alone exceeds the probes' share and
    the probe waits; with none waiting, the same probe runs."""
    def probes(backlog_rows: int) -> list[int]:
        policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                                PolicyConfig(probe_every=4, probe_share=0.1, draft_prior_fraction=0.01))
        seen(policy, accepted=0)
        policy.observe_draft(1, 4, 1.0)  # a call for trees alone ...
        policy.observe_draft(1, 4, 51.0, backlog=1000)  # ... and one that first caught up 1,000 rows
        assert policy.diagnostics()["backlog_row_us"] == pytest.approx(50.0)
        policy.backlog_rows = backlog_rows
        return [i for i in range(40) if policy.choose(1, 1024, [0], [4])]
    assert probes(0) and not probes(5000)


def test_leaving_plain_decoding_pays_for_the_rows_the_draft_must_catch_up():
    """A tree after plain steps first extends the rows they left the draft: spread over the steps a
    decision holds, a large backlog outweighs a small gain; a few rows do not."""
    policy = AdaptivePolicy(table(per_token_ms=0.1), TreeSettings("chain", 3), PolicyConfig(probe_every=0))
    seen(policy, accepted=1, nodes=3)
    assert policy.best(1, 1024, [0], [3]) > 0
    policy.observe_draft(1, 3, 106.0, backlog=1000)  # 6 ms of trees (the prior), 0.1 ms a row caught up
    policy.backlog_rows = 1000
    assert policy.best(1, 1024, [0], [3]) == 0  # 100 ms over a hold of 8 steps: 12.5 ms a step
    policy.backlog_rows = 10
    assert policy.best(1, 1024, [0], [3]) > 0


def test_a_probe_the_budget_holds_back_leaves_plain_decoding_held():
    """Where the probes' budget holds a due probe back, plain decoding stays held between attempts (a
    quarter of ``probe_every`` apart): the whole decision is not taken again at every step."""
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=32, probe_share=0.001, hold_steps=8, draft_prior_fraction=0.0))
    seen(policy, accepted=0)
    full = 0
    for _ in range(400):
        if not policy.choose_held((1, 1)):
            full += 1
            assert policy.choose(1, 1024, [0], [4], quick_key=(1, 1)) == 0
    assert policy.decisions == {0: 400} and full <= 400 // 8 + 400 // 8, full


def test_a_decision_is_held_while_nothing_it_rests_on_changes():
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=0, hold_steps=8))
    seen(policy, accepted=0)
    calls = []
    best = policy.best
    policy.best = lambda *a: calls.append(a) or best(*a)
    for _ in range(10):
        policy.choose(1, 1024, [0], [4])
    assert len(calls) == 2  # computed, held 8 steps, computed again
    policy.observe_step(1, 0, 1024, 10.0)  # a step's time alone does not end the hold
    policy.choose(1, 1024, [0], [4])
    assert len(calls) == 2
    policy.observe_tree(0, chain(4), [0, 1, 2, 3], 4)  # what a tree accepted does
    policy.choose(1, 1024, [0], [4])
    assert len(calls) == 3
    policy.choose(2, 1024, [0, 1], [4, 4])  # and so does another batch
    assert len(calls) == 4


def test_a_held_plain_decision_is_repeated_without_looking_at_the_sequences():
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=0, hold_steps=4))
    seen(policy, accepted=0)
    assert not policy.choose_held((1, 1))  # nothing decided yet
    assert policy.choose(1, 1024, [0], [4], quick_key=(1, 1)) == 0 and not policy.last_held
    assert [policy.choose_held((1, 1)) for _ in range(4)] == [True, True, True, False]  # held 4 decisions in all
    assert policy.last_held and policy.decisions[0] == 4
    policy.choose(1, 1024, [0], [4], quick_key=(1, 1))
    assert not policy.choose_held((2, 1))  # another batch: look again
    policy.observe_tree(0, chain(4), [0, 1, 2, 3], 4)  # something learned: look again
    assert not policy.choose_held((1, 1))
    probing = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                             PolicyConfig(probe_every=3, hold_steps=8, probe_share=1.0))
    seen(probing, accepted=0)
    assert probing.choose(1, 1024, [0], [4], quick_key=(1, 1)) == 0
    assert [probing.choose_held((1, 1)) for _ in range(2)] == [True, False]  # a probe is due: choose
    assert probing.choose(1, 1024, [0], [4], quick_key=(1, 1)) > 0 and probing.probes == 1


def test_an_unseen_batch_takes_the_nearest_learned_costs_scaled_with_the_batch():
    assert learned_at({}, 8) is None
    assert learned_at({64: 2.0, 4: 1.0}, 128) == pytest.approx(2.0 * 2 ** 0.5)  # larger: the nearest (64), x sqrt(2)
    assert learned_at({64: 2.0, 4: 1.0}, 8) == pytest.approx(2 ** 0.5)  # between: the nearest in powers of two (4)
    assert learned_at({64: 2.0}, 16) == 2.0  # smaller: as costly as the nearest, not less
    assert learned_at({64: -0.5}, 128) == -0.5  # a negative residual is not scaled
    policy = AdaptivePolicy(table(per_token_ms=1.0), TreeSettings("chain", 3), PolicyConfig(probe_every=0))
    policy.observe_draft(64, 3, 8.0)  # 2 ms a level at 64 sequences
    assert policy.draft_ms(128, 3, 1024) == pytest.approx(8.0 * 2 ** 0.5)  # 4 levels at 2.8 ms, not the prior
    # A plain step's residual is the step's, not the sequences': taken flat to a larger batch (scaled,
    # plain decoding there would look dearer than it is, and trees cheaper by comparison).
    policy = AdaptivePolicy(table(per_token_ms=1.0), TreeSettings("chain", 3), PolicyConfig(probe_every=0,
                                                                                         cost_weight=1.0))
    policy.observe_step(1, 0, 1024, 10.5)  # plain: 0.5 ms beyond the forward
    policy.observe_step(1, 3, 1024, 13.5)  # a tree step: 0.5 ms beyond its forward of 13 ms
    assert policy.step_ms(16, 1024, 0, 16) == pytest.approx(10.0 + 0.5)
    assert policy.costs.verify_ms(16, 4, 1024) == pytest.approx(10.0 + 3 * 16 + 0.5 * 4)


def test_the_draft_cost_has_a_fixed_part_and_a_part_per_level():
    cost = DraftCost(weight=0.5)
    cost.update(2, 2.4)  # one depth seen: the prior's slope through it
    assert cost.fit(0.1) == pytest.approx((2.2, 0.1)) and cost.predict(8, 0.1) == pytest.approx(3.0)
    for _ in range(40):
        cost.update(2, 2.4)
        cost.update(8, 3.6)
    fixed, per_level = cost.fit(0.1)  # two depths: the line through them, the prior unused
    assert fixed == pytest.approx(2.0, abs=0.02) and per_level == pytest.approx(0.2, abs=0.005)
    steep = DraftCost(1.0)
    steep.update(4, 1.0)
    assert steep.fit(5.0) == (0.0, 0.25)  # a prior steeper than the observation: no negative fixed part
    # The policy: one shallow tree measured no longer makes a deep one look proportionally dear.
    policy = AdaptivePolicy(table(per_token_ms=1.0, base_ms=1.0), TreeSettings("dynamic", 7, 10, 59),
                            PolicyConfig(probe_every=0))
    policy.observe_draft(1, 1, 2.4)  # a 1-node tree: 2 levels, 2.4 ms
    prior = 0.15 * 1.0  # draft_prior_fraction x the table's decode forward
    assert policy.draft_ms(1, 7, 1024) == pytest.approx(2.4 + 6 * prior)  # 3.3 ms, not 4 x 2.4


def test_the_drafts_prior_cost_can_follow_the_heads_weights_over_the_targets():
    """``draft_prior_geometry``: the draft's prior cost a level is a decode forward's times an EAGLE-3
    head's weights over the target's (from the cost table's geometry), where a constant share of the
    forward priced the 8B's draft at 3x what it took; a table without the geometry keeps the constant."""
    smollm2 = {"layers": 30, "hidden_size": 576, "vocab_size": 49152}
    llama8b = {"layers": 32, "hidden_size": 4096, "vocab_size": 128256}
    assert head_weight_fraction(smollm2) == pytest.approx(0.158, abs=1e-3)
    assert head_weight_fraction(llama8b) == pytest.approx(0.055, abs=1e-3)
    assert head_weight_fraction({"layers": 30}) is None and head_weight_fraction({**smollm2, "hidden_size": 0}) is None
    limits = TreeSettings("dynamic", 7, 10, 59)
    for meta, share in ((llama8b, head_weight_fraction(llama8b)), ({}, 0.15)):
        t = dataclasses.replace(table(per_token_ms=1.0, base_ms=2.0), meta=meta)
        policy = AdaptivePolicy(t, limits, PolicyConfig(probe_every=0, draft_prior_geometry=1))
        assert policy.draft_ms(1, 7, 1024) == pytest.approx(share * 2.0 * 8)  # 1 + 7 levels of a 2 ms forward
    t = dataclasses.replace(table(per_token_ms=1.0, base_ms=2.0), meta=llama8b)
    assert AdaptivePolicy(t, limits, PolicyConfig(probe_every=0)).draft_ms(1, 7, 1024) == pytest.approx(0.15 * 16)
    assert policy_variant("draft_prior_geometry=1").draft_prior_geometry == 1


# --- the cost table -------------------------------------------------------------------------------

def test_cost_table_interpolates_extrapolates_and_round_trips(tmp_path):
    assert interp1([1, 3], [10, 30], 2) == 20 and interp1([1, 3], [10, 30], 5) == 50 and interp1([4], [7], 9) == 7
    ms = np.array([[[1.0, 2.0], [3.0, 6.0]], [[2.0, 4.0], [6.0, 12.0]]])  # contexts 100, 200; batches 1, 3
    t = CostTable((1, 3), (1, 5), (100, 200), ms, {"device": "cpu"})
    assert t.forward_ms(1, 1, 100) == 1.0
    assert t.forward_ms(2, 3, 100) == pytest.approx(3.0)  # (1.5 + 4.5) / 2
    assert t.forward_ms(1, 1, 300) == pytest.approx(3.0)  # context extrapolated linearly
    t.save(tmp_path / "t.json")
    back = CostTable.load(tmp_path / "t.json")
    assert back.to_json() == t.to_json() and back.forward_ms(2, 3, 150) == t.forward_ms(2, 3, 150)


def test_calibration_times_the_runner_without_touching_live_blocks(tmp_path):
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3))
    t = calibrate(target, CostGrid((1, 2), (1, 3), (16, 100000), reps=1, warmup=1))
    assert t.contexts == (16,)  # 100000 does not fit the model's context: dropped
    assert t.ms.shape == (1, 2, 2) and (t.ms > 0).all()
    assert target.blocks.num_used_blocks == 0 and t.meta["kernels"] == target.runner.kernels.name


def test_policy_for_reads_a_matching_table_and_measures_again_otherwise(tmp_path, monkeypatch):
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3))
    path = tmp_path / "costs.json"
    first = policy_for(target, TreeSettings("chain", 2), str(path))
    assert path.is_file() and first.table.tokens == (1, 2, 3)
    saved = json.loads(path.read_text())
    saved["ms"] = [[[7.0] * 3] * len(saved["batches"])]
    path.write_text(json.dumps(saved))
    assert policy_for(target, TreeSettings("chain", 2), str(path)).table.forward_ms(1, 1, 64) == 7.0
    saved["meta"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(saved))
    assert policy_for(target, TreeSettings("chain", 2), str(path)).table.meta["dtype"] == "float32"


# --- the feed buffer ------------------------------------------------------------------------------

def feed(seq_id: int, start: int, n: int) -> DraftFeed:
    return DraftFeed(seq_id, start, torch.full((n, 2), float(start)), np.arange(start, start + n))


def test_feed_buffer_merges_rows_per_sequence_and_flushes_before_overflowing():
    buf = FeedBuffer(max_rows=6)
    assert buf.add([feed(1, 0, 3), feed(2, 0, 1)]) == []
    assert buf.add([feed(1, 3, 1)]) == [] and buf.rows == 5
    flushed = buf.add([feed(1, 4, 2)])  # 7 rows would not fit one call: the first 5 go now
    assert [(f.seq_id, f.start, len(f.next_tokens)) for f in flushed] == [(1, 0, 4), (2, 0, 1)]
    assert flushed[0].features[:, 0].tolist() == [0, 0, 0, 3] and flushed[0].next_tokens.tolist() == [0, 1, 2, 3]
    buf.add([feed(2, 1, 1)])
    buf.drop(2)
    assert [(f.seq_id, f.start) for f in buf.take()] == [(1, 4)] and buf.rows == 0
    buf.add([feed(3, 0, 1)]), buf.add([feed(3, 2, 1)])
    with pytest.raises(AssertionError, match="in order"):  # a gap
        buf.take()


def test_feed_buffer_holds_up_to_its_capacity_and_splits_into_calls_of_max_rows():
    buf = FeedBuffer(max_rows=4, capacity=10)
    assert buf.add([feed(1, 0, 6), feed(2, 0, 3)]) == [] and buf.rows == 9
    calls = buf.split(buf.take())
    assert [[(f.seq_id, f.start, len(f.next_tokens)) for f in c] for c in calls] == \
        [[(1, 0, 4)], [(1, 4, 2), (2, 0, 2)], [(2, 2, 1)]]
    assert calls[1][0].features[:, 0].tolist() == [0, 0] and calls[1][0].next_tokens.tolist() == [4, 5]
    assert buf.add([feed(1, 6, 4)]) == [] and buf.add([feed(1, 10, 4)]) == []
    assert [(f.seq_id, f.start, len(f.features)) for f in buf.add([feed(1, 14, 4)])] == [(1, 6, 8)]  # 12 > 10
    assert buf.rows == 4
    assert buf.split([]) == []


def test_feed_buffer_takes_batched_rows_merged_per_sequence_in_order():
    buf = FeedBuffer(max_rows=64)
    step = lambda ids, starts: FeedRows(np.array(ids), np.array(starts), torch.tensor(starts, dtype=torch.float32)[:, None].expand(-1, 2),
                                        np.array(starts) + 100)
    buf.add([feed(7, 0, 2), step([5, 9], [3, 0])])  # a prefill chunk of 7, decodes of 5 and 9
    buf.add([step([9, 7, 5], [1, 2, 4])])
    buf.add([step([7, 5], [3, 5])])
    buf.drop(9)
    assert buf.rows == 7
    got = [(f.seq_id, f.start, f.features[:, 0].tolist(), f.next_tokens.tolist()) for f in buf.take()]
    assert got == [(5, 3, [3, 4, 5], [103, 104, 105]), (7, 0, [0, 0, 2, 3], [0, 1, 102, 103])]  # feed(): features = start
    assert buf.rows == 0 and buf.take() == []
    buf.add([step([5, 9], [6, 1])])
    buf.drop(5), buf.drop(9)
    assert buf.rows == 0 and buf._parts == []  # all dropped: the features are let go at once
    buf.add([step([5, 5], [7, 7])])  # a row twice
    with pytest.raises(AssertionError, match="in order"):
        buf.take()


def test_feed_buffer_sends_the_rows_of_a_sequence_that_left_the_draft_and_came_back():
    """A sequence that leaves the draft (``DraftCoordinator._leave``) has its waiting rows dropped; when
    it takes the draft up again it is fed from its first position under the same id: those rows are
    sent, the dropped ones not (counted as waiting only once it is back)."""
    buf = FeedBuffer(max_rows=64)
    step = lambda ids, starts: FeedRows(np.array(ids), np.array(starts), torch.tensor(starts, dtype=torch.float32)[:, None].expand(-1, 2),
                                        np.array(starts) + 100)
    buf.add([step([5, 9], [0, 0])])
    buf.add([step([5, 9], [1, 1])])
    buf.drop(9)  # left the draft: 5's rows still wait
    assert buf.rows == 2 and buf.waiting(9) == 0
    buf.add([step([5], [2]), feed(9, 0, 3)])  # back: every position again, from the first
    assert buf.rows == 6 and buf.waiting(9) == 3
    buf.drop(9), buf.add([feed(9, 0, 2)])  # left and came back once more before a take
    got = [(f.seq_id, f.start, f.features[:, 0].tolist(), f.next_tokens.tolist()) for f in buf.take()]
    assert got == [(5, 0, [0, 1, 2], [100, 101, 102]), (9, 0, [0, 0], [0, 1])]


def test_feed_buffer_counts_a_stretch_of_the_same_plain_decodes_as_one_run():
    buf = FeedBuffer(max_rows=8, capacity=1000)
    step = lambda ids, start: FeedRows(list(ids), [start] * len(ids), torch.full((len(ids), 2), float(start)),
                                       [start + 100] * len(ids))
    for s in range(5):  # five plain steps of the same three sequences (a new list each step, as the engine's)
        buf.add([step([1, 2, 3], s)])
    assert len(buf._uncounted) == 1 and buf._uncounted[0][1] == 5
    buf.add([step([1, 3], 5)])  # 2 finished: another run starts
    buf.add([step([1, 3], 6)])
    assert [times for _, times in buf._uncounted] == [5, 2]
    assert (buf.waiting(1), buf.waiting(2), buf.waiting(3)) == (7, 5, 7)
    buf.drop(2)
    assert buf.rows == 14
    buf.add([step([1, 3], 7), feed(4, 0, 3)])  # a prefill chunk's rows beside them
    buf.drop(3)
    assert buf.rows == 8 + 3 and buf.waiting(4) == 3
    got = [(f.seq_id, f.start, len(f.next_tokens)) for f in buf.take()]
    assert got == [(1, 0, 8), (4, 0, 3)]


def test_a_steps_plain_rows_pair_each_position_with_its_features_and_the_token_after_it():
    captured = torch.arange(12, dtype=torch.float32)[:, None].expand(-1, 2)  # row r's features: r
    qsl = [0, 5, 6, 9, 10, 12]  # chunks: a prompt chunk of 5, a decode, a chunk of 3, a decode, a chunk of 2
    rows = StepRows()
    rows.add_one(3, 30, 17, 901)  # committed in the second pass, after the chunks still prefilling
    rows.add(0, 10, 4, [5, 6, 7, 8, 9])  # positions 4..8, a prompt with more to come
    rows.add(2, 20, 0, [1, 2, 777])  # a prompt's last chunk: its last position before the sampled token
    rows.add_one(1, 40, 6, 902)
    got = rows.build(captured, qsl)
    assert got.seq_ids.tolist() == [10] * 5 + [40] + [20] * 3 + [30]
    assert got.starts.tolist() == [4, 5, 6, 7, 8, 6, 0, 1, 2, 17]
    assert got.features[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert got.next_tokens.tolist() == [5, 6, 7, 8, 9, 902, 1, 2, 777, 901]
    decodes = StepRows()  # decodes alone: the lists as filled, the features a view when the rows follow each other
    for c in (0, 1, 2):
        decodes.add_one(c, 50 + c, 3, 100 + c)
    got = decodes.build(captured, [0, 1, 2, 3])
    assert got.seq_ids == [50, 51, 52] and got.features.data_ptr() == captured.data_ptr()
    assert StepRows().build(captured, qsl) is None


def test_a_held_plain_decision_holds_while_the_batch_stays_in_its_bucket():
    assert [batch_key(n) for n in (1, 5, 8, 9, 16, 17, 121, 128)] == [1, 5, 8, 16, 16, 24, 128, 128]
    policy = AdaptivePolicy(table(per_token_ms=10.0), TreeSettings("chain", 4),
                            PolicyConfig(probe_every=0, hold_steps=100))
    ids = list(range(128))
    seen(policy, accepted=0, seq_id=0)  # sequence 0 has its own estimate; the others are on the global curve
    key = lambda n: (batch_key(n), batch_key(n))
    assert policy.choose(128, 1024, ids, [4] * 128, quick_key=key(128)) == 0
    for n in range(127, 120, -1):  # one finishes each step, none with an estimate of its own
        policy.release(ids[n])
        assert policy.choose_held(key(n)), n
    assert not policy.choose_held(key(120))  # another bucket: look again
    assert policy.choose(120, 1024, ids[:120], [4] * 120, quick_key=key(120)) == 0
    policy.release(0)  # its own estimate leaves the batch's sum: look again
    assert not policy.choose_held(key(119))


@pytest.mark.parametrize("seed", range(6))
def test_every_size_priced_at_once_is_each_size_priced_alone(seed):
    """``StepCosts.sizes_ms`` and ``lower_bounds_ms`` (a decision's prices for every size, what the
    sizes share read once) give the very floats ``step_ms`` and ``lower_bound_ms`` give size by size,
    whatever was learned: nothing, some batch buckets, chained steps, the trees' real node counts."""
    rng = random.Random(seed)
    policy = AdaptivePolicy(table(per_token_ms=0.05 + rng.random() * 0.2), TreeSettings("dynamic", 7, 10, 59),
                            PolicyConfig(probe_every=0, cost_weight=rng.choice([0.3, 1.0])))
    costs = policy.costs
    costs.chainable = seed % 2 == 1

    def check():
        for batch in (1, 2, 3, 4, 9, 16, 64, 100):
            for speculating in {1, batch // 2 or 1, batch}:
                context = rng.uniform(10, 5000)
                assert costs.sizes_ms(batch, context, speculating) == \
                    [costs.step_ms(batch, context, m, speculating) for m in costs.sizes]
                assert costs.lower_bounds_ms(batch, context) == [costs.lower_bound_ms(batch, context, m)
                                                                 for m in costs.sizes]

    check()  # nothing learned
    for _ in range(rng.randint(300, 500)):  # (EVIDENCE_STEPS of each kind at some buckets: lower bounds read them)
        batch = rng.choice([1, 4, 64])
        kind = rng.random()
        if kind < 0.3:
            policy.observe_draft(batch, rng.randint(1, 8), rng.uniform(0.2, 3.0))
        elif kind < 0.6:
            policy.observe_step(batch, rng.choice(costs.sizes), rng.uniform(10, 4000), rng.uniform(0.5, 20.0),
                                chained=rng.random() < 0.5)
        elif kind < 0.8:
            policy.observe_step(batch, 0, rng.uniform(10, 4000), rng.uniform(0.3, 5.0))
        else:
            j = rng.randrange(len(costs.sizes))
            costs.nodes[j] = rng.uniform(1, costs.sizes[j])  # the trees of a size held fewer nodes
    check()


def test_the_largest_trees_cost_what_chained_steps_measured_where_the_drafter_chains():
    """A chained step has no draft call: its draft's device time is in the step that verifies its trees.
    Those steps teach the largest size's cost (forward + their own residual) in place of the
    unchained model (forward + tree residual + draft call), only where the drafter chains."""
    limits = TreeSettings("chain", 3)
    policy = AdaptivePolicy(table(per_token_ms=0.1), limits, PolicyConfig(probe_every=0, cost_weight=1.0))
    seen(policy, accepted=1, nodes=3)
    policy.observe_draft(1, 3, 14.0)  # a draft call costs more than a tree of one accepted node brings
    policy.observe_step(1, 3, 1024, 10.5)
    assert policy.best(1, 1024, [0], [3]) == 0
    policy.observe_step(1, 3, 1024, 13.0, chained=True)  # the same trees chained: 13 ms, the draft in it
    assert policy.best(1, 1024, [0], [3]) == 0  # the drafter does not chain: the model stays unchained
    policy.chainable = True
    assert policy.best(1, 1024, [0], [3]) == 3 and policy.step_ms(1, 1024, 3, 1) == pytest.approx(13.0)
    assert policy.step_ms(1, 1024, 2, 1) > 20.0  # smaller sizes are asked for by a draft call: unchained
    assert policy.step_ms(2, 1024, 3, 1) > 20.0  # a batch where some sequences decode plainly: unchained
    # A batch bucket without a chained step measured: the unchained model until a tree step ran there
    # (the scheduler may split that batch's trees over several steps: none would ever be measured),
    # then the tree step without its draft (optimistic: the next chained step teaches the real cost).
    assert policy.step_ms(2, 1024, 3, 2) > 20.0
    policy.observe_step(2, 3, 1024, 11.0)  # an unchained tree step of 2 sequences: residual 0.4
    assert policy.step_ms(2, 1024, 3, 2) == pytest.approx(10.6 + 0.4)  # forward + tree residual, no draft
    policy.observe_step(2, 3, 1024, 30.0, chained=True)
    assert policy.step_ms(2, 1024, 3, 2) == pytest.approx(30.0)
    policy.observe_step(1, 3, 1024, 90.0, chained=True)  # a stalled chained step: never dearer than unchained
    assert policy.step_ms(1, 1024, 3, 1) == pytest.approx(10.5 + 14.0)
    assert policy.diagnostics()["steps"]["chained tree b1"]["steps"] == 2


# --- end to end -----------------------------------------------------------------------------------

class ChaosPolicy(AdaptivePolicy):
    """Picks a random size (plain decoding included) every step: whatever the choice, the output holds."""

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice = random.choice((0, *self.sizes))
        self.decisions[self.choice] += 1
        return self.choice

    def detaches(self, batch, context):
        return False  # every request keeps the draft: the random choices are what is tested


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    return (make_model_dir(root / "target", "llama3", seed=5, std=0.3),
            make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1))


def eagle_engine(dirs, tree, policy_cls, cost: CostTable, **engine_kw):
    spec = SpecConfig(str(dirs[1]), tree=tree, depth=4, top_k=3, max_nodes=10)
    target = target_for(dirs[0], **engine_kw)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels)
    return Engine(target, drafter, spec.settings, policy_cls(cost, spec.settings) if policy_cls else None)


@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_greedy_output_equals_target_only_whatever_the_policy_picks(dirs, tree):
    random.seed(3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 14, 2, 25)]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS, params)]
    engine = eagle_engine(dirs, tree, ChaosPolicy, table(1.0), max_batch_tokens=32)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == want
    assert len(engine.policy.decisions) >= 4 and engine.speculation_totals().steps > 0
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0
    engine = eagle_engine(dirs, tree, AdaptivePolicy, table(0.01), max_batch_tokens=32)  # the real policy
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == want


def test_greedy_output_equals_target_only_with_small_trees_cut_to_fewer_levels(dirs, monkeypatch):
    """``EAGLE3_TREE_LEVELS``: the policy's smaller dynamic trees grow fewer levels (3 and 7 nodes: one),
    and the output is still target-only's token for token."""
    from common import tree_settings

    class Watched(ChaosPolicy):  # the verified trees' depths, by the size asked for
        deepest: dict[int, int] = {}

        def observe_tree(self, seq_id, tree, accepted, asked):
            if tree.num_nodes:
                self.deepest[asked] = max(self.deepest.get(asked, 0), int(tree.depths.max()))
            super().observe_tree(seq_id, tree, accepted, asked)

    monkeypatch.setattr(tree_settings, "TREE_LEVELS", ((7, 1),))
    random.seed(4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 14, 2, 25)]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS, params)]
    engine = eagle_engine(dirs, "dynamic", Watched, table(1.0), max_batch_tokens=32)
    assert engine.policy._levels.tolist() == [1, 1, 1, 4]  # sizes 1, 3, 7 and the budget of 10
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == want
    assert Watched.deepest.get(7) == 1 and Watched.deepest.get(3) == 1, Watched.deepest  # (uncut: 7 nodes went 2 deep)


def test_the_draft_gets_every_row_before_it_proposes(dirs):
    random.seed(5)
    engine = eagle_engine(dirs, "dynamic", ChaosPolicy, table(1.0))
    seq_id = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(25):
        engine.step()
        seq = engine.sequences[seq_id]
        rows = engine.drafter.rows.get(seq_id, 0)
        if seq.tree is not None:  # a tree was just proposed: every committed row reached the draft
            assert rows == seq.num_tokens - 1
        else:  # plain decoding: the rows wait in the buffer, none lost, none twice
            assert rows + engine.feed_buffer.rows == seq.num_tokens - 1


class PlainThenTrees(AdaptivePolicy):
    """Plain decoding for the first 60 decisions, then the largest tree."""

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice = 0 if sum(self.decisions.values()) < 60 else self.sizes[-1]
        self.decisions[self.choice] += 1
        return self.choice


def test_a_backlog_larger_than_one_draft_call_goes_in_pieces_and_in_order(dirs):
    engine = eagle_engine(dirs, "dynamic", PlainThenTrees, table(1.0), max_batch_tokens=32)
    calls = []
    step = engine.drafter.step
    engine.drafter.step = lambda feeds, proposals: calls.append(sum(len(f.next_tokens) for f in feeds)) or \
        step(feeds, proposals)
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    want = Engine(target_for(dirs[0])).generate([PROMPTS[3]], params)[0].token_ids
    seq_id = engine.add_request(PROMPTS[3], params)
    out = []
    while not engine.speculation_totals().steps:  # until the first tree was verified
        out += [t for ev in engine.step() for t in ev.token_ids]
    max_rows = engine.feed_buffer.max_rows
    assert len(calls) >= 2 and max(calls) <= max_rows and sum(calls) > max_rows  # one backlog, several calls
    assert engine.drafter.rows[seq_id] >= len(PROMPTS[3]) + 60
    out += [t for ev in engine.run_until_done() for t in ev.token_ids]
    assert out == want


class TreesAlways(AdaptivePolicy):
    """The largest tree every step; keeps what each draft call told the cost model."""

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice = self.sizes[-1]
        self.decisions[self.choice] += 1
        return self.choice

    def observe_draft(self, speculating, levels, ms, backlog=0):
        self.__dict__.setdefault("draft_backlogs", []).append(backlog)
        super().observe_draft(speculating, levels, ms, backlog)


def test_the_prompt_rows_a_first_tree_extends_are_catch_up_not_the_trees_cost(dirs):
    """A request's first draft call extends its whole prompt (a 16K prompt of the 8B geometry: 24 ms,
    learned as every later tree's fixed cost, priced trees out for good). Its prompt rows count as
    the call's catch-up rows, which the cost model keeps apart from the trees' cost; the calls after
    it bring a tree's few accepted rows."""
    engine = eagle_engine(dirs, "dynamic", TreesAlways, table(1.0), max_batch_tokens=64)
    engine.speculation.chain = False  # every tree a draft call of its own (a chained one is timed with its step)
    prompt = PROMPTS[1]
    engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    first, *rest = engine.policy.draft_backlogs
    assert first >= len(prompt) - 1 and rest and max(rest) <= 5  # a tree of depth 4 commits at most 5 rows
    assert engine.policy.costs.observed["draft after plain steps b1"][2] == first


@pytest.mark.parametrize("feed_prompt_rows", [0, 1])
def test_prompt_rows_reach_the_draft_at_once_where_the_policy_says(dirs, feed_prompt_rows):
    """``feed_prompt_rows``: a 40-token prompt in chunks of at most 16 rows, then plain decoding: with
    it, every prompt row reaches the draft by the end of the prompt's steps (no tree asked for) and
    only the plain steps' rows wait; without it, the prompt's last chunk waits with them for the first
    tree. The output is target-only's either way."""
    cfg = PolicyConfig(feed_prompt_rows=feed_prompt_rows)
    engine = eagle_engine(dirs, "dynamic", lambda cost, limits: PlainThenTrees(cost, limits, cfg), table(1.0),
                          max_batch_tokens=16)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    want = Engine(target_for(dirs[0])).generate([PROMPTS[1]], params)[0].token_ids
    seq_id = engine.add_request(PROMPTS[1], params)
    out = []
    while engine.sequences[seq_id].prefilling:
        out += [t for ev in engine.step() for t in ev.token_ids]
    for _ in range(5):  # plain steps (the first 60 decisions)
        out += [t for ev in engine.step() for t in ev.token_ids]
    seq, fed = engine.sequences[seq_id], engine.drafter.rows.get(seq_id, 0)
    assert fed + engine.feed_buffer.rows == seq.num_tokens - 1  # every committed row, once
    if feed_prompt_rows:
        assert fed >= len(PROMPTS[1]) - 1 and engine.feed_buffer.rows <= 6
    else:
        assert fed < len(PROMPTS[1]) - 1  # (the last chunk's rows wait)
    out += [t for ev in engine.run_until_done() for t in ev.token_ids]
    assert out == want and engine.speculation_totals().steps > 0


class CountingOracle(OracleDrafter):
    calls = 0

    def step(self, feeds, proposals):
        self.calls += 1
        return super().step(feeds, proposals)


@pytest.mark.parametrize("per_token_ms, speculates, detach", [(0.01, True, 0.75), (100.0, False, 0.0),
                                                              (100.0, False, 0.75)])
def test_a_perfect_draft_speculates_when_trees_are_cheap_and_not_when_dear(dirs, per_token_ms, speculates, detach):
    """Where trees are dear, a request that starts there runs without the draft (``detach``, the
    default); kept attached (detach 0), the policy decodes it plainly step after step."""
    limits = TreeSettings("chain", 4)
    drafter = CountingOracle(target_for(dirs[0]), depth=4)
    # The oracle runs a whole target generation per tree: measured, its cost would rule out speculation.
    policy = AdaptivePolicy(table(per_token_ms), limits, PolicyConfig(cost_weight=0.0, detach_below=detach))
    engine = Engine(target_for(dirs[0]), drafter, limits, policy)
    drafter.engine = engine
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    result = engine.generate([PROMPTS[1]], params)[0]
    assert result.token_ids == [r.token_ids for r in Engine(target_for(dirs[0])).generate([PROMPTS[1]], params)][0]
    decisions = engine.policy.decisions
    assert engine.speculation.detacher.detached_requests == (0 if speculates or not detach else 1)
    if speculates:
        assert decisions.most_common(1)[0][0] == 4 and result.speculation.tau > 3
    elif detach:  # never attached: no decision, no draft call, no rows kept
        assert not decisions and drafter.calls == 0 and result.speculation.steps == 0
        assert engine.feed_buffer.rows == 0
    else:
        assert decisions.most_common(1)[0][0] == 0 and decisions[0] >= 3 * sum(decisions[n] for n in (1, 2, 3, 4))
        assert drafter.calls < len(result.token_ids) / 3  # plain steps do not call the draft


class HeldPlainThenTrees(AdaptivePolicy):
    """Plain decoding for the first 40 decisions, every other one held (``choose_held``: the decision the
    real policy repeats without looking at the sequences), then the largest tree. Both kinds of plain
    decision are taken before the step's tokens are read, and the next step launched at once
    (``Engine._decode_ahead``)."""

    def choose_held(self, quick_key):
        n = sum(self.decisions.values())
        if n >= 40 or n % 2:
            return False
        self.choice, self.last_held = 0, True
        self.decisions[0] += 1
        return True

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice, self.last_held = (0 if sum(self.decisions.values()) < 40 else self.sizes[-1]), False
        self.decisions[self.choice] += 1
        return self.choice


def test_held_plain_decoding_is_launched_ahead_and_feeds_the_draft_every_row(dirs):
    """With a draft attached, steps of held plain decoding are launched before the last one's tokens
    reach the host, as target-only decoding is: the same tokens as without it and as target-only
    decoding, the draft fed every row in order (then trees from them), nothing left allocated."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (50, 30, 45)]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS[:3], params)]
    runs = []
    for ahead in (True, False):
        engine = eagle_engine(dirs, "dynamic", HeldPlainThenTrees, table(1.0))
        assert engine.decode_ahead  # with a policy: on by default
        engine.decode_ahead = ahead
        fed, step = [], engine.drafter.step
        engine.drafter.step = lambda feeds, proposals: fed.extend(
            (f.seq_id, f.start, f.features.clone(), list(f.next_tokens)) for f in feeds) or step(feeds, proposals)
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
        out = {i: [] for i in ids}
        while engine.has_work:
            for ev in engine.step():
                out[ev.seq_id] += ev.token_ids
            for i, seq in engine.sequences.items():  # every committed row reached the draft or waits for it
                rows = engine.drafter.rows.get(i, 0)
                waiting = engine.feed_buffer.waiting(i)
                assert rows + waiting == seq.num_tokens - 1
        measured = sum(v["steps"] for k, v in engine.policy.diagnostics()["steps"].items() if k.startswith("plain"))
        runs.append(([out[i] for i in ids], engine.decode_steps_ahead, engine.speculation_totals(), fed, measured))
        assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0
    (got, launched, trees, fed, timed), (unahead, none, trees_too, fed_too, untimed) = runs
    assert got == want == unahead and launched > 30 and none == 0 and trees.steps > 0 and trees == trees_too
    assert timed > 0 and untimed == 0  # plain steps are timed as plain stretches run them: launched ahead
    assert len(fed) == len(fed_too) and all(a[:2] == b[:2] and a[3] == b[3] and torch.equal(a[2], b[2])
                                            for a, b in zip(fed, fed_too))  # the draft was fed the same rows


@pytest.mark.parametrize("policy", [True, False])
def test_requests_that_do_not_speculate_decode_ahead_beside_a_draft(dirs, policy):
    """Requests that ask for no speculation, on an engine with a draft, with a policy or without one:
    plain decoding whatever the policy would pick, launched ahead as target-only decoding is (without
    it, a plain request beside a draft waited for every step's tokens before launching the next), the
    same tokens."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS[:2], params)]
    engine = eagle_engine(dirs, "dynamic", ChaosPolicy if policy else None, table(1.0))
    assert (engine.policy is not None) == policy
    ids = [engine.add_request(p, params, speculate=False) for p in PROMPTS[:2]]
    out = {i: [] for i in ids}
    for ev in engine.run_until_done():
        out[ev.seq_id] += ev.token_ids
    assert [out[i] for i in ids] == want and engine.decode_steps_ahead > 10
    assert engine.speculation_totals().steps == 0 and not engine.drafter.rows


class Fixed(AdaptivePolicy):
    """Always trees of ``nodes`` (default: the largest)."""
    nodes = None

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice, self.last_held = self.nodes or self.sizes[-1], False
        self.decisions[self.choice] += 1
        return self.choice


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("largest", [True, False])
def test_a_policy_that_picks_the_largest_trees_chains_them_behind_acceptance(dirs, largest, graphs):
    """With a policy, steps of the requests' own (largest) trees grow the next trees on the device
    behind acceptance, as without one (``DraftCoordinator.chains``), and learn their cost as chained
    steps; a smaller choice calls the draft for capped trees. The tokens are target-only's either way.
    ``graphs``: the graphed paths (run eagerly on a CPU), where chained trees are verified straight
    from the device and reach the host after their step (whose size the policy must still learn)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25)]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS[:2], params)]
    policy_cls = type("Pick", (Fixed,), {"nodes": None if largest else 4})
    engine = eagle_engine(dirs, "dynamic", policy_cls, table(1.0), graphs_on_cpu=graphs)
    assert engine.policy.chainable
    assert [r.token_ids for r in engine.generate(PROMPTS[:2], params)] == want
    chained = engine.speculation.chained_steps
    steps = engine.policy.diagnostics()["steps"]
    if largest:
        assert chained > 10 and sum(v["steps"] for k, v in steps.items() if k.startswith("chained tree")) > 5
        # Each chained step's choice was taken while the device ran the step's forward (``choose_ahead``).
        assert engine.speculation.early_choices == chained
        # The last steps, whose chained trees max_tokens cut away, ran behind a chained draft: not plain costs.
        assert not any(k.startswith("plain") for k in steps), steps
        assert (engine.steps_ahead > 10) == (graphs or engine.target.device.type == "cuda")
    else:
        assert chained == 0 and not any(k.startswith("chained") for k in steps)
        assert engine.speculation_totals().steps > 10
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0


# --- what trees really delivered (realized rates) ----------------------------------------------------

def test_trees_measured_slower_than_plain_steps_are_vetoed_at_their_batch_and_above():
    rates = RealizedRates(window=64, span=100, from_bucket=8)
    for _ in range(MIN_STEPS):
        rates.observe(16, 16, 1.0, 0.0, trees=False, now=0)  # plain: 16 tokens per ms
    for _ in range(MIN_STEPS - 1):
        rates.observe(16, 50, 5.0, 0.0, trees=True, now=10)  # trees: 10 tokens per ms
    assert not rates.vetoed(16, 10)  # too few tree steps to judge
    rates.observe(16, 50, 5.0, 0.0, trees=True, now=10)
    assert rates.vetoed(16, 10) and rates.vetoed(9, 10) and rates.vetoed(128, 10)  # buckets 16, 16, 128
    assert not rates.vetoed(8, 10) and not rates.vetoed(4, 10)  # smaller batches: not measured there
    assert rates.rates()["trees b16"]["steps"] == MIN_STEPS
    # The veto lapses ``span`` decisions after the last tree step at its bucket, and its trees are measured afresh.
    assert rates.vetoed(64, 109) and not rates.vetoed(64, 110) and "trees b16" not in rates.rates()


def test_a_policy_variant_changes_only_the_fields_it_names():
    from verify_service.adaptive import policy_variant
    v = policy_variant("stay_margin=0.5,hold_steps=4")
    assert (v.stay_margin, v.hold_steps) == (0.5, 4) and type(v.hold_steps) is int
    assert v.probe_every == PolicyConfig().probe_every
    for bad in ("no_such_field=1", "stay_margin", "hold_steps=x"):
        with pytest.raises(ValueError):
            policy_variant(bad)


def test_switches_between_plain_decoding_and_trees_are_counted_with_their_reason():
    """Each decision that moves between plain decoding and trees is counted by direction, batch bucket
    and reason: leaving trees on the sequence's own estimate while the global one still picks trees,
    or on the global estimate too (``diagnostics()["switches"]``)."""
    def policy_after(bad_trees: int) -> AdaptivePolicy:
        policy = AdaptivePolicy(table(0.3), TreeSettings("chain", 4),  # (every step decides: hold_steps 1)
                                PolicyConfig(probe_every=0, cost_weight=0.0, stay_margin=0.0, hold_steps=1))
        seen(policy, accepted=4, times=20, nodes=4)
        assert policy.choose(1, 100.0, [0], [4]) == 4
        seen(policy, accepted=0, times=bad_trees, nodes=4)
        return policy

    own = policy_after(20)
    global_trees = own._global_pick(1, 100.0, 1)[0]
    assert own.choose(1, 100.0, [0], [4]) == 0 and global_trees > 0
    assert own.diagnostics()["switches"] == {"plain -> trees b1: model": 1, "trees -> plain b1: sequences' estimates": 1}
    both = policy_after(40)
    assert both._global_pick(1, 100.0, 1)[0] == 0 and both.choose(1, 100.0, [0], [4]) == 0
    assert both.switches == {"plain -> trees b1: model": 1, "trees -> plain b1: global estimate": 1}
    assert both.choose(1, 100.0, [0], [4]) == 0 and sum(both.switches.values()) == 2  # no switch: plain again


def test_a_request_starts_without_the_draft_where_trees_do_not_pay_at_its_batch():
    """Forward = 10 ms + 1 ms per extra token and sequence: a batch of one gains from a tree, a batch
    of 64 pays 64 ms a node and would lose; below ``detach_below`` of plain decoding's rate, or where
    trees are vetoed, or from a batch of ``leave_from`` where the global estimate picks plain decoding,
    a starting request runs without the draft; ``detach_below`` and ``leave_from`` 0 never detach."""
    limits = TreeSettings("dynamic", 4, 3, 10)
    policy = AdaptivePolicy(table(1.0), limits)
    assert not policy.detaches(1, 100.0) and policy.detaches(64, 100.0)
    assert not AdaptivePolicy(table(1.0), limits, PolicyConfig(detach_below=0.0, leave_from=0)).detaches(64, 100.0)
    # Trees at 0.75-1.0 of plain decoding's rate at batch 64: the lower bound keeps the draft, the
    # global estimate's pick (plain decoding) does not, from a batch of ``leave_from``.
    near = AdaptivePolicy(table(0.016, base_ms=1.0), limits, PolicyConfig(leave_from=0))
    assert near._global_pick(64, 100.0, 64)[0] == 0 and not near.detaches(64, 100.0)
    near.cfg = PolicyConfig(leave_from=64)
    assert near.detaches(64, 100.0) and not near.detaches(32, 100.0)
    cheap = AdaptivePolicy(table(0.001), limits)  # trees measured slower than plain steps at batch 8
    assert not cheap.detaches(8, 100.0)
    for _ in range(MIN_STEPS):
        cheap.realized.observe(8, 8, 1.0, 0.0, trees=False, now=0)
        cheap.realized.observe(8, 10, 5.0, 0.0, trees=True, now=0)
    assert cheap.detaches(8, 100.0) and cheap.detaches(64, 100.0) and not cheap.detaches(4, 100.0)
    for _ in range(PolicyConfig().veto_span):  # steps of requests without the draft, no decision taken
        cheap.observe_realized(8, 8, 1.0, 0.0, trees=False)
    assert not cheap.detaches(8, 100.0)  # the veto lapsed: the model alone decides again


def test_a_request_starts_without_the_draft_only_where_even_the_trees_lowest_cost_loses():
    """A request that starts without the draft stays so until the batch changes bucket, and no tree of
    its measures what trees cost there: the decision prices trees at their lower bound, the calibrated
    forward plus only what ``EVIDENCE_STEPS`` steps measured at the batch's own bucket. Costs learned
    at batch 1 are not read at batch 4, nor a few steps' at batch 1; many steps at batch 4 are."""
    from verify_service.step_costs import EVIDENCE_STEPS
    policy = AdaptivePolicy(table(per_token_ms=0.02), TreeSettings("chain", 3), PolicyConfig(probe_every=0,
                                                                                          cost_weight=1.0, leave_from=0))
    seen(policy, accepted=3, nodes=3)

    def dear_steps(batch, times):  # a draft call of 40 ms, a tree step 60 ms beyond its forward
        for _ in range(times):
            policy.observe_draft(batch, 3, 40.0)
            policy.observe_step(batch, 3, 1024, policy.costs.forward(batch, 4, 1024) + 60.0)

    dear_steps(1, EVIDENCE_STEPS - 1)
    assert policy.best(1, 1024, [0], [3]) == 0  # the model: trees lose at batch 1 ...
    assert not policy.detaches(1, 1024) and not policy.detaches(4, 1024)  # ... a few steps say so
    # (requests running without the draft take it up again only where the full model picks trees:
    # their catch-up recomputes every position)
    assert not policy.trees_pay(1, 1024)
    dear_steps(1, 1)
    assert policy.detaches(1, 1024) and not policy.detaches(4, 1024)  # batch 1's costs are not batch 4's
    dear_steps(4, EVIDENCE_STEPS)
    assert policy.detaches(4, 1024)


def test_requests_started_together_where_trees_do_not_pay_run_without_the_draft(dirs):
    """Five requests at once, where a tree's nodes cost 3 ms a sequence: they run as target-only would
    (the same tokens), the draft never sees a row of them; one request alone, where a tree breaks
    even, keeps the draft."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 14, 2, 25)]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS, params)]
    table_only = PolicyConfig(cost_weight=0.0)  # (the table's costs alone: none measured on this machine)
    engine = eagle_engine(dirs, "dynamic", lambda cost, limits: AdaptivePolicy(cost, limits, table_only), table(3.0))
    fed = []
    step = engine.drafter.step
    engine.drafter.step = lambda feeds, proposals: fed.append(len(feeds)) or step(feeds, proposals)
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == want
    assert engine.speculation.detacher.detached_requests == 5 and not fed and engine.feed_buffer.rows == 0
    assert all(r.speculation is not None and r.speculation.steps == 0 for r in results)
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0
    alone = engine.generate([PROMPTS[1]], params[1])[0]
    assert alone.token_ids == want[1] and engine.speculation.detacher.detached_requests == 5  # attached (its trees break even)


class DetachLongContexts(AdaptivePolicy):
    """Trees do not pay beyond 50 tokens of context, whatever the batch."""

    def detaches(self, batch, context):
        return context > 50


def test_a_wave_of_prompts_admitted_over_several_steps_starts_alike(dirs):
    """Four short prompts and four long ones together, prefilled over several steps (32 tokens a
    step): the wave is priced once, at the batch's mean length (60 tokens), so all eight start
    without the draft, those not yet started included; priced at their own prompts, the short ones
    kept it. The later prompt steps look at the policy no more, the draft is never called, and the
    batch they left the draft at is not looked at again (``trees_pay``) while it stays the same."""
    short = [list(range(1 + i, 21 + i)) for i in range(4)]
    prompts = short + [[(7 * j + i) % 90 + 1 for j in range(100)] for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # (enough left to take the draft up again)
    want = [r.token_ids for r in Engine(target_for(dirs[0], max_batch_tokens=32)).generate(prompts, params)]
    engine = eagle_engine(dirs, "dynamic", DetachLongContexts, table(1.0), max_batch_tokens=32)
    looks, requests = [], []
    decide, ask = engine.policy.detaches, engine.speculation._requests
    engine.policy.detaches = lambda batch, context: looks.append(batch) or decide(batch, context)
    engine.speculation._requests = lambda *a: requests.append(a) or ask(*a)
    pays, trees_pay = [], engine.policy.trees_pay
    engine.policy.trees_pay = lambda batch, context: pays.append(batch) or trees_pay(batch, context)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert engine.speculation.detacher.detached_requests == 8
    assert looks == [8] and not requests and not pays and engine.speculation.speculating == 0


class DetachAboveTwo(AdaptivePolicy):
    """Trees pay at batch 1 and 2 only, and then the largest is always chosen."""

    def detaches(self, batch, context):
        return batch > 2

    def trees_pay(self, batch, context):
        return batch <= 2

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice, self.last_held = self.sizes[-1], False
        self.decisions[self.choice] += 1
        return self.choice


def test_requests_without_the_draft_take_it_up_again_once_the_batch_shrinks(dirs):
    """Five requests start together without the draft; once three have finished, the two with more
    than ``REATTACH_MIN_TOKENS`` tokens left recompute every position for the draft (their KV left as
    it is) and speculate: the same tokens as target-only decoding, the draft fed every row in order
    before its first tree (a row missing or repeated fails the feed buffer's and the draft's checks)."""
    from verify_service.detacher import REATTACH_MIN_TOKENS
    lengths = (9, 80, 14, 2, 70)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS, params)]
    engine = eagle_engine(dirs, "dynamic", DetachAboveTwo, table(1.0))
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == want
    detacher = engine.speculation.detacher
    assert detacher.detached_requests == 5 and detacher.reattached_requests == 2
    assert [r.speculation.steps > 0 for r in results] == [n - 14 >= REATTACH_MIN_TOKENS for n in lengths]
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0


def test_the_count_of_requests_using_the_draft_follows_every_change(dirs):
    """``DraftCoordinator.speculating`` (a step where it is 0 skips the draft's bookkeeping: no
    features kept, no rows, no draft call) equals the live requests that speculate after every step:
    requests started without the draft and taking it up again, one that never asked for it, one
    cancelled without the draft and one cancelled while it speculates."""
    lengths = (9, 80, 14, 2, 70)
    engine = eagle_engine(dirs, "dynamic", DetachAboveTwo, table(1.0))
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, lengths)]
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), speculate=False)
    kept = []
    real = engine.target.runner.step
    engine.target.runner.step = lambda chunks, **kw: kept.append(kw.get("capture", True)) or real(chunks, **kw)
    counts, cancelled = [], []
    while engine.has_work:
        engine.step()
        live = [s for s in engine.sequences.values() if s.speculate]
        if len(counts) == 3:
            engine.abort(ids[2])  # (started without the draft)
            cancelled.append(ids[2])
        elif len(cancelled) == 1 and live and live[0].speculation.steps >= 2:
            engine.abort(live[0].seq_id)
            cancelled.append(live.pop(0).seq_id)
        assert engine.speculation.speculating == len(live)  # (a request waiting to start counts)
        counts.append(len(live))
    assert len(cancelled) == 2 and engine.speculation.speculating == 0
    quiet = counts.index(0)  # every request started without the draft ...
    assert max(counts[quiet:]) >= 1 and engine.speculation.detacher.reattached_requests >= 1  # ... one took it up
    assert not any(kept[:quiet]) and any(kept)  # features kept only where a request speculates


class LeaveAboveTwo(AdaptivePolicy):
    """Requests start with the draft (no decision taken yet); plain decoding while more than two sequences
    decode, where the running ones leave the draft (``leave_from`` 1); at two or fewer the largest tree,
    where they take it up again."""

    def __init__(self, cost, limits):
        super().__init__(cost, limits, PolicyConfig(leave_from=1))

    def detaches(self, batch, context):
        return batch > 2 and self.decided > 0

    def trees_pay(self, batch, context):
        return batch <= 2

    def choose(self, batch, context, seq_ids, budgets, quick_key=None):
        self.choice, self.last_held = (0 if batch > 2 else self.sizes[-1]), False
        self.decisions[self.choice] += 1
        self.decided += 1
        return self.choice


def test_running_requests_leave_the_draft_where_plain_decoding_is_chosen_and_take_it_up_again(dirs):
    """Requests start with the draft; their prompts' rows wait in the feed buffer while plain
    decoding is chosen, and at the first whole decision for it the running requests leave the draft:
    rows dropped, draft state released, no features kept from then on. Once three have finished, the
    two with ``REATTACH_MIN_TOKENS`` tokens left recompute every position and speculate: the draft gets
    all their rows again, in order, under the same sequence ids (rows dropped when they left must not
    hide the new ones), and the tokens are target-only decoding's."""
    from verify_service.detacher import REATTACH_MIN_TOKENS
    lengths = (9, 80, 14, 2, 70)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    want = [r.token_ids for r in Engine(target_for(dirs[0])).generate(PROMPTS, params)]
    engine = eagle_engine(dirs, "dynamic", LeaveAboveTwo, table(1.0))
    kept = []
    real = engine.target.runner.step
    engine.target.runner.step = lambda chunks, **kw: kept.append(kw.get("capture", True)) or real(chunks, **kw)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    out = {i: [] for i in ids}
    speculating = []
    while engine.has_work:
        for ev in engine.step():
            out[ev.seq_id] += ev.token_ids
        speculating.append(engine.speculation.speculating)
    assert [out[i] for i in ids] == want
    detacher = engine.speculation.detacher
    # (the two-token request finished first; the longest prompt's first chunk, after the first decision,
    # started without the draft)
    assert detacher.left_requests == 3 and detacher.detached_requests == 1 and detacher.reattached_requests == 2
    assert 0 in speculating and speculating[-2] >= 1 and not any(kept[speculating.index(0) + 1:][:5])
    assert engine.speculation_totals().steps > 0 and engine.drafter.rows == {}
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0
    assert engine.feed_buffer.rows == 0 and detacher.detached == 0
    assert REATTACH_MIN_TOKENS < 70 - 14


def test_a_request_that_started_alone_leaves_the_draft_when_the_batch_grows_where_trees_do_not_pay(dirs):
    """The real policy: one request starts alone and keeps the draft (its trees break even); nine more
    join, a batch of ten where a tree's nodes cost 3 ms a sequence: they start without the draft, and
    at the policy's next whole decision for plain decoding the first one leaves it. The tokens are
    target-only decoding's."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sizes = dict(max_num_seqs=16, kv_cache_gib=0.02)
    want = [r.token_ids for r in Engine(target_for(dirs[0], **sizes)).generate(prompts, params)]
    table_only = PolicyConfig(cost_weight=0.0)
    engine = eagle_engine(dirs, "dynamic", lambda cost, limits: AdaptivePolicy(cost, limits, table_only), table(3.0),
                          **sizes)
    first = engine.add_request(prompts[0], params)
    out = {first: []}
    for _ in range(3):
        for ev in engine.step():
            out[ev.seq_id] += ev.token_ids
    assert engine.speculation.speculating == 1
    ids = [first] + [engine.add_request(p, params) for p in prompts[1:]]
    out.update({i: [] for i in ids[1:]})
    for ev in engine.run_until_done():
        out[ev.seq_id] += ev.token_ids
    assert [out[i] for i in ids] == want
    detacher = engine.speculation.detacher
    assert detacher.detached_requests == 9 and detacher.left_requests == 1 and engine.speculation.speculating == 0
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0


def test_a_recomputed_position_keeps_its_kv_and_gives_the_decode_steps_logits(dirs):
    """A catch-up chunk (every position again, ``write_from`` the newest): the cache's earlier entries
    are not written, and the newest token's logits are a plain decode step's."""
    from runtime.step_layout import SeqChunk, layout_arrays
    target = target_for(dirs[0])
    engine = Engine(target)
    seq_id = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    seq = engine.sequences[seq_id]
    table = target.blocks.block_table(seq.seq_id)
    n = seq.num_cached
    runner, cache = target.runner, target.kv_cache.data  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    decode = runner.step([SeqChunk(seq.token_slice(n, n + 1), n, table, logits_rows=(0,))]).logits.clone()
    written = cache.clone()
    again = runner.step([SeqChunk(seq.token_slice(0, n + 1), 0, table, logits_rows=(n,), write_from=n)], eager=True)
    torch.testing.assert_close(again.logits, decode, rtol=1e-4, atol=1e-4)
    block, offset = table[n // cache.shape[3]], n % cache.shape[3]
    torch.testing.assert_close(cache[:, :, block, offset], written[:, :, block, offset], rtol=1e-4, atol=1e-4)
    cache[:, :, block, offset] = written[:, :, block, offset]  # (the newest token's KV: written again)
    assert torch.equal(cache, written)  # every earlier position left as it was
    slots = layout_arrays([SeqChunk(seq.token_slice(0, n + 1), 0, table, write_from=n)], cache.shape[3])["slots"]
    assert (slots[:n] == -1).all() and slots[n] == block * cache.shape[3] + offset


def test_a_draft_call_of_a_plain_step_is_the_trees_cost():
    rates = RealizedRates(window=64, span=1000, from_bucket=8)
    for _ in range(8):
        rates.observe(32, 32, 1.0, 0.0, trees=False, now=0)  # 32 tokens per ms
        rates.observe(32, 80, 2.0, 0.0, trees=True, now=0)  # 40 tokens per ms: trees pay ...
    assert not rates.vetoed(32, 1)
    rates.observe(32, 32, 1.0, 30.0, trees=False, now=1)  # ... until the catch-up of a backlog is counted
    assert rates.vetoed(32, 1)
    small = RealizedRates(window=64, span=1000, from_bucket=8)
    for _ in range(8):
        small.observe(4, 4, 1.0, 0.0, trees=False, now=0)
        small.observe(4, 4, 5.0, 0.0, trees=True, now=0)
    assert not small.vetoed(4, 1)  # below ``from_bucket``: one sequence's hard passage vetoes nothing


def test_the_policy_decodes_plainly_where_trees_were_measured_slower_than_its_model_says():
    policy = AdaptivePolicy(table(per_token_ms=0.001), TreeSettings("chain", 5), PolicyConfig(probe_every=4))
    seen(policy, accepted=4)  # tau 5, nodes nearly free in the table: the model picks trees at any batch
    ids = list(range(16))
    assert policy.best(16, 1024, ids, [5] * 16) > 0 and policy.best(64, 1024, list(range(64)), [5] * 64) > 0
    for _ in range(8):  # measured: plain steps 16 tokens in 1 ms, tree steps 40 tokens in 5 ms
        policy.observe_realized(16, 16, 1.0, 0.0, trees=False)
        policy.observe_realized(16, 40, 5.0, 0.0, trees=True)
    assert policy.best(16, 1024, ids, [5] * 16) == 0 and policy.best(64, 1024, list(range(64)), [5] * 64) == 0
    assert policy.best(4, 1024, [0, 1, 2, 3], [5] * 4) > 0  # smaller batches: the model's choice
    choices = [policy.choose(16, 1024, ids, [5] * 16) for _ in range(40)]
    assert choices == [0] * 40  # and no probes while the veto holds
    assert policy.diagnostics()["vetoes"] >= 1 and "trees b16" in policy.diagnostics()["realized"]
    off = AdaptivePolicy(table(per_token_ms=0.001), TreeSettings("chain", 5), PolicyConfig(veto_span=0))
    seen(off, accepted=4)
    for _ in range(8):
        off.observe_realized(16, 16, 1.0, 0.0, trees=False)
        off.observe_realized(16, 40, 5.0, 0.0, trees=True)
    assert off.best(16, 1024, ids, [5] * 16) > 0  # veto_span 0: the model alone


def test_requests_still_prefilling_or_waiting_count_in_the_batch_chosen_for(dirs):
    """Trees chosen for the first requests admitted would take the step's token budget from the
    prompts of the others: the choice is made for the batch they all decode in."""
    limits = TreeSettings("chain", 3)
    policy = AdaptivePolicy(table(per_token_ms=0.001), limits, PolicyConfig(probe_every=0, cost_weight=0.0))
    batches = []
    choose = policy.choose
    policy.choose = lambda batch, *a, **k: batches.append(batch) or choose(batch, *a, **k)
    drafter = OracleDrafter(target_for(dirs[0]), depth=3)
    engine = Engine(target_for(dirs[0], max_num_seqs=8, max_batch_tokens=64), drafter, limits, policy)
    drafter.engine = engine
    for p in [list(range(10, 50))] * 6:  # 40-token prompts, 64 tokens a step: admitted over several steps
        engine.add_request(p, SamplingParams(max_tokens=6))
    seen_during_prefill = []  # (batch chosen for, live requests)
    while engine.has_work:
        joining = len(engine.scheduler.waiting) + sum(s.prefilling for s in engine.scheduler.running)
        n = len(batches)
        engine.step()
        if joining and len(batches) > n:
            seen_during_prefill.append((batches[-1], len(engine.sequences)))
    assert len(seen_during_prefill) >= 2 and all(b == live for b, live in seen_during_prefill)
    assert seen_during_prefill[0][0] == 6  # at the first choice, most of the six were not decoding yet


def test_a_slow_first_step_weighs_no_more_than_the_next_few():
    """Residuals are bias-corrected means: the first steps count about alike before the window takes
    over (counted fully and then at 5%, one slow first chained step priced the largest trees out)."""
    policy = AdaptivePolicy(table(per_token_ms=0.1), TreeSettings("chain", 3), PolicyConfig(probe_every=0))
    forward = policy.costs.forward(1, 4, 1024)
    policy.observe_step(1, 3, 1024, forward + 3.0, chained=True)  # the first chained step: 3 ms beyond
    for _ in range(3):
        policy.observe_step(1, 3, 1024, forward, chained=True)  # then what they cost
    assert policy.diagnostics()["residual_ms"]["chained tree b1"] == pytest.approx(0.71, abs=0.05)
    for _ in range(400):
        policy.observe_step(1, 3, 1024, forward + 1.0, chained=True)  # later, the window: the recent ones
    assert policy.diagnostics()["residual_ms"]["chained tree b1"] == pytest.approx(1.0, abs=0.01)


def test_the_lower_bound_counts_draft_calls_that_taught_nothing_as_no_cost():
    """Draft calls counted at a bucket but none learned (costs not learned: ``cost_weight`` 0): the
    lower bound is the forward's, not an error."""
    policy = AdaptivePolicy(table(per_token_ms=0.02), TreeSettings("chain", 3), PolicyConfig(cost_weight=0.0))
    from verify_service.step_costs import EVIDENCE_STEPS
    for _ in range(EVIDENCE_STEPS):
        policy.observe_draft(4, 3, 40.0)
    assert policy.costs.lower_bound_ms(4, 1024, 3) == pytest.approx(policy.costs.forward(4, 4, 1024))
    assert not policy.detaches(4, 1024)


def test_a_batch_whose_requests_without_the_draft_are_ending_looks_at_no_policy():
    """``Detacher.due`` asks the policy whether trees pay at a new batch bucket only where a running
    request without the draft has the tokens left to take it up again (``REATTACH_MIN_TOKENS``): at
    the tail of a batch whose requests end together, a look per shrinking key cost the host tens of
    microseconds each, for nothing. Once none has, none looks again until a request leaves the draft
    or starts without it."""
    from types import SimpleNamespace
    from verify_service.detacher import REATTACH_MIN_TOKENS, Detacher

    class Policy:
        looks = 0

        def trees_pay(self, batch, context):
            self.looks += 1
            return True  # a request with tokens left would take the draft up again

    def seq(left: int):
        return SimpleNamespace(detached=True, prefilling=False, num_tokens=100, max_new_tokens=128,
                               output_ids=[0] * (128 - left))

    running = [seq(REATTACH_MIN_TOKENS - 1) for _ in range(17)]  # batch key 24
    policy = Policy()
    d = Detacher(policy, SimpleNamespace(running=running, waiting=[]))
    d.detached = len(running)
    assert not d.due() and policy.looks == 0
    running.pop()  # batch 16: another key, still nothing to take up
    assert not d.due() and policy.looks == 0
    # Tokens left only shrink: the running requests are not looked over again until one leaves the
    # draft (or starts without it) ...
    running[1] = seq(REATTACH_MIN_TOKENS)  # (not a state serving reaches)
    del running[12:]  # batch 12: another key
    assert not d.due() and policy.looks == 0
    left = seq(REATTACH_MIN_TOKENS)
    left.detached = False
    running[0] = left
    d.leave([left], len(running))  # ... as this one does
    del running[8:]  # batch 8: another key, and one request could come back
    assert d.due() and policy.looks == 1
    assert d.due() and policy.looks == 1  # the same key: the look holds


def test_on_trees_a_decision_holds_its_steps_through_their_acceptance_from_plain_decoding_a_probe_ends_it():
    """Held on trees, the acceptance of the trees it chose does not end a decision before its
    ``hold_steps`` (at batch 1 every step verifies one: a whole decision a step cost the host twice
    the held one); a new sequence's first tree does, and so, held on plain decoding, does a probe's."""
    limits = TreeSettings("chain", 4)
    policy = AdaptivePolicy(table(0.3), limits, PolicyConfig(probe_every=0, cost_weight=0.0, stay_margin=0.0,
                                                             stay_global=0.0, hold_steps=4))
    seen(policy, accepted=4, times=20, nodes=4)
    assert policy.choose(1, 100.0, [0], [4]) == 4
    version = policy._version
    seen(policy, accepted=4, times=1, seq_id=7, nodes=4)  # held on trees: a new sequence's first tree ends it
    assert policy._version != version
    policy.release(7)
    assert policy.choose(1, 100.0, [0], [4]) == 4
    seen(policy, accepted=0, times=40, nodes=4)  # trees that accept nothing: plain decoding is best now
    assert policy.best(1, 100.0, [0], [4]) == 0
    assert [policy.choose(1, 100.0, [0], [4]) for _ in range(4)] == [4, 4, 4, 0]  # the hold runs out
    version = policy._version
    seen(policy, accepted=4, times=1, nodes=4)  # held on plain decoding: a (probe's) tree ends it
    assert policy._version != version
