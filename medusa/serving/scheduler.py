"""Continuous batching: one thread owns the engine; requests join and leave between steps.

Callers :meth:`Scheduler.submit` a request and read its :class:`Stream` (token chunks as they are
accepted, then the :class:`~medusa.decoding.generation.GenerationResult`); the scheduler thread
alone touches the engine. Each turn of its loop

1. admits waiting requests while fewer than ``max_batch`` run, and prefills one of them (a long
   prompt in the engine's chunks, ``Engine.prefill_chunk`` tokens, one a turn, so running streams
   keep going);
2. asks every running sequence for its proposal, shares the turn's row budget between them
   (:mod:`medusa.serving.budget`: trees shrink as the batch grows) and verifies all of them in
   one packed pass (:meth:`~medusa.decoding.engine.Engine.step_many`);
3. hands each sequence's accepted tokens to its stream, and drops finished or cancelled ones.

Greedy requests give the tokens they give alone whatever else runs (a budget cut changes only
how many tokens a step accepts); a sampled request keeps its whole proposal, so its seed gives
the same sample at any batch composition (docs/exactness.md#batches).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from medusa.decoding.engine import Decoding, Engine
from medusa.decoding.generation import GenerationResult
from medusa.decoding.penalties import Penalties
from medusa.errors import MedusaError
from medusa.serving.budget import knee, share_rows

if TYPE_CHECKING:
    from medusa.serving.metrics import Metrics

log = logging.getLogger("medusa.serving")

EXPLORE = 16  # every 16th turn of a batch size tries the choice that measured slower


class Overloaded(MedusaError):
    """The scheduler's queue is full: try again later (a server answers 429)."""


class Closed(MedusaError):
    """The scheduler is shutting down or has stopped (a server answers 503)."""


@dataclass
class Stream:
    """One request's output: iterate for lists of new token ids; :attr:`result` once it ends.
    :meth:`cancel` (safe from any thread) frees its slot at the scheduler's next turn."""

    run: Decoding
    max_draft: int | None = None  # drafted tokens a step may verify for this request (None: the batch's share)
    submitted: float = field(default_factory=time.perf_counter)
    result: GenerationResult | None = None
    error: BaseException | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)
    # called from the scheduler thread with each event as it is queued (an asyncio server hands
    # them to its loop with call_soon_threadsafe); events queued before it was set are not repeated
    listener: Callable[[tuple[str, object]], None] | None = None

    def _put(self, kind: str, value: object) -> None:
        event = (kind, value)
        self._events.put(event)
        if self.listener is not None:
            self.listener(event)

    def cancel(self) -> None:
        self.run.stop.set()

    @property
    def cancelled(self) -> bool:
        return self.run.stop.is_set()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            kind, value = self._events.get()
            if kind == "tokens":
                yield value
            elif kind == "done":
                self.result = value
                return
            else:
                self.error = value
                raise value

    def get(self, timeout: float | None = None) -> tuple[str, object]:
        """The next event: ``("tokens", [ids])``, ``("done", result)`` or ``("error", exc)``;
        :class:`queue.Empty` after ``timeout`` seconds."""
        return self._events.get(timeout=timeout)

    def wait(self) -> GenerationResult:
        """Read to the end; the result (raises what the request failed with)."""
        for _ in self:
            pass
        return self.result


