"""Lookahead decoding: the target drafts for itself from its own Jacobi iterations.

Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"
(ICML 2024). No heads, no draft model: each target pass runs, beside the root,

* the **lookahead branch**, a window of ``W`` columns by ``N - 1`` levels of guessed future
  tokens (:class:`~medusa.decoding.state.SideRows`: not candidates, their KV entries are
  dropped). One pass is one Jacobi iteration: the newest level's outputs become the next
  level, the oldest is dropped, and each column's trajectory (its tokens down the levels plus
  the new output) is an ``N``-gram that goes into the pool;
* the **verification branch**: up to ``G`` pool n-grams that start with the root, as a trie
  of candidates; greedy verification keeps the longest path the target agrees with, so the
  output is the target's own greedy text.

Level 0's column 0 is the root itself, so the window restarts from the text each pass (its
first column is the target's own guess of the continuation). Column ``i`` of level ``j`` sits
``i + j`` positions after the root and sees the root, level 0's columns up to ``i`` and its own
column's earlier levels: a causal sequence of consecutive positions, whose output guesses the
token after it (docs/lookahead.md draws it).
The pool also takes every ``N``-gram of the text (the prompt and the answer so far), as
prompt lookup would, and lives in the decode state (``state.carry``): a chat's next turn keeps it.
"""

from __future__ import annotations

import functools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from medusa.decoding.state import DecodeState, Proposal, Proposer, SideRows, StepOutcome
from medusa.decoding.tree import TreeBuffers, compile_tree, graft
from medusa.errors import MedusaError

POOL_KEY = "lookahead"  # the pool's entry in DecodeState.carry
MAX_KEYS = 65536  # first tokens the pool remembers n-grams for (least recently added go first)


