"""The decode step, for one sequence or many: the engine's only step.

A :class:`Batch` holds sequences (:class:`~medusa.decoding.run.Decoding`) on one engine's passes.
:meth:`Batch.prefill` runs one chunk of the first waiting prompt (a long prompt takes several
turns, so running sequences keep going); :meth:`Batch.step` asks every running sequence for its
proposal (within the rows a caller's policy gives it), verifies them in one packed target pass
(several passes where the kernels' exact row cap requires, one by one where the caches cannot
pack), accepts, and returns what happened as typed events. The library's
:meth:`Engine.stream <medusa.decoding.engine.Engine.stream>` is a batch of one;
:class:`medusa.serving.scheduler.Scheduler` runs many. Time is accounted here alone: drafting in
each sequence's proposal, the verification pass shared out over the sequences in it, the update.

A request's own work that raises (its prefill, drafting, acceptance or update) fails that request
alone. A packed pass that raises is undone (each cache cropped back to its length) and its
sequences verify one by one: the one whose own pass raises fails, the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from medusa.decoding.generation import Done, Event, Failed, Tokens
from medusa.decoding.passes.strategies import PassStrategy
from medusa.decoding.proposers import shared
from medusa.decoding.request import Status
from medusa.decoding.run import Decoding, accept, accept_chains, greedy_chain
from medusa.decoding.state import Proposal
from medusa.runtime import hf as kv
from medusa.runtime import packed

log = logging.getLogger("medusa.decoding")

# a policy: each running sequence's row cap this step (None: its whole proposal; 1: no draft)
Caps = Callable[[list[Decoding]], list[int | None]]
PREFILL_FLOOR = 16  # rows a step gives a prompt's prefill at least, whatever the proposals take


@dataclass
class StepReport:
    """What one :meth:`Batch.step` did: the events it emitted (``(sequence, event)``), the
    sequences running when it began (``batch``) and verified (``live``), its wall-clock seconds
    (drafting, passes and updates), and per verified sequence the tokens drafted and kept."""

    events: list[tuple[Decoding, Event]] = field(default_factory=list)
    batch: int = 0
    live: int = 0
    seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    emitted: int = 0
    runs: list[Decoding] = field(default_factory=list)  # the verified sequences, as drafted and kept
    prefilled: Decoding | None = None  # a sequence whose prefill ended in this step's pass
    chunk: int = 0  # a waiting prompt's rows this step's pass ran


class Batch:
    """Sequences decoding together on ``passes`` (see the module docstring); ``max_rows``: the
    rows one pass verifies exactly at most (None: any). The caller holds the engine's lock and
    kernel scope around each call (:meth:`Engine.owned <medusa.decoding.engine.Engine.owned>`)."""

    def __init__(self, passes: PassStrategy, max_rows: int | None) -> None:
        self.passes, self.max_rows = passes, max_rows
        self.prefilling: list[tuple[Decoding, Iterator]] = []  # in arrival order; the first runs
        self.running: list[Decoding] = []

    def __len__(self) -> int:
        return len(self.prefilling) + len(self.running)

    def add(self, run: Decoding) -> None:
        """Queue ``run``'s prefill (it starts at a later :meth:`prefill`)."""
        self.prefilling.append((run, run.prefill_chunks()))

    def remove(self, run: Decoding) -> None:
        """Drop ``run``, wherever it is (its caller ends it)."""
        self.prefilling = [(r, c) for r, c in self.prefilling if r is not run]
        run.drop_prefill()
        if run in self.running:
            self.running.remove(run)

    def prefill(self) -> tuple[Decoding | None, list[tuple[Decoding, Event]]]:
        """One chunk of the first waiting prompt. Returns the sequence whose prefill ended with
        it (None: none did) and the events: its first tokens, or its failure."""
        if not self.prefilling:
            return None, []
        run, chunks = self.prefilling[0]
        try:
            if next(chunks, StopIteration) is not StopIteration:
                return None, []
            first = run.first_chunk()
            run.begin()
        except Exception as exc:  # noqa: BLE001 - this request's own prefill: it fails alone
            self.prefilling.pop(0)
            return None, [(run, _failed(run, exc))]
        self.prefilling.pop(0)
        self.running.append(run)
        return run, [(run, Tokens(first))] if first else []

    def fusable(self) -> bool:
        """Whether the first waiting prompt's prefill may run in the next steps' passes beside the
        running sequences' rows (:meth:`Decoding.fusable`; it goes on so once begun)."""
        if not self.prefilling or self.max_rows is not None:
            return False
        run = self.prefilling[0][0]
        return run.fusable() and (bool(self.running) or run.status is Status.PREFILLING)

    @torch.inference_mode()
    def step(self, caps: Caps | None = None, prefill: int | None = None) -> StepReport:
        """Propose, verify in one packed pass, accept: one step of every running sequence.
        ``caps``: the policy giving each its rows (None: each drafts its whole proposal, as alone);
        a request's own ``max_draft`` caps it further. ``prefill`` (where :meth:`fusable`): the
        pass's rows, of which the first waiting prompt's next chunk gets what the proposals leave
        (:data:`PREFILL_FLOOR` at least), the very rows its own prefill would run; after its last
        chunk it joins the running sequences with its first token."""
        running = list(self.running)
        report = StepReport(batch=len(running))
        t0 = time.perf_counter()
        wanted = caps(running) if caps is not None else [None] * len(running)
        live: list[Decoding] = []
        proposals: list[Proposal] = []
        # every sequence's drafting at once: their heads' calls shared (medusa/decoding/proposers/shared.py)
        drafted = shared.together([run.propose_steps(within(cap, run.request.max_draft))
                                   for run, cap in zip(running, wanted)])
        for run, proposal in zip(running, drafted):
            if isinstance(proposal, BaseException):  # this request's own drafting: it fails alone
                self.running.remove(run)
                report.events.append((run, _failed(run, proposal)))
                continue
            if proposal is None:
                self.running.remove(run)
                report.events.append((run, Done(run.result())))
                continue
            live.append(run)
            proposals.append(proposal)
        report.live = len(live)
        items = [(run.state.cache, run.state.length, p) for run, p in zip(live, proposals)]
        fused = None if prefill is None else self._fused_prefill(report, prefill - sum(map(_rows, proposals)))
        if items or fused is not None:
            t1 = time.perf_counter()
            verified = self._verify(items, [run.least for run in live], None if fused is None else fused[1])
            share = (time.perf_counter() - t1) / (len(items) + (fused is not None))
            if fused is not None:
                report.chunk = fused[1].ids.shape[0]
                self._fused_done(fused[0], verified.pop(), share, report)
            outcomes = _accepted_chains(live, proposals, verified)
            for run, proposal, outcome in zip(live, proposals, outcomes):
                run.stats.verify_seconds += share
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    if isinstance(outcome, tuple):
                        outcome = accept(run.state, proposal, *outcome)
                    chunk, drafted = run.advance(outcome)
                except Exception as exc:  # noqa: BLE001 - this request's own pass or update: it fails alone
                    self.running.remove(run)
                    report.events.append((run, _failed(run, exc)))
                    continue
                report.emitted += len(chunk)
                report.runs.append(run)
                report.drafted.append(proposal.tokens.shape[0] - 1)
                report.kept.append(drafted)
                if chunk:
                    report.events.append((run, Tokens(chunk, drafted)))
        report.seconds = time.perf_counter() - t0
        return report

    def _verify(self, items: list[tuple[object, int, Proposal]], least: list[int],
                chunk: packed.Chunk | None = None) -> list[tuple | Exception]:
        """Each ``(cache, start, proposal)`` verified: the pass's outputs for it (or the error its own
        pass raised), in one packed pass per group of at most :attr:`max_rows` rows; static caches
        one by one (``least``: each one's smallest pass). ``chunk``: a prompt's rows in the same
        pass (no row cap then); its outputs, or its error, come last."""
        out: list[tuple | Exception | None] = [None] * len(items)
        for group in self._groups([p for _, _, p in items]):
            pack = [i for i in group if self.passes.packs and not kv.is_static(items[i][0])]
            if len(pack) > 1 or (chunk is not None and pack):
                try:
                    these = [items[i] for i in pack]
                    verified = (self.passes.verify_many(these) if chunk is None
                                else self.passes.verify_many(these, chunk))
                except Exception as exc:  # noqa: BLE001 - undone; each sequence then verifies alone
                    log.warning("medusa: a packed pass of %d sequences failed (%s); they verify one by one",
                                len(pack), exc)
                    for i in pack:
                        kv.crop(items[i][0], items[i][1])
                    if chunk is not None:
                        kv.crop(chunk.cache, chunk.start)
                else:
                    if chunk is not None:
                        out.append(verified.pop())
                        chunk = None
                    for i, v in zip(pack, verified):
                        out[i] = v
            for i in group:
                if out[i] is None:
                    cache, start, proposal = items[i]
                    try:
                        out[i] = self.passes.verify(cache, start, proposal, least[i])
                    except Exception as exc:  # noqa: BLE001 - this request's own pass: it fails alone
                        kv.crop(cache, start)
                        out[i] = exc
        if chunk is not None:  # alone: the prompt's own prefill pass over the same rows
            try:
                logits, hidden = self.passes.prefill(chunk.cache, chunk.ids[None], chunk.start, 1)
                out.append((logits if chunk.last else None, hidden))
            except Exception as exc:  # noqa: BLE001 - this request's own prefill: it fails alone
                out.append(exc)
        return out

    def _fused_prefill(self, report: StepReport, rows: int) -> tuple[Decoding, packed.Chunk] | None:
        """The first waiting prompt's next rows for this step's pass, ``rows`` (at least
        :data:`PREFILL_FLOOR`; :meth:`Decoding.fused_prefill`)."""
        if not self.fusable():
            return None
        run = self.prefilling[0][0]
        try:
            return run, run.fused_prefill(max(rows, PREFILL_FLOOR))
        except Exception as exc:  # noqa: BLE001 - this request's own prefill: it fails alone
            self.remove(run)
            report.events.append((run, _failed(run, exc)))
            return None

    def _fused_done(self, run: Decoding, verified, seconds: float, report: StepReport) -> None:
        """A chunk's outputs; after the prompt's last, its state and first token: it runs from the
        next step."""
        run.stats.verify_seconds += seconds
        try:
            if isinstance(verified, BaseException):
                raise verified
            first = run.fused_done(*verified)
        except Exception as exc:  # noqa: BLE001 - this request's own prefill: it fails alone
            self.remove(run)
            report.events.append((run, _failed(run, exc)))
            return
        if first is None:
            return
        self.prefilling.pop(0)
        self.running.append(run)
        report.prefilled = run
        if first:
            report.events.append((run, Tokens(first)))

    def _groups(self, proposals: list[Proposal]) -> list[list[int]]:
        """The passes a step runs: all sequences in one, or as many as :attr:`max_rows` (the
        rows the kernels are exact for) requires."""
        cap = self.max_rows
        if cap is None:
            return [list(range(len(proposals)))]
        groups, rows = [[]], 0
        for i, p in enumerate(proposals):
            n = _rows(p)
            if groups[-1] and rows + n > cap:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += n
        return groups