class Scheduler:
    """Runs an :class:`Engine`'s generations side by side (see the module docstring).

    ``max_batch``: sequences decoding at once; ``max_queue``: requests waiting beyond those
    (more: :class:`Overloaded`); ``row_budget``: rows a batched pass verifies at most (None: from
    the machine plan's pass costs, :func:`~medusa.serving.budget.knee`). Prompts are prefilled
    :attr:`Engine.prefill_chunk` tokens a turn, the chunks the engine cuts them into alone."""

    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64, row_budget: int | None = None,
                 metrics: Metrics | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise MedusaError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        self.row_budget = row_budget or knee(engine.plan.pass_ms, engine.device.type)
        self._waiting: deque[Stream] = deque()
        self._prefilling: list[tuple[Stream, Iterator]] = []
        self._running: list[Stream] = []
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._rates: dict[tuple[int, bool], float] = {}  # (batch size, drafting) -> tokens/s (_drafting)
        self.metrics = metrics  # medusa.serving.metrics: recorded here, rendered by the server
        self.steps = 0  # batched passes run (for tests and the bench)
        self.max_seen = 0  # the largest batch a pass verified

    # -- the caller's side ----------------------------------------------------------
    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="medusa-scheduler", daemon=True)
            self._thread.start()
        return self

    def submit(self, input_ids, listener: Callable[[tuple[str, object]], None] | None = None,
               max_draft: int | None = None, logprobs: int | None = None, penalties: Penalties | None = None,
               ignore_eos: bool = False, **kwargs) -> Stream:
        """Queue a generation (:meth:`Engine.stream`'s arguments, checked here: a bad request
        raises before it queues; ``listener``: :attr:`Stream.listener`; ``max_draft``: at most
        this many drafted tokens verified a step, 0 = no speculation; ``logprobs``: record each token's
        log-probability and this many alternatives, :meth:`Decoding.want_logprobs`; ``penalties``,
        ``ignore_eos``: :meth:`Decoding.adjust`). :class:`Overloaded` when
        the queue is full, :class:`Closed` while shutting down."""
        if kwargs.get("state") is not None:
            raise MedusaError("state= continues a cache a scheduler does not own: submit the whole prompt")
        if max_draft is not None and (isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 0):
            raise MedusaError(f"max_draft must be a whole number >= 0 (0: no speculation), got {max_draft!r}")
        run = self.engine.decoding(input_ids, **kwargs)
        if logprobs is not None:
            run.want_logprobs(logprobs)
        run.adjust(penalties, ignore_eos)
        stream = Stream(run, max_draft=max_draft, listener=listener)
        with self._wake:
            if self._closing:
                raise Closed("the scheduler is shutting down: no new requests")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - self._active()):
                raise Overloaded(f"{len(self._waiting)} requests are waiting already (max_queue {self.max_queue}): "
                                 "retry later")
            self._waiting.append(stream)
            self._wake.notify()
        return stream

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, let the running and waiting ones finish, stop the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def load(self) -> dict[str, int]:
        """How many requests wait, prefill and decode now."""
        with self._wake:
            return {"waiting": len(self._waiting), "prefilling": len(self._prefilling), "running": len(self._running)}

    def _active(self) -> int:
        return len(self._prefilling) + len(self._running)

    # -- the scheduler thread -------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._prefilling or self._running or self._closing):
                    self._wake.wait()
                if self._closing and not (self._waiting or self._prefilling or self._running):
                    return
                while self._waiting and self._active() < self.max_batch:
                    stream = self._waiting.popleft()
                    if not self._finish_if_cancelled(stream):
                        self._prefilling.append((stream, self._prefill(stream)))
            try:
                self._turn()
            except BaseException as exc:  # noqa: BLE001 - a failed pass ends its requests, not the server
                # a request's own prefill, drafting or update fails alone (_fail); this is the
                # shared pass itself, which no one request can be blamed for
                log.exception("medusa: a batched pass failed; the requests in it end with the error")
                for stream in [s for s, _ in self._prefilling] + self._running:
                    self._end(stream, "error", MedusaError(f"decoding failed: {exc}"))
                self._prefilling, self._running = [], []

    def _prefill(self, stream: Stream) -> Iterator:
        """A prompt's prefill, one chunk per ``next``; emits the first token at the end."""
        run = stream.run
        chunks = run.prefill_chunks()
        yield from chunks
        first = run.first_chunk()
        run.begin()
        if self.metrics is not None:
            self.metrics.first_token(time.perf_counter() - stream.submitted, run.stats.prefill_seconds,
                                     run.stats.prefill_tokens, len(first))
        if first:
            stream._put("tokens", first)

    def _turn(self) -> None:
        engine = self.engine
        with engine._lock, engine._kernels:
            self._prefill_chunk()
            live, proposals = [], []
            running = list(self._running)
            drafting = self._drafting(len(running))
            t0 = time.perf_counter()
            caps = self._caps(running) if drafting else [1 if s.run.sampling.greedy else None for s in running]
            caps = [_within(cap, s.max_draft) for s, cap in zip(running, caps)]
            for stream, cap in zip(running, caps):
                try:
                    proposal = stream.run.propose(cap)
                except Exception as exc:  # noqa: BLE001 - this request's own drafting: it ends alone
                    self._running.remove(stream)
                    self._fail(stream, exc)
                    continue
                if proposal is None:
                    self._running.remove(stream)
                    self._end(stream, "done", stream.run.result())
                    continue
                live.append(stream)
                proposals.append(proposal)
            if not live:
                return
            t1 = time.perf_counter()
            outcomes = []
            for group in self._groups(proposals):
                outcomes += engine.step_many([live[i].run for i in group], [proposals[i] for i in group])
            seconds = (time.perf_counter() - t1) / len(live)
            self.steps += 1
            self.max_seen = max(self.max_seen, len(live))
            emitted, drafted, kept = 0, [], []
            for stream, proposal, outcome in zip(live, proposals, outcomes):
                stream.run.stats.verify_seconds += seconds
                try:
                    chunk, accepted = stream.run.advance(outcome)
                except Exception as exc:  # noqa: BLE001 - this request's own update: it ends alone
                    self._running.remove(stream)
                    self._fail(stream, exc)
                    continue
                emitted += len(chunk)
                drafted.append(proposal.tokens.shape[0] - 1)
                kept.append(accepted)
                if chunk:
                    stream._put("tokens", chunk)
            self._record(len(running), drafting, emitted / (time.perf_counter() - t0))
            if self.metrics is not None:
                self.metrics.step_done(len(live), time.perf_counter() - t0, drafted, kept, emitted)

    def _prefill_chunk(self) -> None:
        """One chunk of the first waiting prompt's prefill (one a turn: running streams go on)."""
        for stream, chunks in self._prefilling[:1]:
            if self._finish_if_cancelled(stream):
                self._prefilling.remove((stream, chunks))
                continue
            try:
                prefilled = next(chunks, StopIteration) is StopIteration
            except Exception as exc:  # noqa: BLE001 - this request's own prefill: it ends alone
                self._prefilling.remove((stream, chunks))
                self._fail(stream, exc)
                continue
            if prefilled:
                self._prefilling.remove((stream, chunks))
                self._running.append(stream)

    def _fail(self, stream: Stream, exc: BaseException) -> None:
        """End one request with the error its own work raised; the others go on."""
        log.warning("medusa: a request failed in its own step and ends with the error: %s", exc)
        self._end(stream, "error", MedusaError(f"decoding failed: {exc}"))

    def _end(self, stream: Stream, kind: str, value: object) -> None:
        """A request's last event (``done`` with its result, or ``error``), counted."""
        if self.metrics is not None:
            self.metrics.ended(value.finish_reason if kind == "done" else None)
        stream._put(kind, value)

    def _finish_if_cancelled(self, stream: Stream) -> bool:
        """End a request cancelled before its prefill finished."""
        if not stream.cancelled:
            return False
        run = stream.run
        self._end(stream, "done", GenerationResult(tokens=[], stats=run.stats, finish_reason="stopped", state=None))
        return True

    def _drafting(self, batch: int) -> bool:
        """Whether this turn's greedy sequences draft at all. Drafting costs each sequence its own
        drafter passes while the batch's verification rows grow cheaper to fill with roots, so
        whether it pays depends on the batch size, the drafter and the machine: the scheduler
        keeps the measured tokens per second of turns with and without drafts for each batch
        size and takes the faster, trying the other every ``EXPLORE`` turns. A lone sequence
        always drafts, as it does alone."""
        if batch <= 1:
            return True
        spec, plain = self._rates.get((batch, True)), self._rates.get((batch, False))
        if spec is None or plain is None:
            return spec is None  # measure each once
        explore = self.steps % EXPLORE == 0
        return (spec >= plain) != explore

    def _record(self, batch: int, drafting: bool, rate: float) -> None:
        """A turn's tokens per second into its (batch size, drafting) running mean."""
        key = (batch, drafting)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + 0.2 * (rate - old)

    def _caps(self, running: list[Stream]) -> list[int | None]:
        """Each sequence's rows this turn, decided before anything is drafted: the turn's budget
        shared out by the proposers' largest proposals (a lone sequence drafts as it does alone;
        a sampled request keeps its whole proposal; a share of 1 row drafts nothing)."""
        if len(running) <= 1:
            return [None] * len(running)
        budget = max(self.row_budget, len(running))
        wanted = [_within(s.run.proposer.max_rows or budget, s.max_draft) for s in running]
        fixed = [not s.run.sampling.greedy for s in running]
        shares = share_rows(wanted, fixed, budget, offset=self.steps)
        return [None if f else n for n, f in zip(shares, fixed)]

    def _groups(self, proposals: list) -> list[list[int]]:
        """The passes a turn runs: all sequences in one, or as many as the engine's row cap
        (``max_rows``: the rows its kernels are exact for) requires."""
        cap = self.engine.max_rows
        if cap is None:
            return [list(range(len(proposals)))]
        groups, rows = [[]], 0
        for i, p in enumerate(proposals):
            n = p.tokens.shape[0] + (0 if p.side is None else p.side.tokens.shape[0])
            if groups[-1] and rows + n > cap:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += n
        return groups


def _within(cap: int | None, max_draft: int | None) -> int | None:
    """A step's row cap within a request's own draft limit (the root plus ``max_draft`` rows)."""
    if max_draft is None:
        return cap
    return 1 + max_draft if cap is None else min(cap, 1 + max_draft)