class NgramPool:
    """N-grams by their first token: for each key, up to ``per_key`` continuations of
    ``n - 1`` tokens, most recently added last; adding one again makes it the newest, and
    past ``per_key`` the oldest goes. Past ``max_keys`` keys the least recently added key goes."""

    def __init__(self, n: int, per_key: int, max_keys: int = MAX_KEYS) -> None:
        if n < 2 or per_key < 1 or max_keys < 1:
            raise MedusaError(f"an n-gram pool needs n >= 2, per_key >= 1 and max_keys >= 1, got {n}, {per_key}, {max_keys}")
        self.n, self.per_key, self.max_keys = n, per_key, max_keys
        self.grams: OrderedDict[int, OrderedDict[tuple[int, ...], None]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self.grams.values())

    def add(self, gram: Sequence[int]) -> None:
        """Add one ``n``-gram (its first token is the key)."""
        if len(gram) != self.n:
            raise ValueError(f"the pool holds {self.n}-grams, got {len(gram)} tokens")
        key, rest = gram[0], tuple(gram[1:])
        kept = self.grams.get(key)
        if kept is None:
            kept = self.grams[key] = OrderedDict()
            if len(self.grams) > self.max_keys:
                self.grams.popitem(last=False)
        else:
            self.grams.move_to_end(key)
        kept[rest] = None
        kept.move_to_end(rest)
        if len(kept) > self.per_key:
            kept.popitem(last=False)

    def add_text(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every ``n``-gram of ``tokens`` that ends after position ``start``."""
        for end in range(max(start, self.n - 1) + 1, len(tokens) + 1):
            self.add(tokens[end - self.n:end])

    def lookup(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` continuations of ``key``, newest first."""
        kept = self.grams.get(key)
        if not kept:
            return []
        out = []
        for rest in reversed(kept):
            if len(out) == limit:
                break
            out.append(rest)
        return out

    def copy(self) -> NgramPool:
        twin = NgramPool(self.n, self.per_key, self.max_keys)
        twin.grams = OrderedDict((k, OrderedDict(v)) for k, v in self.grams.items())
        return twin


@dataclass(frozen=True)
class LookaheadSize:
    """``window`` W columns, ``ngram`` N (N - 1 levels; candidates N - 1 tokens deep),
    ``guesses`` G pool n-grams verified per pass, and why they were chosen. A pass runs the
    root, ``G`` candidates of ``N - 1`` tokens and the window but its root: ``(W + G)(N - 1)`` rows."""

    window: int
    ngram: int
    guesses: int
    reason: str = ""

    @property
    def rows(self) -> int:
        """The largest pass, root included."""
        return (self.window + self.guesses) * (self.ngram - 1)


# (W, N, G, expected tokens per pass), smallest first. The expectations are mean tokens per
# pass measured with the embedded SmolLM2-135M-Instruct, greedy, on the first MT-Bench question
# of each category (96 new tokens; docs/lookahead.md); only their ratios to the pass costs
# decide, so a curve measured on any machine still ranks the sizes.
LADDER = ((1, 3, 1, 1.20), (2, 3, 2, 1.32), (3, 3, 3, 1.42), (4, 3, 4, 1.45), (5, 4, 5, 1.56),
          (7, 4, 7, 1.59), (10, 5, 10, 1.65), (15, 5, 15, 1.76))
DEFAULTS = {"cpu": (4, 3, 4), "cuda": (15, 5, 15)}  # no measured curve: by device type


def pass_ms(cost_ms: dict[int, float], n: int) -> float:
    """``T(n)`` from measured points: piecewise linear, and past the largest the last two
    points' slope (a GPU's flat curve stays flat, a CPU's rising one keeps rising)."""
    xs = sorted(cost_ms)
    if n <= xs[0]:
        return cost_ms[xs[0]]
    if n >= xs[-1]:
        slope = 0.0 if len(xs) < 2 else (cost_ms[xs[-1]] - cost_ms[xs[-2]]) / (xs[-1] - xs[-2])
        return cost_ms[xs[-1]] + max(slope, 0.0) * (n - xs[-1])
    b = next(x for x in xs if x >= n)
    a = max(x for x in xs if x <= n)
    return cost_ms[a] if a == b else cost_ms[a] + (cost_ms[b] - cost_ms[a]) * (n - a) / (b - a)


def size_lookahead(cost_ms: dict[int, float] | None, device_type: str, max_rows: int | None = None) -> LookaheadSize:
    """W, N, G for a device whose target pass over ``n`` new tokens costs ``cost_ms[n]``
    milliseconds (None: not measured; then by device type). Pure: the rung of :data:`LADDER`
    with the most expected tokens per millisecond, among those of at most ``max_rows`` rows."""
    fits = [r for r in LADDER if max_rows is None or (r[0] + r[2]) * (r[1] - 1) <= max_rows] or [LADDER[0]]
    if not cost_ms:
        w, n, g = DEFAULTS.get(device_type, DEFAULTS["cpu"])
        if max_rows is not None and (w + g) * (n - 1) > max_rows:
            w, n, g, _ = fits[-1]
        return LookaheadSize(w, n, g, f"default for {device_type} (no measured pass costs)")

    def rate(rung) -> float:
        w, n, g, tau = rung
        return tau / pass_ms(cost_ms, (w + g) * (n - 1))

    w, n, g, tau = max(fits, key=rate)
    rows = (w + g) * (n - 1)
    return LookaheadSize(w, n, g, f"sized here: W={w} N={n} G={g} ({rows} rows, {tau:.2f} tokens/pass expected, "
                                  f"T({rows})/T(1)={pass_ms(cost_ms, rows) / pass_ms(cost_ms, 1):.2f})")


def trie(grams: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, ...], ...], dict[tuple[int, ...], int]]:
    """The candidates' tree: each n-gram a root-to-node path, shared prefixes shared. Returns
    the paths (a child's rank: its order of first appearance) and each path's token."""
    return graft((), (), grams)


@functools.lru_cache(maxsize=1024)
def cached_tree(paths: tuple[tuple[int, ...], ...], device: str) -> TreeBuffers:
    return compile_tree(paths).to(device)


