"""One sequence's half of the decode loop (:class:`Decoding`): its prefill, its proposal within
the step's budget, and what a verified step accepts (:func:`accept`). The step that drives
sequences, one or many at a time, is :class:`medusa.decoding.batch.Batch`; nothing here knows
the engine: a sequence reads the passes it runs on and its limits, given when it is made."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Generator
from dataclasses import dataclass, replace

import torch

from medusa.decoding.generation import GenerationResult, GenerationStats
from medusa.decoding.passes.strategies import PASS_BUCKETS, PassStrategy
from medusa.decoding.payoff import DraftCheck
from medusa.decoding.penalties import Penalties
from medusa.decoding.proposers import shared
from medusa.decoding.proposers.autoregressive import Autoregressive
from medusa.decoding.proposers.shared import Steps
from medusa.decoding.request import Request, Status
from medusa.decoding.sampling import SamplingConfig, next_token
from medusa.decoding.state import CacheShare, DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import compile_tree
from medusa.decoding.verify import Accepted, verify
from medusa.runtime import hf as kv
from medusa.runtime import packed


@torch.inference_mode()
def prefill_chunks(passes: PassStrategy, chunk: int | None, ids: list[int], state: DecodeState | None,
                   stats: GenerationStats, sampling: SamplingConfig, max_new_tokens: int,
                   penalties: Penalties | None = None) -> Generator[None, None, DecodeState]:
    """The prefill on ``passes``, one pass of at most ``chunk`` prompt tokens per ``next`` (None:
    the whole prompt at once; a batch runs other sequences' steps between them); returns the new
    state. Alone and in a batch a prompt is cut at the same places, so its cache holds the same
    values. ``penalties``: the request's adjustments, applied to the first token's choice and
    kept in the state for the steps'."""
    cache, start, share = prefill_start(passes, ids, state)
    if cache is None:
        cache = passes.new_cache()
    stats.prefill_tokens = len(ids) - start
    step = chunk or len(ids)
    hiddens = []
    for at in range(start, len(ids), step):
        if hiddens:
            yield
        new = torch.tensor([ids[at: at + step]], device=passes.device)
        logits, hidden = passes.prefill(cache, new, at, max_new_tokens)
        hiddens.append(hidden)
    hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)  # [n, H]
    return prefilled_state(passes, ids, (cache, start, share), logits[-1], hidden, sampling, penalties, state)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shared_start(ids: list[int], state: DecodeState | None, static: bool) -> int:
    """How many leading tokens of ``ids`` a prefill after ``state`` (a prior turn's or a shared
    prefix's) finds in its cache: all but the last at most, which must run for its logits."""
    if state is None or kv.is_static(state.cache) != static:
        return 0
    cached = state.tokens[: min(state.valid, state.length)]  # what the cache still holds for it
    return min(common_prefix(cached, ids), len(ids) - 1)


def prefill_start(passes: PassStrategy, ids: list[int], state: DecodeState | None) -> tuple[object, int, CacheShare]:
    """Where a prefill of ``ids`` after ``state`` starts: ``(cache, start, share)``, the cache
    holding the shared ``start`` positions (None: a new one is needed) and who holds it."""
    if state is None or kv.is_static(state.cache) != passes.static:
        return None, 0, CacheShare()
    start = shared_start(ids, state, passes.static)
    if state.share is not None and state.share.owned_by(state):
        # continue in place (a chat's next turn): no copy. Every holder trusts only the common
        # prefix from now on, before the cache is touched: a prefill that fails (Ctrl-C, out of
        # memory) leaves them consistent
        state.share.narrow(start)
        kv.crop(state.cache, start)
        return state.cache, start, state.share
    # its cache was taken by another generation since: branch off a copy
    return kv.copy_prefix(state.cache, start, passes.model), start, CacheShare()


