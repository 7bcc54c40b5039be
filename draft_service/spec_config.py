"""The draft's own speculation settings: which head, which tree, validated before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidRequestError, ModelNotFoundError
from common.tree_settings import DEFAULT_DEPTH, DEFAULT_NODES, DEFAULT_TOP_K, DEFAULT_TREE, TreeSettings
from hub.default_model import shipped_head_dir

DEFAULT_DRAFT = "default"  # the EAGLE-3 head shipped for the embedded default target


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How the draft proposes candidates each step: the head at ``draft_path`` and its default tree.

    The tree fields are ``TreeSettings``' (``settings``); a static tree reads its paths
    (child ranks) from ``static_tree_file``. ``"default"`` names the head shipped for the
    embedded SmolLM2-135M-Instruct. In one process the same settings are also the limits a
    request's tree must stay within.
    """

    draft_path: str
    tree: str = DEFAULT_TREE
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    max_nodes: int = DEFAULT_NODES
    static_tree_file: str | None = None

    def __post_init__(self):
        self.settings  # validates the tree fields
        if self.draft_path == DEFAULT_DRAFT:
            object.__setattr__(self, "draft_path", str(shipped_head_dir()))
        if not Path(self.draft_path).is_dir():
            raise ModelNotFoundError(f"draft directory {self.draft_path!r} does not exist")
        if self.tree == "static":
            if not self.static_tree_file:
                raise InvalidRequestError("static_tree_file", "a static tree needs a file of paths")
            if not Path(self.static_tree_file).is_file():
                raise ModelNotFoundError(f"static tree file {self.static_tree_file!r} does not exist")
        elif self.static_tree_file:
            raise InvalidRequestError("static_tree_file", f"only used with tree='static', not {self.tree!r}")

    @property
    def settings(self) -> TreeSettings:
        return TreeSettings(self.tree, self.depth, self.top_k, self.max_nodes)
