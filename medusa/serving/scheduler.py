"""Continuous batching: one thread owns the engine; requests join and leave between steps.

Callers :meth:`Scheduler.submit` a request and read its :class:`Stream` (token chunks as they are
accepted, then the :class:`~medusa.decoding.generation.GenerationResult`); the scheduler thread
alone touches the engine. Each turn of its loop

1. admits waiting requests while fewer than ``max_batch`` run and their KV caches fit the KV
   memory budget (each request counted at its prompt plus ``max_new_tokens``; the caches are slots
   of one KV store, :func:`kv_store`), and prefills one of them: while others run, a chunk a turn
   as rows of step 2's pass, which gives the running sequences their rows and the prompt the rest
   of ``prefill_rows`` (where passes run as one C call: the prompt's cache holds the same bits
   however it is cut); else in passes of its own, ``Engine.prefill_chunk`` tokens a turn;
2. runs one step of every running sequence, the engine's only step (:class:`~medusa.decoding.batch.Batch`:
   proposals, one packed verification pass, acceptance), with this module's policy for the rows
   each may draft: the turn's row budget shared between them (:mod:`medusa.serving.budget`: trees
   shrink as the batch grows), and within its share each sequence's rows and drafter chosen from
   the pass's cost and what its drafts kept lately (:mod:`medusa.serving.drafting`: plain
   decoding where drafting does not pay);
3. hands each sequence's events to its stream, and drops finished or cancelled ones.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from medusa.decoding import payoff
from medusa.decoding.batch import Batch, within
from medusa.decoding.engine import Decoding, Engine
from medusa.decoding.generation import Done, Event, Failed, GenerationResult, read
from medusa.decoding.request import Request, Status, make_request
from medusa.errors import MedusaError
from medusa.runtime import hf as kv
from medusa.runtime.kvstore import KVStore
from medusa.runtime.rows import attention_shape
from medusa.serving.budget import knee, share_rows
from medusa.serving.drafting import Choice, DraftPolicy
from medusa.serving.prefixes import PrefixCache

if TYPE_CHECKING:
    from medusa.serving.metrics import Metrics

log = logging.getLogger("medusa.serving")

STORE_MARGIN = 256  # positions a KV store slot holds past the context window: a step's draft rows
MIN_SHARED = 8  # tokens a prompt shares with a finished one at least for its prefill to start after them
PREFIX_MEMORY = 256 << 20  # bytes of finished requests' keys and values kept for later prompts (at most)
# rows of a decoding step's pass a waiting prompt's prefill shares with the running sequences':
# they get theirs, it the rest (a CPU's pass of 64 rows costs per row what one of 256 does)
PREFILL_ROWS = 64


class Overloaded(MedusaError):
    """The scheduler's queue is full: try again later (a server answers 429)."""


class Closed(MedusaError):
    """The scheduler is shutting down or has stopped (a server answers 503)."""


