"""Speculative decoding configuration, validated up front (before any model is loaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidRequestError, ModelNotFoundError

DEFAULT_DRAFT = "default"  # the EAGLE-3 head shipped for the embedded default target


def default_draft_dir() -> Path:
    """The shipped head for SmolLM2-135M-Instruct (``draft_service/heads/``, in the package)."""
    return Path(__file__).resolve().parent.parent / "draft_service" / "heads" / "smollm2-135m-instruct"

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
    """The shape one proposal may take (a request may ask for less than the server's)."""

    tree: str
    depth: int
    top_k: int
    max_nodes: int

    @property
    def node_budget(self) -> int:
        return self.depth if self.tree == "chain" else self.max_nodes


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How the draft proposes candidates each step.

    ``dynamic``: EAGLE-2 tree, ``depth`` levels, ``top_k`` children per expanded node, the
    best ``max_nodes`` kept. ``static``: the paths in ``static_tree_file`` (child ranks).
    ``chain``: one path of ``depth`` tokens. ``max_nodes`` excludes the root, so a step
    verifies at most ``max_nodes + 1`` tokens per sequence. ``draft_path`` is None where only
    the tree settings matter (the verify service's limits; the head lives in the draft service);
    ``"default"`` names the head shipped for the embedded SmolLM2-135M-Instruct.
    """

    draft_path: str | None
    tree: str = DEFAULT_TREE
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    max_nodes: int = DEFAULT_NODES
    static_tree_file: str | None = None

    def __post_init__(self):
        if self.tree not in TREE_KINDS:
            raise InvalidRequestError("tree", f"must be one of {', '.join(TREE_KINDS)}, got {self.tree!r}")
        for name, value, hi in (("depth", self.depth, MAX_DEPTH), ("top_k", self.top_k, MAX_TOP_K),
                                ("max_nodes", self.max_nodes, MAX_NODES)):
            if not isinstance(value, int) or not 1 <= value <= hi:
                raise InvalidRequestError(name, f"must be an integer in [1, {hi}], got {value!r}")
        if self.draft_path == DEFAULT_DRAFT:
            object.__setattr__(self, "draft_path", str(default_draft_dir()))
        if self.draft_path is not None and not Path(self.draft_path).is_dir():
            raise ModelNotFoundError(f"draft directory {self.draft_path!r} does not exist")
        if self.tree == "static" and self.draft_path is not None:  # the draft side reads the file
            if not self.static_tree_file:
                raise InvalidRequestError("static_tree_file", "a static tree needs a file of paths")
            if not Path(self.static_tree_file).is_file():
                raise ModelNotFoundError(f"static tree file {self.static_tree_file!r} does not exist")
        elif self.tree != "static" and self.static_tree_file:
            raise InvalidRequestError("static_tree_file", f"only used with tree='static', not {self.tree!r}")

    @property
    def node_budget(self) -> int:
        """Most nodes a tree of this configuration can hold (sizes the KV reservation)."""
        return self.defaults().node_budget

    def defaults(self) -> TreeSettings:
        return TreeSettings(self.tree, self.depth, self.top_k, self.max_nodes)

    def request_settings(self, tree: str | None = None, depth: int | None = None, top_k: int | None = None,
                         max_nodes: int | None = None) -> TreeSettings:
        """A request's tree: unset values take the defaults; set ones must stay within them.

        A static tree is the server's file, so a request may ask for it only when configured;
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


def add_tree_arguments(p, limits: bool = False, static_file: bool = True) -> None:
    """``--tree``, ``--tree-depth``, ``--tree-top-k``, ``--tree-nodes`` with the defaults above, and
    ``--static-tree`` where ``static_file`` (the side that builds trees reads it). ``limits``: the
    values are also the most a request may ask for (the verify service's)."""
    also = " (default and most a request may ask for)" if limits else ""
    p.add_argument("--tree", default=DEFAULT_TREE, choices=list(TREE_KINDS), help="tree kind" + also)
    p.add_argument("--tree-depth", type=int, default=DEFAULT_DEPTH, help="tree depth (chain length)" + also)
    p.add_argument("--tree-top-k", type=int, default=DEFAULT_TOP_K, help="children per expanded node" + also)
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_NODES, help="nodes verified per step, root excluded" + also)
    if static_file:
        p.add_argument("--static-tree", default=None, help='JSON file {"paths": [[0], [1], [0, 0], ...]} (tree "static")')
