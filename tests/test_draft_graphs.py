"""The draft's CUDA graphs (the whole proposal, draft_service/proposal_graph.py, and the draft
extend, draft_service/draft_graphs.py) against the same computations run eagerly.

CUDA only. A random draft head on a tiny target in float32: the graphed drafter gives the eager
one's output and acceptance, greedy speculative output is still the target-only output, and after
the warm-up generation captures no graph.
"""

import pytest
import torch

from common.sampling_params import SamplingParams
from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from tiny_eagle import make_target_and_head, run_steps
from tiny_models import target_for
from verify_service.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]

PROMPTS = [[5, 6, 7], list(range(10, 30)), [3] * 9]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("draft_graphs"), num_hidden_layers=2)


def engine(dirs, cuda_graphs: bool, tree: str = "dynamic"):
    spec = SpecConfig(str(dirs[1]), tree=tree, depth=4, top_k=3, max_nodes=10)
    target = target_for(dirs[0], device="cuda", dtype="float32")
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, cuda_graphs=cuda_graphs)
    return Engine(target, drafter, spec.settings)


@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_graphed_levels_give_the_eager_output(dirs, tree):
    want = [r.token_ids for r in Engine(target_for(dirs[0], device="cuda", dtype="float32")).generate(PROMPTS, PARAMS)]
    eager, graphed = engine(dirs, False, tree), engine(dirs, True, tree)
    assert eager.drafter.graphs is None and graphed.drafter.graphs is not None
    got_eager = eager.generate(PROMPTS, PARAMS)
    got_graphed = graphed.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in got_eager] == want == [r.token_ids for r in got_graphed]
    assert graphed.drafter.graphs.replays > 0  # the draft extend
    proposals = graphed.drafter._proposals.values()  # full-depth proposals: one graph each
    assert proposals and all(p.graph is not None for p in proposals) and sum(p.replays for p in proposals) > 0
    assert [r.speculation.accepted_tokens for r in got_eager] == [r.speculation.accepted_tokens for r in got_graphed]


@pytest.mark.parametrize("tree,graph_acceptance", [("dynamic", True), ("chain", True), ("dynamic", False)])
def test_the_chained_draft_replays_its_graphs_and_gives_the_unchained_steps(dirs, tree, graph_acceptance):
    """The draft chained after acceptance on the device (the extend fed from device rows and the
    proposal laid out from them, one graph: ``ChainedProposal``; the acceptance of trees verified from the device replayed as
    a graph, or launched op by op) gives every step's tokens and next trees the unchained draft
    gives, with finishing sequences among them."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 16, 9)]
    runs = []
    for chain in (True, False):
        eng = engine(dirs, True, tree)
        eng.speculation.chain = chain
        eng.verifier.graph_acceptance = graph_acceptance
        replays = lambda: sum(c.replays for c in eng.drafter._chains.values() if c is not None)  # noqa: E731
        runs.append((run_steps(eng, PROMPTS, params), eng.speculation.chained_steps, replays(),
                     eng.drafter.blocks.num_used_blocks, eng.steps_ahead, eng.verifier.graph_accepts))
    (chained, n_chained, replays, used, ahead, accepts), (unchained, n_unchained, _, _, _, _) = runs
    assert n_chained > 5 and n_unchained == 0 and replays >= n_chained and used == 0
    assert ahead > 3  # verified from the trees on the device, before their copy reached the host
    assert (accepts == ahead) if graph_acceptance else accepts == 0
    assert chained == unchained


@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_sequences_that_finish_leave_the_others_verified_from_the_device(dirs, tree):
    """A batch whose sequences finish one by one (and near their max_tokens, where the host's copy of a
    tree is cut) still verifies every chained step's trees from the device, the finished sequences'
    trees left out there, and gives the unchained steps' tokens."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 16, 9)]
    unchained = engine(dirs, True, tree)
    unchained.speculation.chain = False
    want = [r.token_ids for r in unchained.generate(PROMPTS, params)]
    eng = engine(dirs, True, tree)
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    got, missed, shrank = {i: [] for i in ids}, 0, 0
    while eng.has_work:
        chained, ahead, running = eng._chained, eng.steps_ahead, len(eng.scheduler.running)
        for ev in eng.step():
            got[ev.seq_id] += ev.token_ids
        if chained is not None:
            missed += eng.steps_ahead == ahead
            shrank += eng.steps_ahead > ahead and running < len(chained.seq_ids)  # one finished, others verified
    assert missed == 0 and eng.steps_ahead > 5 and shrank >= 1
    assert [got[i] for i in ids] == want


def test_warm_up_captures_what_generation_replays(dirs):
    """After the drafter's warm-up (every padded batch of the default tree) and the target's (its
    verification buckets), generating for a shrinking batch captures no graph."""
    eng = engine(dirs, True)
    assert eng.drafter.warm_up(chained=True) > 0
    assert eng.target.runner.warm_up(64, (eng.limits.node_budget + 1,)) > 0
    assert eng.verifier.warm_up(eng.limits.node_budget, eng.limits.depth) > 0
    proposals, draft_graphs, chains = len(eng.drafter._proposals), set(eng.drafter.graphs._graphs), \
        set(eng.drafter._chains)
    assert chains and all(c is not None and c.graph is not None for c in eng.drafter._chains.values())
    target_graphs = set(eng.target.runner.graphs._graphs)
    acceptance_graphs = sum(len(g.followers) for g in eng.target.runner.graphs if g is not None)
    prompts = PROMPTS + [list(range(40, 52))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 16, 9, 30)]  # finishing one by one
    want = [r.token_ids for r in Engine(target_for(dirs[0], device="cuda", dtype="float32")).generate(prompts, params)]
    assert [r.token_ids for r in eng.generate(prompts, params)] == want
    assert len(eng.drafter._proposals) == proposals
    assert set(eng.drafter.graphs._graphs) <= draft_graphs and set(eng.drafter._chains) == chains
    assert set(eng.target.runner.graphs._graphs) == target_graphs
    assert sum(len(g.followers) for g in eng.target.runner.graphs if g is not None) == acceptance_graphs
    assert eng.verifier.graph_accepts > 0


def test_a_prompt_longer_than_the_backlog_graph_goes_in_graphed_rounds(dirs):
    """A 200-token prompt (more rows than a backlog extend graph holds a sequence) is fed to the
    graphed draft in rounds: the same output and acceptance as the eager drafter."""
    prompts = [[(7 * i) % 90 + 1 for i in range(200)], [5, 6, 7]]
    eager, graphed = engine(dirs, False), engine(dirs, True)
    got_eager, got_graphed = eager.generate(prompts, PARAMS), graphed.generate(prompts, PARAMS)
    assert [r.token_ids for r in got_eager] == [r.token_ids for r in got_graphed]
    assert [r.speculation.accepted_tokens for r in got_eager] == [r.speculation.accepted_tokens for r in got_graphed]
    assert 200 > graphed.drafter.graphs.backlog_rows(2) and graphed.drafter.graphs.replays >= 2