def prefilled_state(passes: PassStrategy, ids: list[int], where: tuple[object, int, CacheShare], last: torch.Tensor,
                    hidden: torch.Tensor, sampling: SamplingConfig, penalties: Penalties | None,
                    prior: DecodeState | None) -> DecodeState:
    """The state after the prompt ``ids`` ran into ``where`` (:func:`prefill_start`'s): ``last``
    ``[V]`` the last row's logits, ``hidden`` ``[n, H]`` the rows the prefill ran; the first token
    chosen by ``sampling`` (after ``penalties``)."""
    cache, start, share = where
    generator = sampling.generator(passes.device)
    scored = last if penalties is None else penalties.apply(last[None], [])[0]
    root = next_token(scored, sampling, generator)
    new_state = DecodeState(cache=cache, tokens=list(ids), length=len(ids), root=root, hidden=hidden[-1],
                            logits=last, sampling=sampling, generator=generator, prefill_hidden=hidden,
                            share=share, carry={} if prior is None else dict(prior.carry), penalties=penalties,
                            prompt_length=len(ids))
    share.take(new_state, start)
    return new_state


class Decoding:
    """One sequence: a request's generation, from its prefill through propose -> (a target pass
    verifies the proposal, alone or packed beside other sequences': :class:`~medusa.decoding.batch.Batch`)
    -> advance, until a stop reason; :attr:`status` says where it is. Made by
    :meth:`Engine.decoding <medusa.decoding.engine.Engine.decoding>`: ``passes``, the strategy its
    prefill runs on (chosen per generation); ``eos``, the engine's end tokens; ``max_rows``, the rows
    a pass verifies exactly at most; ``prefill_chunk``, prompt tokens a prefill pass runs at most.
    The caller holds the engine's lock and kernel scope."""

    def __init__(self, request: Request, proposer: Proposer, passes: PassStrategy, eos: frozenset[int] | set[int],
                 max_rows: int | None, prefill_chunk: int | None) -> None:
        self.request, self.proposer, self.passes = request, proposer, passes
        self.max_rows, self.prefill_chunk = max_rows, prefill_chunk
        self.max_positions = passes.max_positions
        self.ids, self.max_new_tokens = list(request.prompt), request.max_new_tokens
        self.prior, self.sampling = request.state, request.sampling
        self.stop = threading.Event()  # set from any thread: ends the generation at the next step
        self.status = Status.WAITING
        self.stats = GenerationStats()
        self.emitted: list[int] = []
        self.reason: str | None = None
        self.state: DecodeState | None = None
        self._fused: tuple[object, int, CacheShare] | None = None  # a prefill running in decoding passes
        self._at, self._hiddens = 0, []  # where it is, the hidden states of its rows so far
        # draft without a costly drafter's levels (a batch's choice: medusa/serving/drafting.py)
        self.lean = False
        # a lone greedy sequence's check of whether drafting pays (medusa/decoding/payoff.py; None: none)
        self.check: DraftCheck | None = None
        self.least = min(proposer.min_rows, max_rows or PASS_BUCKETS[-1])
        # log-probabilities of the emitted tokens under the target (its raw logits, before
        # temperature or filters: what verification computed, so exact under speculation), one
        # entry each, with the request's number of likeliest alternatives; None unless asked for
        self.logprobs: list[TokenLogprob] | None = None if request.logprobs is None else []
        self.top_logprobs = request.logprobs or 0
        # every token is chosen from the target's distribution adjusted by the request's penalties
        # (medusa/decoding/penalties.py; its min_tokens holds this run's EOS tokens back)
        penalties = request.penalties
        if penalties is not None and penalties.min_tokens and not penalties.eos:
            penalties = replace(penalties, eos=tuple(sorted(eos)))
        self.penalties: Penalties | None = penalties if penalties is not None and penalties.active else None
        # the tokens that end the answer (none with ignore_eos)
        self.eos = frozenset() if request.ignore_eos else frozenset(eos)
        # nothing but each verified row's argmax is read: passes may screen the vocabulary
        self.argmax = (self.sampling.greedy and self.sampling.acceptance != "typical" and self.penalties is None
                       and self.logprobs is None)
        self._t0 = time.perf_counter()

    def prefill(self) -> list[int]:
        """Run the prompt; the first token's chunk (empty if nothing may be emitted)."""
        for _ in self.prefill_chunks():
            pass
        return self.first_chunk()

    def prefill_chunks(self) -> Generator[None, None, None]:
        """:meth:`prefill` one pass at a time (``next`` runs one); then :meth:`first_chunk`."""
        self.status = Status.PREFILLING
        self.state = yield from prefill_chunks(self.passes, self.prefill_chunk, self.ids, self.prior, self.stats,
                                               self.sampling, self.max_new_tokens, self.penalties)

    def fusable(self) -> bool:
        """Whether this sequence's prefill may run a chunk at a time as rows of decoding passes
        (:meth:`Batch.step <medusa.decoding.batch.Batch.step>`): on passes that compute a prompt's
        rows as decoding rows (one C call each), where it has not begun a prefill of its own."""
        return self.passes.whole_calls and (self.status is Status.WAITING or self._fused is not None)

    def fused_prefill(self, rows: int) -> packed.Chunk:
        """The prompt's next rows, at most ``rows``, for a decoding pass (the first past its shared
        prefix, where it has one); :meth:`fused_done` takes that pass's outputs for them."""
        if self._fused is None:
            self.status = Status.PREFILLING
            cache, start, share = prefill_start(self.passes, self.ids, self.prior)
            self._fused = (self.passes.new_cache() if cache is None else cache, start, share)
            self._at, self._hiddens = start, []
            self.stats.prefill_tokens = len(self.ids) - start
        at, end = self._at, min(self._at + max(rows, 1), len(self.ids))
        return packed.Chunk(self._fused[0], at, torch.tensor(self.ids[at:end], device=self.passes.device),
                            end == len(self.ids))

    def fused_done(self, logits: torch.Tensor | None, hidden: torch.Tensor) -> list[int] | None:
        """After the pass that ran :meth:`fused_prefill`'s rows (``hidden`` ``[n, H]``; ``logits``
        ``[1, V]``: the prompt's last row's, once it ran): None while rows are left, then the
        state, as :meth:`prefill` leaves it, and the first token's chunk."""
        self._hiddens.append(hidden)
        self._at += hidden.shape[0]
        if self._at < len(self.ids):
            return None
        where, self._fused = self._fused, None
        hidden = self._hiddens[0] if len(self._hiddens) == 1 else torch.cat(self._hiddens)
        self._hiddens = []
        self.state = prefilled_state(self.passes, self.ids, where, logits[-1], hidden, self.sampling, self.penalties,
                                     self.prior)
        first = self.first_chunk()
        self.begin()
        return first

    def drop_prefill(self) -> None:
        """Let go of a prefill begun in decoding passes (its cache, a KV store slot, goes back)."""
        self._fused, self._hiddens = None, []

    def first_chunk(self) -> list[int]:
        """After the prefill: the first token, cut by EOS or the length limit."""
        state = self.state
        self.stats.prefill_seconds = time.perf_counter() - self._t0
        chunk, self.reason = cut_chunk([int(state.root)], self.eos, self.max_new_tokens)
        state.tokens.append(int(state.root))
        if self.logprobs is not None and chunk:
            self.logprobs += token_logprobs(state.logits.view(1, -1), chunk, self.top_logprobs)
        self.emitted += chunk
        self.stats.new_tokens = len(self.emitted)
        self.status = Status.RUNNING
        return chunk

    def begin(self) -> None:
        self.proposer.begin(self.state)

    def propose(self, rows_cap: int | None = None) -> Proposal | None:
        """This step's proposal (within ``rows_cap`` rows: a batch's share), or None when the
        generation is over (:attr:`reason` says why)."""
        return shared.alone(self.propose_steps(rows_cap))

    def propose_steps(self, rows_cap: int | None = None) -> Steps:
        """:meth:`propose` as a coroutine asking for its heads' calls (medusa/decoding/proposers/shared.py:
        a batch answers its sequences' asks together); the time of its own work and its share of
        the calls that answered it go to ``stats.draft_seconds``."""
        if self.reason is None:
            self.reason = self._stop_reason()
        if self.reason is not None:
            return None
        steps, t1 = self._propose(self.max_new_tokens - len(self.emitted), rows_cap), time.perf_counter()
        try:
            ask = next(steps)
            while True:
                self.stats.draft_seconds += time.perf_counter() - t1
                t1 = None  # (waiting for the answer: not this sequence's time)
                answer = yield ask
                t1 = time.perf_counter()
                self.stats.draft_seconds += ask.seconds
                ask = steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
        except StopIteration as stop:
            proposal = stop.value
        finally:
            if t1 is not None:
                self.stats.draft_seconds += time.perf_counter() - t1
        return replace(proposal, argmax=True) if self.argmax else proposal

    def _propose(self, room: int, rows_cap: int | None = None) -> Steps:
        """The proposer's tree for this step, within ``room`` tokens left and the context, and
        within ``rows_cap`` rows (a batch's share): 1 row drafts nothing at all, fewer rows draft
        no deeper than they can verify."""
        state, device = self.state, self.passes.device
        state.budget = room  # (compiled passes pad a cut tree to its bucket)
        if self.max_positions is not None:
            state.budget = min(state.budget, self.max_positions - state.length)
        state.lean = self.lean
        if rows_cap == 1:
            return Autoregressive(device).propose(state)  # nothing to verify a draft in: skip drafting
        cap = self.max_rows if rows_cap is None else min(rows_cap, self.max_rows or rows_cap)
        if rows_cap is not None:
            state.budget = min(state.budget, rows_cap)  # a chain of rows_cap rows is rows_cap - 1 deep
        proposal = yield from self.proposer.steps(state)
        n = proposal.tokens.shape[0]
        rows = n if proposal.side is None else n + proposal.side.tokens.shape[0]
        if cap is not None and rows > cap:
            proposal = truncate(proposal, min(n, cap))  # side rows go first
        reach = proposal.tree.max_depth if proposal.side is None else max(proposal.tree.max_depth, proposal.side.reach)
        if self.max_positions is not None and state.length + reach + 1 > self.max_positions:
            proposal = Autoregressive(device).propose(state)  # a proposer that ignored the budget
        return proposal

    def advance(self, outcome: StepOutcome) -> tuple[list[int], int]:
        """Record a verified step: the tokens it emits and how many of them were drafted."""
        t3 = time.perf_counter()
        self.proposer.update(self.state, outcome)
        self.stats.update_seconds += time.perf_counter() - t3
        chunk, self.reason = cut_chunk(outcome.tokens, self.eos, self.max_new_tokens - len(self.emitted))
        if self.logprobs is not None and chunk:
            rows = outcome.logits[torch.tensor(outcome.nodes[: len(chunk)], device=outcome.logits.device)]
            self.logprobs += token_logprobs(rows, chunk, self.top_logprobs)
        self.emitted += chunk
        self.stats.steps += 1
        self.stats.accepted.append(len(chunk))  # emitted only: what EOS or the length limit cut is not counted
        self.stats.new_tokens = len(self.emitted)
        # All but the step's last token were drafted (fewer if the chunk was cut).
        return chunk, (min(len(chunk), len(outcome.tokens) - 1) if chunk else 0)

    def result(self) -> GenerationResult:
        """The finished generation (its state trimmed to what was emitted, for a later turn)."""
        self._trim(len(self.ids) + len(self.emitted))
        self.status = Status.FINISHED
        self.stats.seconds = time.perf_counter() - self._t0
        return GenerationResult(tokens=self.emitted, stats=self.stats, finish_reason=self.reason or "stopped",
                                state=self.state, logprobs=self.logprobs)

    def _stop_reason(self) -> str | None:
        """Why the loop must stop before the next step (None: go on)."""
        if self.stop.is_set():
            return "stopped"
        limit = self.max_positions
        if limit is not None and self.state.length + 1 > limit:
            return "context"  # the root's KV entry has no slot left
        return None

    def _trim(self, keep: int) -> None:
        """Drop tokens cut off by EOS or the length limit from the state, keeping the cache and
        token list consistent for a later turn that reuses them."""
        state = self.state
        del state.tokens[keep:]
        if state.length > len(state.tokens) - 1:
            state.length = len(state.tokens) - 1
            kv.crop(state.cache, state.length)
        state.valid, state.budget = state.length, None


