"""One generation's half of the decode loop (:class:`Decoding`) and its prefill: what
:meth:`Engine._run <medusa.decoding.engine.Engine._run>` drives alone and
:class:`medusa.serving.scheduler.Scheduler` drives beside other sequences."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Generator
from dataclasses import dataclass, replace
from typing import Any

import torch

from medusa.decoding.generation import GenerationResult, GenerationStats
from medusa.decoding.passes.strategies import PASS_BUCKETS, PassStrategy
from medusa.decoding.penalties import Penalties
from medusa.decoding.sampling import SamplingConfig, next_token
from medusa.decoding.state import CacheShare, DecodeState, Proposal, Proposer, StepOutcome
from medusa.runtime import hf as kv

# ``engine`` below is a medusa.decoding.engine.Engine (which imports this module: not imported back)
Engine = Any


@torch.inference_mode()
def prefill_chunks(engine: Engine, ids: list[int], state: DecodeState | None, stats: GenerationStats,
                    sampling: SamplingConfig, max_new_tokens: int, passes: PassStrategy | None = None,
                    penalties: Penalties | None = None) -> Generator[None, None, DecodeState]:
    """The prefill, one pass of at most :attr:`Engine.prefill_chunk` prompt tokens per ``next`` (a
    scheduler runs other sequences' steps between them); returns the new state. Alone and in
    a scheduler a prompt is cut at the same places, so its cache holds the same values.
    ``penalties``: the request's adjustments, applied to the first token's choice and kept in
    the state for the steps'."""
    passes = passes or engine.passes  # compile="auto" picks per generation (PassStrategy.for_generation)
    cache, start, share = None, 0, CacheShare()
    if state is not None and kv.is_static(state.cache) == passes.static:
        cached = state.tokens[: min(state.valid, state.length)]  # what the cache still holds for it
        start = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
        start = min(start, len(ids) - 1)  # the last prompt token must be run for its logits
        if state.share is not None and state.share.owned_by(state):
            cache, share = state.cache, state.share  # continue in place (a chat's next turn): no copy
            # every holder trusts only the common prefix from now on, before the cache is
            # touched: a prefill that fails (Ctrl-C, out of memory) leaves them consistent
            share.narrow(start)
            kv.crop(cache, start)
        else:  # its cache was taken by another generation since: branch off a copy
            cache = kv.copy_prefix(state.cache, start, engine.model)
    if cache is None:
        cache = passes.new_cache()
    stats.prefill_tokens = len(ids) - start
    step = engine.prefill_chunk or len(ids)
    hiddens = []
    for at in range(start, len(ids), step):
        if hiddens:
            yield
        new = torch.tensor([ids[at: at + step]], device=engine.device)
        logits, hidden = passes.prefill(cache, new, at, max_new_tokens)
        hiddens.append(hidden)
    hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)  # [n, H]
    generator = sampling.generator(engine.device)
    scored = logits[-1] if penalties is None else penalties.apply(logits[-1:], [])[0]
    root = next_token(scored, sampling, generator)
    new_state = DecodeState(cache=cache, tokens=list(ids), length=len(ids), root=root, hidden=hidden[-1],
                            logits=logits[-1], sampling=sampling, generator=generator, prefill_hidden=hidden,
                            share=share, carry={} if state is None else dict(state.carry), penalties=penalties,
                            prompt_length=len(ids))
    share.take(new_state, start)
    return new_state


class Decoding:
    """One generation's own half of the decode loop: prefill, then propose -> (a target pass
    verifies the proposal, alone or packed beside other sequences') -> advance, until a stop
    reason. :meth:`Engine._run` drives one alone; :class:`medusa.serving.scheduler.Scheduler`
    drives many, one packed pass per step. The caller holds the engine's lock and kernel scope."""

    def __init__(self, engine: Engine, ids: list[int], proposer: Proposer, max_new_tokens: int,
                 prior: DecodeState | None, stop: threading.Event, sampling: SamplingConfig) -> None:
        self.engine, self.ids, self.proposer, self.max_new_tokens = engine, ids, proposer, max_new_tokens
        self.prior, self.stop, self.sampling = prior, stop, sampling
        self.stats = GenerationStats()
        self.emitted: list[int] = []
        self.reason: str | None = None
        self.state: DecodeState | None = None
        self.least = min(proposer.min_rows, engine.max_rows or PASS_BUCKETS[-1])
        # log-probabilities of the emitted tokens, one entry each, when asked for (want_logprobs)
        self.logprobs: list[TokenLogprob] | None = None
        self.top_logprobs = 0
        self.penalties: Penalties | None = None  # adjust()
        self.eos = engine.eos  # the tokens that end the answer (none with ignore_eos)
        self._t0 = time.perf_counter()

    def adjust(self, penalties: Penalties | None = None, ignore_eos: bool = False) -> None:
        """Before the prefill: choose every token from the target's distribution adjusted by
        ``penalties`` (medusa/decoding/penalties.py; its ``min_tokens`` holds this run's EOS
        tokens back); with ``ignore_eos``, an EOS token does not end the answer."""
        if penalties is not None and penalties.min_tokens and not penalties.eos:
            penalties = replace(penalties, eos=tuple(sorted(self.engine.eos)))
        if penalties is not None and penalties.active:
            self.penalties = penalties
        if ignore_eos:
            self.eos = frozenset()

    def want_logprobs(self, top: int = 0) -> None:
        """Record each emitted token's log-probability under the target (its raw logits, before
        temperature or filters: what verification computed, so exact under speculation) and the
        ``top`` likeliest tokens at its position, in :attr:`logprobs`."""
        self.logprobs, self.top_logprobs = [], top

    def prefill(self) -> list[int]:
        """Run the prompt; the first token's chunk (empty if nothing may be emitted)."""
        for _ in self.prefill_chunks():
            pass
        return self.first_chunk()

    def prefill_chunks(self) -> Generator[None, None, None]:
        """:meth:`prefill` one pass at a time (``next`` runs one); then :meth:`first_chunk`."""
        engine = self.engine
        passes = engine.passes.for_generation(lambda: engine.pass_sizes(self.proposer))
        self.state = yield from prefill_chunks(engine, self.ids, self.prior, self.stats, self.sampling,
                                                       self.max_new_tokens, passes, self.penalties)

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
        return chunk

    def begin(self) -> None:
        self.proposer.begin(self.state)

    def propose(self, rows_cap: int | None = None) -> Proposal | None:
        """This step's proposal (within ``rows_cap`` rows: a batch's share), or None when the
        generation is over (:attr:`reason` says why)."""
        if self.reason is None:
            self.reason = self._stop_reason()
        if self.reason is not None:
            return None
        t1 = time.perf_counter()
        proposal = self.engine._propose(self.proposer, self.state, self.max_new_tokens - len(self.emitted), rows_cap)
        self.stats.draft_seconds += time.perf_counter() - t1
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
        self.stats.seconds = time.perf_counter() - self._t0
        return GenerationResult(tokens=self.emitted, stats=self.stats, finish_reason=self.reason or "stopped",
                                state=self.state, logprobs=self.logprobs)

    def _stop_reason(self) -> str | None:
        """Why the loop must stop before the next step (None: go on)."""
        if self.stop.is_set():
            return "stopped"
        limit = self.engine.max_positions
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
