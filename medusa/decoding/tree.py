"""Candidate trees: a tree is data, a list of paths, compiled once to index buffers.

A path ``(a, b, c)`` names a node at depth 3: the rank-``a`` candidate of head 0, under it
the rank-``b`` candidate of head 1, under that the rank-``c`` candidate of head 2 (ranks
are 0-based: ``(0, 1)`` is top-1 of head 0 then top-2 of head 1). Every prefix of a path
must be in the tree too. Node 0 is the root: the token the target itself produced last,
already emitted but not yet in the KV cache.

Nodes are laid out by depth, then lexicographically, so a node's ancestors always come
before it and a root-to-leaf path visits increasing indices.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.errors import MedusaError

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Index tensors for one tree of ``N = 1 + len(paths)`` nodes (root included).

    Attributes:
        paths: the node paths in layout order (root excluded).
        parent: ``[N]`` parent node index, -1 for the root.
        depth: ``[N]`` 0 for the root; the position offset of each node.
        head: ``[N]`` which head proposes the node (``depth - 1``), -1 for the root.
        rank: ``[N]`` the candidate's rank in its head's top-k, -1 for the root.
        ancestor: ``[N, N]`` bool, ``ancestor[i, j]``: node ``j`` is ``i`` or an ancestor of
            ``i`` (the tree attention pattern).
        leaves: ``[P, D + 1]`` for every root-to-leaf path, its node indices from the root,
            padded with -1 after the leaf (``D`` = max depth).
        leaf_depth: ``[P]`` the depth of each leaf.
        topk: how many candidates each head must provide (``max rank + 1``), length ``D``.
    """

    paths: tuple[Path_, ...]
    parent: torch.Tensor
    depth: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    ancestor: torch.Tensor
    leaves: torch.Tensor
    leaf_depth: torch.Tensor
    topk: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return len(self.topk)

    def to(self, device: torch.device | str) -> TreeBuffers:
        move = {n: getattr(self, n).to(device) for n in ("parent", "depth", "head", "rank", "ancestor", "leaves", "leaf_depth")}
        return TreeBuffers(paths=self.paths, topk=self.topk, **move)

    def candidate_index(self) -> torch.Tensor:
        """``[N - 1]`` index of each non-root node into a flattened ``[D, max(topk)]`` top-k table."""
        width = max(self.topk) if self.topk else 1
        return self.head[1:] * width + self.rank[1:]


def _normalise(paths: Iterable[Sequence[int]]) -> list[Path_]:
    out: list[Path_] = []
    for p in paths:
        try:
            t = tuple(int(x) for x in p)
        except (TypeError, ValueError):
            raise MedusaError(f"tree path {p!r} is not a sequence of integers") from None
        if not t:
            raise MedusaError("tree paths must be non-empty: the root is implicit")
        if any(x < 0 for x in t):
            raise MedusaError(f"tree path {t} has a negative rank")
        out.append(t)
    if len(set(out)) != len(out):
        dup = next(p for p in out if out.count(p) > 1)
        raise MedusaError(f"tree path {dup} appears twice")
    have = set(out)
    for p in out:
        if len(p) > 1 and p[:-1] not in have:
            raise MedusaError(f"tree path {p} has no parent {p[:-1]} in the tree: every prefix of a path must be listed")
    return sorted(out, key=lambda p: (len(p), p))


def compile_tree(paths: Iterable[Sequence[int]]) -> TreeBuffers:
    """Turn a list of paths into :class:`TreeBuffers` (pure; CPU tensors)."""
    ordered = _normalise(paths)
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    n = len(ordered) + 1
    parent = torch.full((n,), -1, dtype=torch.long)
    depth = torch.zeros(n, dtype=torch.long)
    head = torch.full((n,), -1, dtype=torch.long)
    rank = torch.full((n,), -1, dtype=torch.long)
    ancestor = torch.eye(n, dtype=torch.bool)
    for p, i in index.items():
        if not p:
            continue
        parent[i] = index[p[:-1]]
        depth[i] = len(p)
        head[i] = len(p) - 1
        rank[i] = p[-1]
        # ancestors of i are its parent's ancestors plus the parent (parents come first)
        ancestor[i] |= ancestor[parent[i]]
    max_depth = int(depth.max())
    children = set(p[:-1] for p in ordered)
    leaf_paths = [p for p in [()] + ordered if p not in children]
    leaves = torch.full((len(leaf_paths), max_depth + 1), -1, dtype=torch.long)
    for row, p in enumerate(leaf_paths):
        for d in range(len(p) + 1):
            leaves[row, d] = index[p[:d]]
    topk = tuple(max(p[d] for p in ordered if len(p) > d) + 1 for d in range(max_depth))
    return TreeBuffers(
        paths=tuple(ordered), parent=parent, depth=depth, head=head, rank=rank, ancestor=ancestor,
        leaves=leaves, leaf_depth=torch.tensor([len(p) for p in leaf_paths], dtype=torch.long), topk=topk,
    )


