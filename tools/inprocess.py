"""One-process composition: the target with (optionally) the EAGLE-3 drafter beside it, in one Engine."""

from __future__ import annotations

from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from common.tree_settings import tree_sizes
from verify_service.adaptive import AdaptivePolicy, PolicyConfig, policy_for
from verify_service.config import EngineConfig
from verify_service.engine import Engine
from verify_service.target import Target


def build_engine(cfg: EngineConfig, spec: SpecConfig | None = None, adaptive: bool = False,
                 cost_table: str | None = None, policy_config: PolicyConfig | None = None,
                 policy: AdaptivePolicy | None = None) -> Engine:
    """Load the target (and the draft head when ``spec`` is given) and wire them together.

    The draft is checked against the target (vocabulary, hidden size, captured layers)
    before anything runs; a mismatch raises CheckpointError instead of decoding badly.
    ``adaptive``: pick each step's tree size from measured costs (``verify_service/adaptive.py``;
    the cost table is read from ``cost_table`` when it exists, else measured now and written there;
    ``policy_config``: its settings, default ``PolicyConfig()``). ``policy``: a policy object to use as
    it is instead, warmed up for the default tree alone (a benchmark's recorder that always picks it).
    """
    target = Target.from_config(cfg)
    if spec is None:  # warmed up as the speculative engines below are: the same graphs (prompt ones too)
        target.runner.warm_up(cfg.max_batch_tokens)
        return Engine(target)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           cfg.max_num_seqs, target.max_model_len, cfg.kernels)
    if adaptive and policy is None:
        policy = policy_for(target, spec.settings, cost_table, policy_config or PolicyConfig())
    engine = Engine(target, drafter, spec.settings, policy)
    # As the services do at start-up: no graph capture in the middle of generation, for the default
    # tree and, with the policy, every size it may pick.
    sizes = tree_sizes(spec.settings) if adaptive else (spec.settings.node_budget,)
    drafter.warm_up([spec.settings.capped(n) for n in sizes] if adaptive else None,
                    engine.feed_buffer.max_rows or cfg.max_batch_tokens, chained=True)
    target.runner.warm_up(cfg.max_batch_tokens, tuple(n + 1 for n in sizes))
    engine.verifier.warm_up(spec.settings.node_budget, spec.settings.depth)  # chained steps' acceptance graphs
    return engine