@functools.lru_cache(maxsize=256)
def window_layout(levels: int, width: int, n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Where the window's rows go after ``n`` candidates (root first): level 0's columns 1..W-1
    (its column 0 is the root, row 0), then levels 1..``levels - 1``, ``width`` columns each.
    Returns ``depth`` ``[E]`` (level ``j``, column ``i``: ``i + j``) and ``sees`` ``[E, n + E]``:
    the root, level 0's columns up to ``i``, and column ``i`` of levels 1..``j``."""
    e = levels * width - 1

    def row(j: int, i: int) -> int:  # the pass row of level j, column i
        return 0 if j == i == 0 else n + j * width + i - 1

    sees = torch.zeros(e, n + e, dtype=torch.bool)
    depth = torch.zeros(e, dtype=torch.long)
    for j in range(levels):
        for i in range(width):
            if j == i == 0:
                continue
            r = row(j, i) - n
            depth[r] = i + j
            sees[r, [row(0, k) for k in range(i + 1)]] = True
            sees[r, [row(k, i) for k in range(1, j + 1)]] = True
    return depth.to(device), sees.to(device)


class LookaheadProposer(Proposer):
    """Mode lookahead (see the module docstring): greedy only."""

    greedy_only = True

    def __init__(self, device: torch.device, size: LookaheadSize, text: bool = True) -> None:
        if size.window < 1 or size.ngram < 3 or size.guesses < 0:
            raise MedusaError(f"lookahead needs window >= 1, ngram >= 3 and guesses >= 0, "
                              f"got W={size.window}, N={size.ngram}, G={size.guesses}")
        self.device, self.size, self.text = device, size, text
        self.max_rows = size.rows
        self.min_rows = size.window * (size.ngram - 1)  # the window alone: no n-gram in the pool
        self.pool = NgramPool(size.ngram, max(size.guesses, 1))
        self.levels: list[list[int]] = []  # oldest first, ``window`` tokens each; [0][0] is the root's place
        self.iterations = 0  # Jacobi iterations run: until N - 2, the oldest level is still a guess of context
        self.indexed = 0  # text n-grams ending at or before this position are in the pool

    def describe(self) -> str:
        s = self.size
        return f"lookahead (window {s.window}, {s.ngram}-grams, {s.guesses} guesses: up to {s.rows} rows)"

    def begin(self, state: DecodeState) -> None:
        if not state.sampling.greedy:
            raise MedusaError("mode 'lookahead' is greedy-only: use temperature=0, or a sampling mode such as 'lookup'")
        carried = state.carry.get(POOL_KEY)
        fits = isinstance(carried, NgramPool) and carried.n == self.size.ngram and carried.per_key == self.pool.per_key
        # a copy: an earlier state that another generation branches from keeps its own pool
        self.pool = carried.copy() if fits else NgramPool(self.size.ngram, self.pool.per_key)
        state.carry[POOL_KEY] = self.pool
        self.indexed = 0
        if self.text:
            self.pool.add_text(state.tokens)
            self.indexed = len(state.tokens)
        # the levels start as tokens of the context (any guess converges; these often recur)
        pick = random.Random(len(state.tokens))
        self.levels = [pick.choices(state.tokens, k=self.size.window) for _ in range(self.size.ngram - 1)]
        self.iterations = 0

    def guesses(self, state: DecodeState) -> list[tuple[int, ...]]:
        """Up to G pool n-grams that start with the root (without it), cut to the budget."""
        depth = state.max_depth(self.size.ngram - 1)
        return [g[:depth] for g in self.pool.lookup(state.tokens[-1], self.size.guesses)] if depth else []

    def window(self, nodes: int) -> SideRows:
        """The Jacobi window as side rows after a tree of ``nodes`` candidates (root included)."""
        w = self.size.window
        rows, sees = window_layout(len(self.levels), w, nodes, str(self.device))
        window = [t for level in self.levels for t in level][1:]  # level 0's column 0 is the root (row 0)
        return SideRows(tokens=torch.tensor(window, device=self.device), depth=rows, sees=sees,
                        reach=len(self.levels) + w - 2)

    def propose(self, state: DecodeState) -> Proposal:
        paths, token_of = trie(self.guesses(state))
        tree = cached_tree(paths, str(self.device))
        tokens = torch.tensor([state.tokens[-1]] + [token_of[p] for p in tree.paths], device=self.device)
        if not state.max_depth(1):  # one token left: the window's guesses would go unused
            return Proposal(tree=tree, tokens=tokens, is_chain=True)
        return Proposal(tree=tree, tokens=tokens, side=self.window(tree.num_nodes))

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        if self.text:
            self.pool.add_text(state.tokens, self.indexed)
            self.indexed = len(state.tokens)
        if outcome.side_logits is None:  # a pass without the window (cut by the budget or the rows)
            return
        newest = outcome.side_logits[-self.size.window:].argmax(dim=-1).tolist()  # the last level's outputs
        self.levels[0][0] = state.tokens[outcome.start]  # the pass's root stood there: its n-gram starts with it
        if self.iterations >= self.size.ngram - 2:  # every level is the target's own guess by now
            for i, out in enumerate(newest):
                self.pool.add([level[i] for level in self.levels] + [out])
        self.iterations += 1
        self.levels = self.levels[1:] + [newest]