def _accepted_chains(live: list[Decoding], proposals: list[Proposal], verified: list) -> list:
    """``verified`` with the greedy chains among them accepted at once (:func:`accept_chains`: one
    host sync for all); the others are left as they are, for :func:`accept` one by one (and for
    all, should accepting them at once raise)."""
    chains = [i for i, (run, p, v) in enumerate(zip(live, proposals, verified))
              if not isinstance(v, BaseException) and greedy_chain(run.state, p)]
    if len(chains) < 2:
        return verified
    try:
        accepted = accept_chains([(live[i].state, proposals[i], verified[i]) for i in chains])
    except Exception:  # noqa: BLE001 - accepted one by one instead, each failure its own request's
        return verified
    out = list(verified)
    for i, outcome in zip(chains, accepted):
        out[i] = outcome
    return out


def _rows(proposal: Proposal) -> int:
    """A proposal's rows in a pass: its candidates and side rows."""
    return proposal.tokens.shape[0] + (0 if proposal.side is None else proposal.side.tokens.shape[0])


def _failed(run: Decoding, exc: Exception) -> Failed:
    run.status = Status.FAILED
    return Failed(exc)


def within(cap: int | None, max_draft: int | None) -> int | None:
    """A step's row cap within a request's own draft limit (the root plus ``max_draft`` rows)."""
    if max_draft is None:
        return cap
    return 1 + max_draft if cap is None else min(cap, 1 + max_draft)