def truncate(proposal: Proposal, rows: int) -> Proposal:
    """``proposal``'s first ``rows`` nodes: nodes are laid out by depth (compile_tree), so every
    kept node's ancestors are kept and node indices stay those of the proposer."""
    tree = compile_tree(proposal.tree.paths[: rows - 1]).to(proposal.tokens.device)
    q = None if proposal.q is None else proposal.q[:rows]
    return Proposal(tree=tree, tokens=proposal.tokens[:rows], q=q, is_chain=proposal.is_chain)


def accept(state: DecodeState, proposal: Proposal, logits: torch.Tensor, hidden: torch.Tensor,
           side: torch.Tensor | None) -> StepOutcome:
    """Accept what the target agrees with in ``proposal``'s verified rows (``logits`` ``[N, V]``,
    ``hidden`` ``[N, H]``, already in ``state.cache`` after ``state.length``) and advance ``state``."""
    tree, start = proposal.tree, state.length
    scored = logits  # [N, V] what verification chooses from: the request's penalties applied
    if state.penalties is not None:
        scored = state.penalties.apply(logits, state.tokens[state.prompt_length:], tree, proposal.tokens)
    acc: Accepted = verify(tree, proposal.tokens, scored, state.sampling, state.generator, proposal.q)
    # The step's single host sync: path, accepted length, next token and node tokens.
    d = tree.leaves.shape[1]
    flat = torch.cat([acc.length.view(1), acc.next_token.view(1), acc.path, proposal.tokens[acc.path.clamp(min=0)]]).tolist()
    m, nxt, path, path_tokens = flat[0], flat[1], flat[2:2 + d], flat[2 + d:]
    nodes = path[: m + 1]
    kv.keep_nodes(state.cache, start, acc.path[: m + 1], contiguous=nodes == list(range(m + 1)))
    new_tokens = path_tokens[1: m + 1] + [nxt]
    last = nodes[-1]
    state.length = start + m + 1
    state.tokens.extend(new_tokens)
    state.root = acc.next_token
    state.hidden = hidden[last]
    state.logits = logits[last]
    return StepOutcome(nodes=nodes, tokens=new_tokens, hidden=hidden, start=start, side_logits=side, logits=logits)


