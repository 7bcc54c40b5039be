"""Tree shapes, and the arithmetic that sizes every buffer a tree touches, defined once.

``TreeSettings`` is the shape of one proposal. The verify service holds one as its *limits*:
its default tree and the most a request may ask for (``request``). The draft's own settings
(which head, a static tree's file) are ``draft_service.spec_config.SpecConfig``, built on the
same ``TreeSettings``.

Sizes, for limits of depth D, top-k K and max_nodes M (the root is the sequence's newest
token, never counted among the nodes)::

    node_budget       nodes one tree of this shape may hold        chain: D, else M
    max_tree_nodes    nodes of any tree a request may ask for       max(M, D): a chain of D may exceed M
    tree_kv_slots     target KV slots a tree step occupies          max_tree_nodes + 1 (root + nodes)
    feature_rows      feature rows one step may feed the draft      prefill tokens + per sequence D + 2
                                                                    (pending feature, root, D accepted)
    draft_tree_rows   draft KV rows while growing one tree          K * D + node_budget (fed levels)
    draft_positions   draft RoPE positions beyond the context       D + 1
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import InvalidRequestError

TREE_KINDS = ("dynamic", "static", "chain")
MAX_DEPTH = 32
MAX_TOP_K = 64
MAX_NODES = 512
# The default tree: on round 4 of the shipped SmolLM2 head, depth 7 / top-k 10 gave MT-bench tau 4.05 against
# 3.94 for depth 6 / top-k 8 at the same 59 nodes, and 64.0 against 59.4 tok/s at batch 1 (H200, bf16).
DEFAULT_TREE, DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_NODES = "dynamic", 7, 10, 59
DEFAULT_EVAL_CONFIGS = (f"{DEFAULT_TREE}:{DEFAULT_DEPTH}:{DEFAULT_TOP_K}:{DEFAULT_NODES}", "chain:3", "chain:5")


@dataclass(frozen=True, slots=True)
class TreeSettings:
    """The shape one proposal may take, validated on construction.

    ``dynamic``: EAGLE-2 tree, ``depth`` levels, ``top_k`` children per expanded node, the best
    ``max_nodes`` kept. ``static``: a fixed set of paths (the draft's file). ``chain``: one path
    of ``depth`` tokens. ``max_nodes`` excludes the root.
    """

    tree: str = DEFAULT_TREE
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    max_nodes: int = DEFAULT_NODES

    def __post_init__(self):
        if self.tree not in TREE_KINDS:
            raise InvalidRequestError("tree", f"must be one of {', '.join(TREE_KINDS)}, got {self.tree!r}")
        for name, value, hi in (("depth", self.depth, MAX_DEPTH), ("top_k", self.top_k, MAX_TOP_K),
                                ("max_nodes", self.max_nodes, MAX_NODES)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
                raise InvalidRequestError(name, f"must be an integer in [1, {hi}], got {value!r}")

    def describe(self) -> str:
        """"a chain of 3", "a dynamic tree 7/10/59" (depth / top-k / nodes), "a static tree"."""
        if self.tree == "chain":
            return f"a chain of {self.depth}"
        return "a static tree" if self.tree == "static" else \
            f"a dynamic tree {self.depth}/{self.top_k}/{self.max_nodes} (depth/top-k/nodes)"

    @property
    def node_budget(self) -> int:
        """Most nodes one tree of this shape holds."""
        return self.depth if self.tree == "chain" else self.max_nodes

    def capped(self, nodes: int) -> "TreeSettings":
        """This shape cut to at most ``nodes`` nodes (>= 1), as adaptive speculation asks for it.

        A chain gets shorter. A dynamic tree keeps its best ``nodes`` nodes and grows at most
        ``nodes`` levels: a set of n best nodes closed under ancestors is never deeper than n, and the
        levels it grows are the same as the full tree's, so it is exactly the full tree's best
        ``nodes`` (the draft runs fewer levels). A static tree is the draft's file: unchanged.
        With ``EAGLE3_TREE_LEVELS`` (``level_cap``, an experiment: off by default) a dynamic tree below
        the budget grows at most the levels set for its size: its best ``nodes`` nodes among those
        that deep, which may differ from the full tree's best ``nodes``.
        """
        assert nodes >= 1, nodes
        if self.tree == "static" or nodes >= self.node_budget:
            return self
        if self.tree == "chain":
            return TreeSettings("chain", nodes, self.top_k, self.max_nodes)
        return TreeSettings("dynamic", min(self.depth, nodes, level_cap(nodes) or nodes), self.top_k, nodes)

    @property
    def max_tree_nodes(self) -> int:
        """As limits: most nodes of any tree a request may ask for (a chain of ``depth`` included)."""
        return max(self.max_nodes, self.depth)

    @property
    def tree_kv_slots(self) -> int:
        """As limits: target KV slots one tree step occupies beyond the committed tokens (root + nodes)."""
        return self.max_tree_nodes + 1

    def feature_rows(self, max_batch_tokens: int, max_num_seqs: int) -> int:
        """As limits: the most feature rows one step may feed the draft (prefill chunks, then per
        decoding sequence a pending feature, the root and up to ``depth`` accepted nodes)."""
        return max_batch_tokens + max_num_seqs * (self.depth + 2)

    @property
    def draft_tree_rows(self) -> int:
        """Draft KV rows a proposal of this shape may occupy while its levels are fed."""
        return self.top_k * self.depth + self.node_budget

    @property
    def draft_positions(self) -> int:
        """RoPE positions the draft needs beyond the context: a depth-``depth`` node sits past it."""
        return self.depth + 1

    def request(self, tree: str | None = None, depth: int | None = None, top_k: int | None = None,
                max_nodes: int | None = None) -> "TreeSettings":
        """As limits: a request's tree. Unset values take the limits; set ones must stay within them.

        A static tree is the draft's file, so a request may ask for it only when configured;
        a chain is a static tree too, available from any configuration.
        """
        kind = tree or self.tree
        if kind not in TREE_KINDS or (kind == "static" and self.tree != "static"):
            allowed = ", ".join(k for k in TREE_KINDS if k != "static" or self.tree == "static")
            raise InvalidRequestError("speculation.tree", f"must be one of {allowed}, got {kind!r}")
        chosen = {}
        for name, value, limit in (("depth", depth, self.depth), ("top_k", top_k, self.top_k),
                                   ("max_nodes", max_nodes, self.max_nodes)):
            if value is not None and not 1 <= value <= limit:
                raise InvalidRequestError(f"speculation.{name}", f"must be in [1, {limit}] (server limit), got {value}")
            chosen[name] = limit if value is None else value
        return TreeSettings(kind, **chosen)


# The default tree by device: what was measured faster there. On a CPU (SmolLM2, fp32, batch 1,
# MT-bench) a chain of 3 gave 1.10x target-only in one process and 1.27x through the services,
# the dynamic tree 0.64x and 0.80x (benchmarks/results/cpu_speculation_*).
CPU_DEFAULT_TREE = TreeSettings("chain", 3)


def default_tree(device_type: str) -> TreeSettings:
    """The default tree for a device type ("cuda", "cpu")."""
    return TreeSettings() if device_type == "cuda" else CPU_DEFAULT_TREE


def add_tree_arguments(p, limits: bool = False, static_file: bool = True) -> None:
    """``--tree``, ``--tree-depth``, ``--tree-top-k``, ``--tree-nodes`` (unset: the device's default
    tree), and ``--static-tree`` where ``static_file`` (the side that builds trees reads it).
    ``limits``: the values are also the most a request may ask for (the verify service's)."""
    also = " (default and most a request may ask for)" if limits else ""
    gpu = f"{DEFAULT_TREE} {DEFAULT_DEPTH}/{DEFAULT_TOP_K}/{DEFAULT_NODES}"
    p.add_argument("--tree", default=None, choices=list(TREE_KINDS),
                   help=f"tree kind{also}. Without any tree flag: {gpu} (depth/top-k/nodes) on a GPU, a chain "
                        f"of {CPU_DEFAULT_TREE.depth} on a CPU (measured fastest there); with some, {gpu} for "
                        "the rest")
    p.add_argument("--tree-depth", type=int, default=None, help="tree depth (chain length)" + also)
    p.add_argument("--tree-top-k", type=int, default=None, help="children per expanded node" + also)
    p.add_argument("--tree-nodes", type=int, default=None, help="nodes verified per step, root excluded" + also)
    if static_file:
        p.add_argument("--static-tree", default=None, help='JSON file {"paths": [[0], [1], [0, 0], ...]} (tree "static")')


def tree_settings_from_args(args, device_type: str) -> TreeSettings:
    """The ``add_tree_arguments`` flags as validated settings. With no tree flag given, the device's
    default tree; otherwise the flags given, and the GPU defaults (above) for the rest."""
    given = {field: getattr(args, attr) for field, attr in
             (("tree", "tree"), ("depth", "tree_depth"), ("top_k", "tree_top_k"), ("max_nodes", "tree_nodes"))}
    if all(v is None for v in given.values()):
        return default_tree(device_type)
    return TreeSettings(**{k: v for k, v in given.items() if v is not None})


# The dynamic tree sizes the adaptive policy picks from (``EAGLE3_TREE_SIZES``, read at import; the
# verify service prices and captures them, the draft service captures them: set it alike for both).
# ``tiles`` (the default): 1, 3, 7, 15, ... nodes, whose trees with their root are 2, 4, 8, 16, ...
# query tokens and fill whole row tiles of the attention kernels where a KV head has 4 query heads
# (Llama 3 8B: 16 tokens are one 64-row tile, 17 two). ``powers``: 1, 2, 4, 8, ... nodes. On an H200
# the 8B's exact tree attention over 32K keys took 95.3 us a layer for 16 tokens against 147.1 for 17
# (``attention_kernel.py``, exact_mode/tree_wide_floor_h200_7cfbb22.json); through the policy, with
# acceptance replayed from MT-bench (``replay_gates.py --exact --adaptive``, replay/sizes_h200_7cfbb22/),
# tiles / powers ran 2.276x / 1.871x target-only at 32K batch 1, 2.539x / 2.508x at 4K batch 1 and
# 1.252x / 1.368x at 16K batch 4.
TREE_SIZES = os.environ.get("EAGLE3_TREE_SIZES", "tiles")
_SIZE_STEPS = {"powers": (1, 2, 4, 8, 16, 32, 64, 128, 256), "tiles": (1, 3, 7, 15, 31, 63, 127, 255)}
if TREE_SIZES not in _SIZE_STEPS:
    raise ValueError(f"EAGLE3_TREE_SIZES={TREE_SIZES!r}: one of {sorted(_SIZE_STEPS)}")


def parse_tree_levels(text: str) -> tuple[tuple[int, int], ...]:
    """``EAGLE3_TREE_LEVELS``: "SIZE:LEVELS[,SIZE:LEVELS...]" (each a whole number >= 1) ->
    ((size, levels), ...) by size; "" -> (). Anything else raises ValueError."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        size, sep, levels = part.partition(":")
        if not sep or not size.isdigit() or not levels.isdigit() or int(size) < 1 or int(levels) < 1:
            raise ValueError(f"EAGLE3_TREE_LEVELS={text!r}: {part!r} is not SIZE:LEVELS (whole numbers >= 1)")
        pairs.append((int(size), int(levels)))
    return tuple(sorted(pairs))


# Levels a dynamic tree below the budget grows at most, by its size (``EAGLE3_TREE_LEVELS``, read at
# import; the verify service prices and asks for the trees, the draft service captures their levels:
# set it alike for both). "7:4,15:5": a tree of at most 7 nodes grows at most 4 levels, one of at most
# 15 at most 5. Off ("") by default: a tree of n nodes grows min(depth, n) levels, so every size of 7
# nodes or more runs the draft's 7 levels. What a cut costs in acceptance, from a recorded trace:
# ``benchmarks/policy_replay.py depths`` (MT-bench, the shipped head: a 7-node tree accepts 2.343 nodes
# a step at 7 levels, at least 2.012 at 4). An experiment until measured on the GPU.
TREE_LEVELS = parse_tree_levels(os.environ.get("EAGLE3_TREE_LEVELS", ""))


def level_cap(nodes: int, levels: tuple[tuple[int, int], ...] | None = None) -> int | None:
    """The most levels a dynamic tree of ``nodes`` nodes below the budget grows under ``levels``
    (default ``TREE_LEVELS``): the least LEVELS of the entries whose SIZE holds it; None: no cap."""
    caps = [lv for size, lv in (TREE_LEVELS if levels is None else levels) if nodes <= size]
    return min(caps) if caps else None


def tree_sizes(limits: TreeSettings, steps: str | None = None) -> tuple[int, ...]:
    """Node counts the policy picks from: every chain length; the ``steps`` (default ``TREE_SIZES``)
    below the budget and the budget of a dynamic tree; a static tree whole (the draft's file cannot
    be cut)."""
    budget = limits.node_budget
    if limits.tree == "chain":
        return tuple(range(1, budget + 1))
    if limits.tree == "static":
        return (budget,)
    return tuple(sorted({n for n in _SIZE_STEPS[steps or TREE_SIZES] if n < budget} | {budget}))