@dataclass
class Stream:
    """One request's output: iterate for lists of new token ids; :attr:`result` once it ends.
    :meth:`cancel` (safe from any thread) frees its slot at the scheduler's next turn.

    Its events (:mod:`medusa.decoding.generation`: ``Tokens``, then ``Done`` or ``Failed``) go to
    ``listener`` when one is given (called from the scheduler thread: an asyncio server hands
    them to its loop with ``call_soon_threadsafe``), else to a queue that iterating reads."""

    run: Decoding
    listener: Callable[[Event], None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    result: GenerationResult | None = None
    error: BaseException | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)

    @property
    def max_draft(self) -> int | None:
        """Drafted tokens a step may verify for this request (None: the batch's share)."""
        return self.run.request.max_draft

    def _put(self, event: Event) -> None:
        if self.listener is not None:
            self.listener(event)
        else:
            self._events.put(event)

    def cancel(self) -> None:
        self.run.stop.set()

    @property
    def cancelled(self) -> bool:
        return self.run.stop.is_set()

    def __iter__(self) -> Iterator[list[int]]:
        while (ids := read(self.get(), self)) is not None:
            yield ids

    def get(self, timeout: float | None = None) -> Event:
        """The next event (a stream without a listener); :class:`queue.Empty` after ``timeout`` seconds."""
        if self.listener is not None:
            raise MedusaError("this stream's events go to its listener: read them there")
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
    the machine plan's pass costs, :func:`~medusa.serving.budget.knee`); ``kv_memory``: bytes the
    running requests' KV caches may take (None: :func:`default_kv_memory`): a request waits
    while the ones running would leave too little for its prompt and ``max_new_tokens`` (a
    request alone always runs; its length was checked against the context window).
    ``prefill_rows``: rows of a turn's decoding pass a waiting prompt's prefill shares with the
    running sequences' (:data:`PREFILL_ROWS`; 0: prompts prefill in passes of their own,
    :attr:`Engine.prefill_chunk` tokens a turn). ``prefix_memory``: bytes of finished greedy requests' keys and values kept for later prompts
    that begin as they did (:mod:`medusa.serving.prefixes`; None: :data:`PREFIX_MEMORY` or a
    quarter of ``kv_memory``, the smaller; 0: none kept)."""

    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64, row_budget: int | None = None,
                 metrics: Metrics | None = None, kv_memory: int | None = None,
                 prefix_memory: int | None = None, prefill_rows: int = PREFILL_ROWS) -> None:
        if max_batch < 1 or max_queue < 0:
            raise MedusaError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        if kv_memory is not None and kv_memory < 1:
            raise MedusaError(f"kv_memory must be a positive number of bytes, got {kv_memory}")
        if prefix_memory is not None and prefix_memory < 0:
            raise MedusaError(f"prefix_memory must be a number of bytes >= 0, got {prefix_memory}")
        if prefill_rows < 0:
            raise MedusaError(f"prefill_rows must be >= 0 (0: prompts prefill in passes of their own), got {prefill_rows}")
        self.prefill_rows = prefill_rows
        self.kv_memory = kv_memory if kv_memory is not None else default_kv_memory()
        self.kv_per_token = kv_bytes_per_token(engine.model)
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        self.row_budget = row_budget or knee(engine.plan.pass_ms, engine.device.type)
        self._waiting: deque[Stream] = deque()
        self._batch = Batch(engine.passes, engine.max_rows)  # the sequences prefilling and decoding
        self._streams: dict[Decoding, Stream] = {}  # each of them's stream
        self._wake = threading.Condition()
        self._closing = False
        self._running = False  # the loop runs, or a thread was started to run it
        self._done = threading.Event()  # the loop has returned
        self.policy = DraftPolicy(engine.plan.pass_ms, self.row_budget)
        self.store = kv_store(engine, max_batch, self.kv_memory)  # the running sequences' caches, slot by slot
        self._chosen: dict[Decoding, Choice] = {}  # this turn's choice per greedy sequence (_caps)
        self.metrics = metrics  # medusa.serving.metrics: recorded here, rendered by the server
        self.steps = 0  # batched passes run (for tests and the bench)
        self.max_seen = 0  # the largest batch a pass verified
        # finished greedy requests' keys and values, where a later prompt's shared prefix is copied exactly
        budget = min(PREFIX_MEMORY, self.kv_memory // 4) if prefix_memory is None else prefix_memory
        self._finished = PrefixCache(budget, self.kv_per_token, MIN_SHARED) if shares_prefixes(engine) and budget else None
        self.reused_tokens = 0  # prompt tokens copied from them instead of prefilled

    # -- the caller's side ----------------------------------------------------------
    def start(self) -> Scheduler:
        """Run the loop on a thread of its own (see :meth:`run` for the calling thread instead)."""
        with self._wake:
            if self._running:
                return self
            self._running = True
        threading.Thread(target=self._run, name="medusa-scheduler", daemon=True).start()
        return self

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`close` (from another thread) lets the
        requests finish. ``python -m infer.serve`` runs it on the process's initial thread, where
        the kernels' parallel work costs least (medusa/runtime/pool.c) and the decoding passes
        take what the library's take (docs/serving.md#the-decoding-thread)."""
        with self._wake:
            if self._running:
                raise MedusaError("this scheduler's loop runs already or has run: make a new Scheduler")
            self._running = True
        self._run()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._done.set()

    def submit(self, request: Request | Sequence[int], listener: Callable[[Event], None] | None = None,
               **kwargs) -> Stream:
        """Queue a generation: a :class:`~medusa.decoding.request.Request`, or prompt ids and
        :func:`~medusa.decoding.request.make_request`'s keyword arguments (``max_draft``: at most
        this many drafted tokens verified a step, 0 = no speculation; ``logprobs``, ``penalties``,
        ``ignore_eos``, the sampling settings...). Checked here: a bad request raises before it
        queues. ``listener``: :attr:`Stream.listener`. :class:`Overloaded` when the queue is full,
        :class:`Closed` while shutting down."""
        if isinstance(request, Request):
            if kwargs:
                raise MedusaError(f"submit takes a Request or prompt ids with arguments, not both: {sorted(kwargs)}")
        else:
            request = make_request(request, **kwargs)
        if request.state is not None:
            raise MedusaError("state= continues a cache a scheduler does not own: submit the whole prompt")
        stream = Stream(self.engine.decoding(request), listener=listener)
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
        if self._running:
            self._done.wait(timeout)
        if self._finished is not None:
            self._finished.clear()
        if self.store is not None and self.engine.passes.store is self.store:
            self.engine.passes.store = None  # the engine's later sequences take buffers of their own

    def load(self) -> dict[str, int]:
        """How many requests wait, prefill and decode now."""
        with self._wake:
            return {"waiting": len(self._waiting), "prefilling": len(self._batch.prefilling),
                    "running": len(self._batch.running)}

    def _active(self) -> int:
        return len(self._batch)

    def kv_need(self, run: Decoding) -> int:
        """Bytes ``run``'s KV cache may reach: its prompt and ``max_new_tokens`` (and a step's draft)."""
        return self.kv_per_token * (len(run.request.prompt) + run.request.max_new_tokens + 64)

    def _fits(self, stream: Stream) -> bool:
        """Whether ``stream`` may start now: alone always; beside others if every one's KV fits."""
        running = [r for r, _ in self._batch.prefilling] + self._batch.running
        return not running or sum(map(self.kv_need, running)) + self.kv_need(stream.run) <= self.kv_memory

    # -- the scheduler thread -------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._batch or self._closing):
                    self._wake.wait()
                if self._closing and not (self._waiting or self._batch):
                    return
                while self._waiting and self._active() < self.max_batch and self._fits(self._waiting[0]):
                    stream = self._waiting.popleft()
                    if not self._finish_if_cancelled(stream):
                        self._streams[stream.run] = stream
                        self._start_after_shared_prefix(stream.run)
                        self._batch.add(stream.run)
            try:
                self._turn()
            except BaseException as exc:  # noqa: BLE001 - a fault of the scheduler's own: its requests end, not the server
                # a request's own work and a failed pass fail only their requests (Batch); this is
                # whatever is left, which no one request can be blamed for
                log.exception("medusa: a scheduler turn failed; the requests in it end with the error")
                for run in [r for r, _ in self._batch.prefilling] + self._batch.running:
                    self._batch.remove(run)
                    self._end(run, Failed(exc))

    def _turn(self) -> None:
        batch = self._batch
        with self.engine.owned():
            for run, _ in batch.prefilling[:1]:
                if self._finish_if_cancelled(self._streams[run]):
                    batch.remove(run)
                    del self._streams[run]
            fuse = self.prefill_rows > 0 and batch.fusable()  # a chunk of it rides in the step's pass
            prefilled, events = (None, []) if fuse else batch.prefill()
            self._first_token(prefilled)
            self._emit(events)
            if not batch.running and not fuse:
                return
            before = {run: run.stats.draft_seconds for run in batch.running}
            report = batch.step(self._caps, prefill=self.prefill_rows if fuse else None)
            self._first_token(report.prefilled)
            self._observe(report, before)
            self._emit(report.events)
            if not report.live:
                return
            self.steps += 1
            self.max_seen = max(self.max_seen, report.live)
            lone = report.runs[0].check if report.batch == 1 and report.runs else None
            drafting = (report.batch <= 1 and not (lone and lone.capped)) or any(c.rows > 1 for c in self._chosen.values())
            if self.metrics is not None:
                self.metrics.step_done(report.live, report.seconds, report.drafted, report.kept, report.emitted,
                                       drafting)

    def _first_token(self, run: Decoding | None) -> None:
        if run is not None and self.metrics is not None:
            stats = run.stats
            self.metrics.first_token(time.perf_counter() - self._streams[run].submitted, stats.prefill_seconds,
                                     stats.prefill_tokens, len(run.emitted))

    def _emit(self, events) -> None:
        """Hand each ``(sequence, event)`` to its stream; a last event ends the request."""
        for run, event in events:
            if isinstance(event, (Done, Failed)):
                self._end(run, event)
            else:
                self._streams[run]._put(event)

    def _start_after_shared_prefix(self, run: Decoding) -> None:
        """A greedy request's prefill starts after the longest prefix (at least :data:`MIN_SHARED`
        tokens) its prompt shares with a finished greedy request's tokens: those positions are
        copied from that request's cache, the very bits its own prefill would compute
        (:func:`shares_prefixes`). Its proposer starts afresh (no carried drafting state), so
        only how fast it drafts can differ, never a token. Sampled requests prefill whole."""
        if self._finished is None or not run.sampling.greedy or run.prior is not None:
            return
        best, shared = self._finished.longest(run.ids)
        if best is not None:
            run.prior = replace(best, share=None, carry={})  # copied, never continued in place
            self.reused_tokens += min(shared, len(run.ids) - 1)

    def _end(self, run: Decoding, event: Done | Failed) -> None:
        """A request's last event, counted; a failure is said in one line to its client."""
        stream = self._streams.pop(run)
        self.policy.forget(run)
        if isinstance(event, Done) and self._finished is not None and run.sampling.greedy and event.result.state is not None:
            self._finished.add(event.result.state)
        if isinstance(event, Failed):
            log.warning("medusa: a request failed and ends with the error: %s", event.error)
            event = Failed(MedusaError(f"decoding failed: {event.error}"))
        self._close(stream, event)

    def _close(self, stream: Stream, event: Done | Failed) -> None:
        stream.run.status = Status.FINISHED if isinstance(event, Done) else Status.FAILED
        if self.metrics is not None:
            self.metrics.ended(event.result.finish_reason if isinstance(event, Done) else None)
        stream._put(event)

    def _finish_if_cancelled(self, stream: Stream) -> bool:
        """End a request cancelled before its prefill finished."""
        if not stream.cancelled:
            return False
        run = stream.run
        self._close(stream, Done(GenerationResult(tokens=[], stats=run.stats, finish_reason="stopped", state=None)))
        return True

    def _caps(self, running: list[Decoding]) -> list[int | None]:
        """Each sequence's rows this turn, decided before anything is drafted: the turn's budget
        shared out by the proposers' largest proposals, then within its share each greedy
        sequence's rows and drafter chosen by :attr:`policy` (a lone sequence drafts as it does
        alone; a sampled request keeps its whole proposal; 1 row drafts nothing). Rows that
        sequences decoding plainly leave are shared again among the drafting ones."""
        self._chosen = {}
        for run in running:
            run.lean = False
        if len(running) <= 1:
            return payoff.caps(running)  # a lone sequence's own check of whether drafting pays
        budget = max(self.row_budget, len(running))
        wanted = [within(r.proposer.max_rows or budget, r.request.max_draft) for r in running]
        fixed = [not r.sampling.greedy for r in running]
        greedy = [i for i, f in enumerate(fixed) if not f]
        shares = share_rows(wanted, fixed, budget, offset=self.steps)
        others = sum(s for s, f in zip(shares, fixed) if f)
        choices = self.policy.choose([running[i] for i in greedy], [shares[i] for i in greedy], others)
        plain = [i for i, c in zip(greedy, choices) if c.rows == 1]
        if plain and len(plain) < len(greedy):
            for i in plain:
                wanted[i] = 1
            shares = share_rows(wanted, fixed, budget, offset=self.steps)
            choices = self.policy.choose([running[i] for i in greedy], [shares[i] for i in greedy], others, again=True)
        caps: list[int | None] = [None] * len(running)
        for i, choice in zip(greedy, choices):
            # a plain or lean step needs no heads: their update waits until they next draft
            running[i].lean, caps[i] = choice.lean or choice.rows == 1, choice.rows
            self._chosen[running[i]] = choice
        return caps

    def _observe(self, report, before: dict[Decoding, float]) -> None:
        """What each greedy sequence's choice drafted and kept, and the turn's time, to the policy."""
        payoff.observe(report)
        drafting_ms = 0.0
        for run, drafted, kept in zip(report.runs, report.drafted, report.kept):
            ms = 1000.0 * (run.stats.draft_seconds - before.get(run, run.stats.draft_seconds))
            drafting_ms += ms
            choice = self._chosen.get(run)
            if choice is not None:
                self.policy.observe(run, choice, drafted, kept, ms)
        if self._chosen and report.live and not report.chunk:  # a prompt's rows would inflate the time
            self.policy.turn_took(report.seconds, report.live + sum(report.drafted), drafting_ms,
                                  sum(d > 0 for d in report.drafted))