def greedy_chain(state: DecodeState, proposal: Proposal) -> bool:
    """Whether :func:`accept_chains` accepts ``proposal``: one chain, the plain greedy rule."""
    return (state.sampling.greedy and state.sampling.acceptance != "typical" and state.penalties is None
            and proposal.side is None and proposal.tree.leaves.shape[0] == 1)


def accept_chains(steps: list[tuple[DecodeState, Proposal, tuple]]) -> list[StepOutcome]:
    """:func:`accept` of several sequences' greedy chains (:func:`greedy_chain`) with one host sync
    for all: each ``(state, proposal, (logits, hidden, side))``. A chain keeps its leading tokens
    that equal the target's argmax after their parent, then adds the argmax after the last kept:
    what :func:`~medusa.decoding.verify.verify_greedy` finds on a tree of one path."""
    preds = [logits.argmax(dim=-1) for _, _, (logits, _, _) in steps]  # [n] each
    flat = torch.cat(preds + [proposal.tokens for _, proposal, _ in steps]).tolist()
    at, tokens_at, out = 0, sum(p.shape[0] for p in preds), []
    for (state, _, (logits, hidden, side)), pred in zip(steps, preds):
        n = pred.shape[0]
        argmax, tokens = flat[at:at + n], flat[tokens_at:tokens_at + n]
        at, tokens_at = at + n, tokens_at + n
        m = 0
        while m + 1 < n and tokens[m + 1] == argmax[m]:
            m += 1
        start = state.length
        kv.crop(state.cache, start + m + 1)
        new_tokens = tokens[1:m + 1] + [argmax[m]]
        state.length = start + m + 1
        state.tokens.extend(new_tokens)
        state.root, state.hidden, state.logits = pred[m], hidden[m], logits[m]
        out.append(StepOutcome(nodes=list(range(m + 1)), tokens=new_tokens, hidden=hidden, start=start,
                               side_logits=side, logits=logits))
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the ``top`` likeliest tokens at
    its position with theirs (``(token, logprob)``, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``logits`` ``[n, V]`` (row ``i`` chose ``tokens[i]``) -> each token's log-probability and the
    ``top`` alternatives, read back in one host sync."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).view(-1, 1)).view(-1)
    if top:
        values, ids = logp.topk(top, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    chosen = chosen.tolist()
    return [TokenLogprob(t, chosen[i], tuple(zip(ids[i], values[i])) if top else ())
            for i, t in enumerate(tokens)]


def cut_chunk(chunk: list[int], eos: Collection[int], room: int) -> tuple[list[int], str | None]:
    """A step's tokens cut at the first EOS and at ``room`` tokens left, with the finish
    reason that cut implies (None: neither applies and decoding goes on)."""
    reason = None
    for i, t in enumerate(chunk):
        if t in eos:
            chunk, reason = chunk[: i + 1], "eos"
            break
    if len(chunk) > room or (len(chunk) == room and reason is None):
        chunk, reason = chunk[:room], "length"
    return chunk, reason
