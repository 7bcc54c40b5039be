"""Static tree shapes (EAGLE/Medusa "choices"), read from a JSON file of rank paths."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from common.errors import InvalidRequestError, ModelNotFoundError


def _bad_spec(message: str) -> InvalidRequestError:
    return InvalidRequestError("static_tree", message)


@dataclass(frozen=True)
class StaticLevel:
    """What one depth of a static tree needs at run time (pool indices follow spec order)."""

    depth: int
    top_k: int  # children to propose per fed node: the level's highest rank + 1
    rank: tuple[int, ...]  # per node of the level: its rank among its parent's children
    parent: tuple[int, ...]  # per node: parent's pool index, -1 at depth 1
    parent_slot: tuple[int, ...]  # per node: parent's index in the previous frontier, -1 at depth 1
    frontier: tuple[int, ...]  # pool indices of the level's nodes that have children
    frontier_parent_slot: tuple[int, ...]  # their parents' indices in the previous frontier


@dataclass(frozen=True)
class StaticTreeSpec:
    """A fixed tree shape: each path lists the child RANK at each depth (0 = most likely).

    ``paths`` is in spec order: by depth, then lexicographically, so parents precede children
    and siblings follow rank order. JSON file: ``{"paths": [[0], [1], [0, 0], ...]}``.
    """

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths) -> "StaticTreeSpec":
        """Validate (non-empty paths of ranks >= 0, prefix-closed, no duplicates) and sort."""
        if not isinstance(paths, (list, tuple)) or not paths:
            raise _bad_spec("paths must be a non-empty list of paths")
        for p in paths:
            if (not isinstance(p, (list, tuple)) or not p
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)):
                raise _bad_spec(f"path {p!r} must be a non-empty list of integer ranks >= 0")
        tuples = [tuple(p) for p in paths]
        known = set(tuples)
        if len(known) != len(tuples):
            raise _bad_spec("paths must not repeat")
        orphan = next((p for p in tuples if len(p) > 1 and p[:-1] not in known), None)
        if orphan is not None:
            raise _bad_spec(f"path {list(orphan)} needs its prefix {list(orphan[:-1])} as a path too")
        return cls(tuple(sorted(tuples, key=lambda p: (len(p), p))))

    @classmethod
    def from_file(cls, path: str | Path) -> "StaticTreeSpec":
        try:
            data = json.loads(Path(path).read_bytes())
        except FileNotFoundError:
            raise ModelNotFoundError(f"static tree file {path} does not exist") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise _bad_spec(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or "paths" not in data:
            raise _bad_spec(f'{path} must hold an object {{"paths": [[rank, ...], ...]}}')
        return cls.from_paths(data["paths"])

    @classmethod
    def chain(cls, depth: int) -> "StaticTreeSpec":
        """[[0], [0, 0], ...]: the draft's greedy path, ``depth`` tokens long."""
        return cls.from_paths([[0] * d for d in range(1, depth + 1)])

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    def check_vocab(self, draft_vocab: int) -> None:
        top = max(max(p) for p in self.paths)
        if top >= draft_vocab:
            raise _bad_spec(f"rank {top} needs a draft vocabulary larger than {draft_vocab}")

    @cached_property
    def levels(self) -> tuple[StaticLevel, ...]:
        index = {p: i for i, p in enumerate(self.paths)}
        has_children = {p[:-1] for p in self.paths}
        prev_slot: dict[tuple[int, ...], int] = {}  # path -> index in the previous frontier
        levels = []
        for d in range(1, self.depth + 1):
            nodes = [p for p in self.paths if len(p) == d]
            front = [p for p in nodes if p in has_children]
            levels.append(StaticLevel(
                d, max(p[-1] for p in nodes) + 1, tuple(p[-1] for p in nodes),
                tuple(index.get(p[:-1], -1) for p in nodes), tuple(prev_slot.get(p[:-1], -1) for p in nodes),
                tuple(index[p] for p in front), tuple(prev_slot.get(p[:-1], -1) for p in front)))
            prev_slot = {p: s for s, p in enumerate(front)}
        return tuple(levels)