def shares_prefixes(engine: Engine) -> bool:
    """Whether a prompt's cache holds the same bits however the prompt was cut into passes, so
    that a later prompt may start from a shared prefix's copy exactly: prefills and decoding
    passes run as one-call passes (medusa/runtime/packed.py's ``prefill``), with no sliding
    window that a long prefill chunk would exceed."""
    return engine.passes.whole_calls and not getattr(kv.text_config(engine.model), "sliding_window", None)


def kv_store(engine: Engine, max_batch: int, kv_memory: int) -> KVStore | None:
    """A KV store for the engine's dynamic caches (medusa/runtime/kvstore.py), set on its passes:
    a slot for each of ``max_batch`` sequences and one prefilling, each as long as the context
    window (and a pass's rows past it), as many as ``kv_memory`` holds (at least one). None where
    the passes keep static caches or the context has no limit."""
    passes, window = engine.passes, engine.passes.max_positions
    if passes.static or not window:
        return None
    capacity = window + STORE_MARGIN
    slots = max(1, min(max_batch + 1, kv_memory // (capacity * kv_bytes_per_token(engine.model))))
    passes.store = KVStore(engine.model, slots, capacity)
    return passes.store


def kv_bytes_per_token(model) -> int:
    """Bytes one position of ``model``'s KV cache takes: keys and values of every layer."""
    _, kv_heads, dim = attention_shape(model)
    return 2 * kv.text_config(model).num_hidden_layers * kv_heads * dim * model.dtype.itemsize


def default_kv_memory(fraction: float = 0.5) -> int:
    """Half the memory available now (``MemAvailable``), or 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return int(fraction * kib * 1024)
    except (OSError, StopIteration, ValueError, IndexError):
        return 4 << 30
