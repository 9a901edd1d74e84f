"""Drafting with EAGLE heads: a dynamic tree per step (EAGLE-2), verified by the same engine.

Each step the head grows a draft tree by confidence. Depth 1 is the ``topk`` best tokens of
the head's prediction from the last accepted position. At every further depth the ``topk``
nodes of the newest depth with the highest cumulative draft log-probability are expanded
(one head pass over them, each attending to the accepted context and its own ancestors),
each into its ``topk`` best children. Finally the ``nodes`` best nodes of the whole draft by
cumulative log-probability (prefix-closed: a child never scores above its parent) become
the tree the target verifies, as ordinary :class:`~medusa.decoding.tree.TreeBuffers`.

The head's own KV cache holds one pair per accepted position; drafted pairs are dropped
after each proposal, and ``update`` appends the pairs of what the target accepted, with
the target's true features (``StepOutcome.hidden``). Candidates are deterministic (top-k),
so they carry no ``q``: lossless sampling treats each as a point mass.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from medusa.decoding import hf as kv
from medusa.decoding.calibrate import tree_key
from medusa.decoding.state import DecodeState, Proposal, StepOutcome
from medusa.decoding.tree import TreeBuffers, compile_tree, spelled
from medusa.models.eagle import EagleHeads, additive_mask

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class DynamicTree:
    """Size of the per-step draft tree: ``nodes`` verified (root excluded), grown to
    ``depth`` levels expanding ``topk`` nodes per level into ``topk`` children each."""

    nodes: int = 8
    depth: int = 5
    topk: int = 4
    chain: int | None = None  # mode hybrid: lookup tokens beside this tree (None: the engine's lookup_tokens)

    @classmethod
    def for_device(cls, calibrated: dict[str, dict], device: torch.device,
                   dtype: torch.dtype = torch.float32, hybrid: bool = False) -> DynamicTree:
        """The size calibrated for this device type and the target's dtype (calibrate.tree_key),
        else for the device type, else a default by device kind (a pass over many tokens costs
        about one pass on a GPU, about twice that on a CPU). ``hybrid``: the size calibrated
        for mode hybrid (an entry's ``"hybrid"``, with its lookup chain), else the same."""
        for key in (tree_key(device.type, dtype), device.type):
            if key in calibrated:
                entry = calibrated[key]
                if hybrid and "hybrid" in entry:
                    return cls(**entry["hybrid"])
                return cls(**{k: v for k, v in entry.items() if k != "hybrid"})
        return cls(nodes=48, depth=6, topk=8) if device.type == "cuda" else cls()


@functools.lru_cache(maxsize=512)
def _compiled(paths: tuple[Path_, ...]) -> TreeBuffers:
    return compile_tree(paths)


def select(paths: list[Path_], scores: list[float], nodes: int) -> list[int]:
    """Indices of the ``nodes`` best draft nodes by cumulative log-probability, prefix-closed.

    ``paths[i]`` is node ``i``'s path of child ranks; a node whose parent is not kept is
    skipped (with exact ties a child could otherwise outrank its parent)."""
    order = sorted(range(len(paths)), key=lambda i: (-scores[i], len(paths[i]), paths[i]))
    kept: list[int] = []
    have: set[Path_] = set()
    for i in order:
        if len(kept) == nodes:
            break
        if len(paths[i]) == 1 or paths[i][:-1] in have:
            kept.append(i)
            have.add(paths[i])
    return kept


class EagleProposer:
    """EAGLE heads proposing a dynamic tree each step (see the module docstring)."""

    def __init__(self, heads: EagleHeads, device: torch.device, size: DynamicTree | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        """``dtype``: the target's (the pass cost, hence the calibrated tree, depends on it)."""
        self.heads = heads
        self.device = device
        self.size = size or DynamicTree.for_device(heads.dynamic, device, dtype)
        self.cache = kv.new_cache()
        self.length = 0  # pairs in the head's cache: positions 0..length-1 (or from `start`)
        self.start = 0  # position of the first pair the head has seen
        self.last: torch.Tensor | None = None  # [H] the head's prediction of the root's feature
        self.ranked: list[Path_] = []  # the last proposal's nodes, best first
        self.scores: list[float] = []  # and their cumulative draft log-probabilities

    @property
    def max_rows(self) -> int:
        """The largest proposal, root included (Engine.precompile reads it)."""
        return 1 + self.size.nodes

    @property
    def min_rows(self) -> int:
        """The smallest proposal but for a budget cut (a compiled pass pads up to it)."""
        return 1 + self.size.nodes

    # -- the head's cache of accepted pairs ---------------------------------------------
    def _feed(self, features: torch.Tensor, tokens: list[int], first: int) -> None:
        """Append pairs ``(features[i], tokens[i])`` at positions ``first + i``."""
        n = len(tokens)
        past = self.length - self.start
        visible = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        visible[:, past:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        out = self.heads(features, torch.tensor(tokens, device=self.device),
                         torch.arange(first, first + n, device=self.device), self.cache,
                         additive_mask(visible, self.heads.fc.weight.dtype))
        self.length = first + n
        self.last = out[-1]

    @torch.inference_mode()  # the head's cache buffers are inference tensors (propose may regrow them)
    def begin(self, state: DecodeState) -> None:
        if self.size.nodes == 0:  # sized to draft nothing here: the head never runs
            return
        # The prefill's features f_p with the tokens x_{p+1} that followed (the last one is
        # the root). A reused state prefilled only its new tokens: the head sees those.
        hidden = state.prefill_hidden
        first = state.length - hidden.shape[0]
        self.cache = kv.new_cache()
        self.start = self.length = first
        self._feed(hidden, state.tokens[first + 1: state.length + 1], first)

    # -- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        size = self.size
        depth = state.max_depth(size.depth)  # no deeper than the tokens left to emit
        if size.nodes == 0 or depth == 0:  # calibrated: drafting does not pay here; or one token is left
            self.ranked, self.scores = [], []
            return Proposal(tree=_compiled(()).to(self.device), tokens=state.root.view(1), is_chain=True)
        parents, tokens, scores = self._draft(state.length, depth)
        kv.crop(self.cache, self.length - self.start)  # drafted pairs leave the head's cache
        # the drafting's host sync: what was drafted, once every level is queued
        token_list, score_list = torch.cat(tokens).tolist(), torch.cat(scores).tolist()
        parent_lists = [[0]] + [p.tolist() for p in parents]
        paths: list[Path_] = []
        level: list[Path_] = [()]
        for up in parent_lists:  # level d's nodes: topk ranked children of each listed node of level d-1
            level = [level[p] + (r,) for p in up for r in range(size.topk)]
            paths += level
        keep = select(paths, score_list, min(size.nodes, len(paths)))
        self.ranked = [paths[i] for i in keep]  # best first (calibration reads it)
        self.scores = [score_list[i] for i in keep]  # their cumulative draft log-probabilities
        tree = _compiled(tuple(sorted(self.ranked, key=lambda p: (len(p), p)))).to(self.device)
        index = {p: i for i, p in enumerate(paths)}
        drafted = torch.tensor([token_list[index[p]] for p in tree.paths], device=self.device)
        return Proposal(tree=tree, tokens=torch.cat([state.root.view(1), drafted]))

    def _draft(self, root: int, depth: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Grow the draft to ``depth`` levels: ``(parents, tokens, scores)``, per level the
        nodes' draft tokens and cumulative log-probabilities; level d's nodes are the ``topk``
        ranked children of each node of level d-1 listed in ``parents[d - 2]`` (level 1: of
        the root). Fixed shapes and no host sync: ``topk`` nodes at level 1, ``topk * topk``
        below, and the ``topk`` best of a level are expanded by one head pass over them."""
        k, vocab, past = self.size.topk, self.heads.draft_vocab, root - self.start
        logp = torch.log_softmax(self.heads.logits(self.last, vocab).float(), dim=-1)  # [V or S]
        vocab = self.heads.draft_vocab  # read after scoring: logits() keeps it on the projection's device
        top = logp.topk(k)
        tokens = [top.indices if vocab is None else vocab[top.indices]]  # [k]
        scores, features = [top.values], self.last.expand(k, -1)  # [k], [k, H]: the feature that drafted them
        ancestors = torch.zeros(k, 0, dtype=torch.long, device=self.device)  # their ancestors' drafted pairs
        parents: list[torch.Tensor] = []
        rows = torch.arange(k, device=self.device)
        for d in range(1, depth):
            best = scores[-1].topk(k).indices  # [k] the best nodes of the newest level, best first
            drafted = (d - 1) * k  # pairs the levels above put in the head's cache
            visible = torch.zeros(k, past + drafted + k, dtype=torch.bool, device=self.device)
            visible[:, :past] = True  # the accepted context
            visible.scatter_(1, past + ancestors[best], True)  # the node's ancestors' pairs
            visible[rows, past + drafted + rows] = True  # and its own
            out = self.heads(features[best], tokens[-1][best], torch.full((k,), root + d - 1, device=self.device),
                             self.cache, additive_mask(visible, self.heads.fc.weight.dtype))  # [k, H]
            top = torch.log_softmax(self.heads.logits(out, vocab).float(), dim=-1).topk(k, dim=-1)  # [k, k]
            tokens.append((top.indices if vocab is None else vocab[top.indices]).flatten())  # parent-major
            scores.append((top.values + scores[-1][best][:, None]).flatten())
            features = out.repeat_interleave(k, 0)
            ancestors = torch.cat([ancestors[best], (drafted + rows)[:, None]], 1).repeat_interleave(k, 0)
            parents.append(best)
        return parents, tokens, scores

    @torch.inference_mode()
    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        if self.size.nodes == 0:
            return
        # pairs (f_p, x_{p+1}) for the root and every accepted node, with the target's features
        nodes = torch.tensor(outcome.nodes, device=self.device)
        self._feed(outcome.hidden[nodes], outcome.tokens, outcome.start)


@dataclass
class Acceptance:
    """Teacher-forced acceptance of one draft shape (see :func:`acceptance_by_size`)."""

    accepted: list[float]  # [N - 1] mean draft tokens accepted per position with the N best nodes, N = 1..nodes
    draft_ms: float  # mean milliseconds of a step's drafting
    # with a lookup chain (mode hybrid), decoding simulated along the answers: [L][N] mean draft
    # tokens accepted per step with an L-token chain beside the N best nodes (L = 0..chain,
    # N = 0..nodes; L = 0 is mode eagle), [L][N] the share of those steps whose chain adds rows
    # to the pass (prompt lookup or the n-gram table drafted tokens the tree does not hold), and
    # [L][N] the mean rows it adds in those steps (the chain shares the nodes the tree drafted too)
    hybrid: list[list[float]] | None = None
    chain_share: list[list[float]] | None = None
    chain_rows: list[list[float]] | None = None

    def as_record(self) -> dict:
        """For calibration.json (rounded: four decimals are far below the sampling noise)."""
        record = {"accepted": _rounded(self.accepted), "draft_ms": round(self.draft_ms, 4)}
        if self.hybrid is not None:
            record.update(hybrid=_rounded(self.hybrid), chain_share=_rounded(self.chain_share))
        if self.chain_rows is not None:
            record.update(chain_rows=_rounded(self.chain_rows))
        return record

    @classmethod
    def from_record(cls, record: dict) -> Acceptance:
        return cls(list(record["accepted"]), float(record["draft_ms"]), record.get("hybrid"), record.get("chain_share"),
                   record.get("chain_rows"))

    def rows_added(self, length: int, nodes: int) -> float:
        """Mean rows an L-token chain adds to a pass with the N best nodes, in the steps where it
        adds any (files calibrated before chains shared nodes: all L)."""
        return float(length) if self.chain_rows is None else self.chain_rows[length][nodes]


def _rounded(values):
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 4)


def simulate(positions: list[list[tuple]], nodes: int, chain: int,
             ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Decoding replayed on teacher-forced drafts: ``positions`` holds, per answer and answer
    position, ``(right, hits, rows[, along])``: the draft tokens the N best nodes get right
    (N = 0..nodes), the chain tokens that are right, the chain's length and, optionally, the
    best-first ranks of the draft nodes that spell the chain's first tokens (increasing: a
    parent ranks before its children). A step at position i accepts a = max(right[N],
    min(hits, L)) drafts and the next step starts at i + a + 1, as in decoding (a plain average
    over positions would count every position inside a long copied span as its own step). The
    chain shares the nodes of ``along`` that the N best keep (mode hybrid lays out only the
    rest: proposers.Hybrid). Returns ([L][N] mean drafts accepted per step, [L][N] share of
    steps whose chain adds rows, [L][N] mean rows it adds in those steps)."""
    accepted = [[0.0] * (nodes + 1) for _ in range(chain + 1)]
    share = [[0.0] * (nodes + 1) for _ in range(chain + 1)]
    added = [[float(length)] * (nodes + 1) for length in range(chain + 1)]
    for length in range(chain + 1):
        for n in range(nodes + 1):
            steps = total = with_chain = rows_added = 0
            for answer in positions:
                i = 0
                while i < len(answer):
                    right, hits, rows, *along = answer[i]
                    a = max(right[n], min(hits, length))
                    used = min(rows, length)
                    extra = used - sum(1 for rank in (along[0][:used] if along else ()) if rank < n)
                    steps, total = steps + 1, total + a
                    if extra > 0:
                        with_chain, rows_added = with_chain + 1, rows_added + extra
                    i += a + 1
            accepted[length][n] = total / max(steps, 1)
            share[length][n] = with_chain / max(steps, 1)
            if with_chain:
                added[length][n] = rows_added / with_chain
    return accepted, share, added


@torch.inference_mode()
def acceptance_by_size(heads: EagleHeads, model, sequences: list[tuple[list[int], list[int]]],
                       size: DynamicTree, chain: int = 0, lookup_ngram: int = 3) -> Acceptance:
    """Teacher-forced along the target's own answers (``(prompt, answer)`` token lists): for
    every ``N`` in ``1..size.nodes``, the mean draft tokens accepted per position when the
    target verifies the ``N`` best nodes (one drafting per position serves every ``N``: the
    best-N sets are nested); and the mean milliseconds the drafting of a step takes. With
    ``chain``, prompt lookup (``lookup_ngram``) copies up to ``chain`` tokens at each position
    too, and decoding with a chain of every length up to it beside the N best nodes is replayed
    (:func:`simulate`; chain length 0 is mode eagle)."""
    from medusa.decoding.proposers import PromptLookup

    device = heads.fc.weight.device
    proposer = EagleProposer(heads, device, size)
    # the chain as mode hybrid drafts it: prompt lookup, else the heads' n-gram table
    lookup = PromptLookup(device, num_tokens=chain, max_ngram=lookup_ngram, table=heads.ngrams) if chain else None
    totals = [0] * (size.nodes + 1)
    positions: list[list[tuple[list[int], int, int, list[int]]]] = []
    steps, seconds = 0, 0.0
    for prompt, answer in sequences:
        ids = prompt + answer
        seq = torch.tensor(ids, device=device)
        hidden = model.get_decoder()(input_ids=seq[None]).last_hidden_state[0]  # [T, H]
        p = len(prompt)
        state = DecodeState(cache=None, tokens=ids[: p + 1], length=p, root=seq[p], hidden=hidden[p - 1],
                            logits=None, prefill_hidden=hidden[:p])
        proposer.begin(state)
        if lookup is not None:
            lookup.begin(state)
        positions.append([])
        for t in range(p, len(ids) - 1):
            t0 = time.perf_counter()
            proposal = proposer.propose(state)
            seconds += time.perf_counter() - t0
            tokens = dict(zip(proposal.tree.paths, proposal.tokens[1:].tolist()))
            right: set[Path_] = set()
            best, by_size = 0, [0]
            for path in proposer.ranked:
                d = len(path)
                if (d == 1 or path[:-1] in right) and t + d < len(ids) and tokens[path] == ids[t + d]:
                    right.add(path)
                    best = max(best, d)
                by_size.append(best)
            by_size += [best] * (size.nodes + 1 - len(by_size))
            totals = [total + right_n for total, right_n in zip(totals, by_size)]  # by_size[0] is 0
            copied = [] if lookup is None else lookup.propose(state).tokens[1:].tolist()
            hits = next((i for i, tok in enumerate(copied) if t + 1 + i >= len(ids) or tok != ids[t + 1 + i]),
                        len(copied))
            along = spelled(proposer.ranked, map(tokens.get, proposer.ranked), copied)  # the draft's nodes it starts with
            positions[-1].append((by_size, hits, len(copied), [proposer.ranked.index(node) for node in along]))
            steps += 1
            # advance by the one true token, as a step that accepted nothing would
            outcome = StepOutcome(nodes=[0], tokens=[ids[t + 1]], hidden=hidden[t: t + 1], start=t)
            state.length, state.root = t + 1, seq[t + 1]
            state.tokens.append(ids[t + 1])
            proposer.update(state, outcome)
    steps = max(steps, 1)
    result = Acceptance([totals[n] / steps for n in range(1, size.nodes + 1)], seconds / steps * 1e3)
    if lookup is not None:
        result.hybrid, result.chain_share, result.chain_rows = simulate(positions, size.nodes, chain)
    return result


def choose_dynamic(curves: dict[tuple[int, int], Acceptance], cost_ms: dict[int, float], hybrid: bool = False,
                   max_rows: int | None = None) -> tuple[DynamicTree, float, float]:
    """The tree size with the most expected tokens per second, from the acceptance of each
    ``(depth, topk)`` draft shape and the target's pass cost ``T(n)``; ``nodes=0`` (plain
    decoding) when no size beats it. Curves with replayed decoding (:func:`simulate`) are
    read from it, older ones from the per-position average. ``hybrid``: the size for mode
    hybrid, the lookup chain's length (``chain``) chosen with it from the replay, the rows it
    adds beyond the nodes it shares with the tree paid in the steps where it adds any (older
    curves are sized without a chain). ``max_rows``: the
    largest pass the engine verifies (root, nodes and chain). Returns the size, its expected
    tokens per pass and its tokens per second."""
    from medusa.decoding.calibrate import interpolate

    simulated = all(acc.hybrid is not None for acc in curves.values())
    chains = hybrid and simulated
    best = (DynamicTree(nodes=0, depth=1, topk=1, chain=0 if chains else None), 1.0, 1e3 / cost_ms[1])
    for (depth, topk), acc in sorted(curves.items()):
        if simulated:  # decoding replayed (mode eagle: the chain of length 0)
            tables, shares = (acc.hybrid, acc.chain_share) if chains else (acc.hybrid[:1], acc.chain_share[:1])
        else:
            tables, shares = [[0.0] + acc.accepted], [[0.0] * (len(acc.accepted) + 1)]
        for length, (table, share) in enumerate(zip(tables, shares)):
            for n, accepted in enumerate(table):
                if max_rows is not None and 1 + n + length > max_rows:
                    break
                rows = acc.rows_added(length, n) if chains else 0.0
                ms = (1 - share[n]) * interpolate(cost_ms, 1 + n) + share[n] * interpolate(cost_ms, 1 + n + rows)
                ms += acc.draft_ms if n else 0.0
                tps = (1.0 + accepted) / ms * 1e3
                if tps > best[2] * (1 + 1e-9):
                    chain = length if chains else None
                    best = (DynamicTree(nodes=n, depth=depth, topk=topk, chain=chain), 1.0 + accepted, tps)
    return best