def chain(length: int) -> list[Path_]:
    """A single chain of ``length`` nodes (draft models and prompt lookup)."""
    return [(0,) * d for d in range(1, length + 1)]


def spelled(paths: Iterable[Path_], tokens: Iterable[int], sequence: Sequence[int]) -> list[Path_]:
    """The nodes of a tree (``paths`` with their ``tokens``, root excluded) whose tokens from the
    root spell the start of ``sequence``, in order: as far as the tree drafted it too."""
    child = {(path[:-1], token): path for path, token in zip(paths, tokens)}
    along: list[Path_] = []
    for token in sequence:
        node = child.get((along[-1] if along else (), token))
        if node is None:
            break
        along.append(node)
    return along


def graft(paths: Iterable[Path_], tokens: Iterable[int], sequences: Iterable[Sequence[int]],
          ) -> tuple[tuple[Path_, ...], dict[Path_, int]]:
    """A tree (``paths`` with their ``tokens``, root excluded) grown by ``sequences``, each a
    continuation of the root: where a sequence starts as the tree already spells it, it shares
    those nodes, and its rest hangs off the deepest one (a new child takes the next free rank).
    Returns the paths (old ones first, then new ones in order) and each path's token."""
    token_of = dict(zip(paths, tokens))
    child = {(path[:-1], token): path for path, token in token_of.items()}
    width: dict[Path_, int] = {}
    for path in token_of:
        width[path[:-1]] = max(width.get(path[:-1], 0), path[-1] + 1)
    for sequence in sequences:
        at: Path_ = ()
        for token in sequence:
            node = child.get((at, token))
            if node is None:
                node = at + (width.get(at, 0),)
                width[at] = node[-1] + 1
                child[(at, token)] = node
                token_of[node] = token
            at = node
    return tuple(token_of), token_of


def load_tree(spec: str | Path | Sequence[Sequence[int]]) -> list[Path_]:
    """A tree from a list of paths, a JSON file (a list, or ``{"paths": [...]}``), or a
    name of a tree shipped in ``medusa/assets/trees`` (e.g. ``"cpu"``)."""
    if not isinstance(spec, (str, Path)):
        return _normalise(spec)
    path = Path(spec)
    if not path.suffix and not path.exists():
        path = TREES_DIR / f"{spec}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in TREES_DIR.glob("*.json")))
        raise MedusaError(f"tree {spec!r} not found: give a JSON file of paths or one of: {names}")
    data = json.loads(path.read_text())
    return _normalise(data["paths"] if isinstance(data, dict) else data)


TREES_DIR = Path(__file__).resolve().parent.parent / "assets" / "trees"


def tree_key(device_type: str, dtype: torch.dtype) -> str:
    """The key of a calibrated tree in calibration.json: the pass cost, hence the best tree,
    depends on the device and the dtype. float32 keeps the bare device type (files written
    before dtypes were told apart); other dtypes add theirs, e.g. ``"cpu-bfloat16"``."""
    return device_type if dtype == torch.float32 else f"{device_type}-{str(dtype).removeprefix('torch.')}"


def chain_tree(trees: dict[int, TreeBuffers], k: int, device: torch.device) -> TreeBuffers:
    """The compiled chain of ``k`` candidates, built once per length."""
    if k not in trees:
        trees[k] = compile_tree(chain(k)).to(device)
    return trees[k]
