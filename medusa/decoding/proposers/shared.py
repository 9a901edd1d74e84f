"""Drafting several sequences' proposals together: their heads' calls made once for all of them.

A proposer whose heads run several times a step (EAGLE and EAGLE-3: the layer on the pairs the
target accepted, then on each level of the draft tree, and the draft vocabulary's scores at each
level) drafts as a coroutine, :meth:`~medusa.decoding.state.Proposer.steps`: it yields an
:class:`Ask` for each call of its heads and is sent the answer. :func:`alone` answers one
proposer's asks as they come (a sequence on its own: ``propose``); :func:`together` runs the
coroutines of a batch's sequences in lockstep and answers each round's asks of the same heads with
one call of their layer (medusa/runtime/drafter.py's ``step_many``: every product reads the
weights once for all the sequences' rows) and one scoring product, where one call runs the layer
(the one-call drafter); elsewhere each ask runs as it would alone. Medusa heads ask once a step,
for each head's top-k on the last hidden state: a round's asks are one call over all the states
where the heads score on the gemv kernels (:func:`_top`); block heads' drafter passes share their
products the same way (:func:`_blocks`).

The answers are the same bits either way: the C layer and the packed products compute each row
from its own values in a fixed order, so a sequence drafts the same tree alone or beside others.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from medusa.runtime import drafter


@dataclass(eq=False)
class Ask:
    """One call of a proposer's heads: their layer on ``layer``'s rows ``(features, tokens,
    positions, visible)``, appended to the proposer's cache (None: no layer), then, with ``scored``,
    the draft vocabulary's log-probabilities of the layer's outputs (or of ``features`` where there
    is no layer; a ``[H]`` feature gives ``[S]``). The answer is ``(outputs or None, logp or None)``;
    ``seconds`` is this ask's share of the call that answered it."""

    proposer: object  # the asking proposer: its ``heads``, ``cache`` and ``_layer`` (run alone)
    layer: tuple | None = None
    features: torch.Tensor | None = None
    scored: bool = False
    seconds: float = 0.0
    # Medusa heads' call instead: ``(k, n)``, the top ``k`` token ids of each of the first ``n``
    # heads on ``features`` ``[H]``; the answer is their ``[n, k]`` ids
    topk: tuple[int, int] | None = None
    # block heads' call instead: ``(root, position)``, one drafter pass over the proposer's context
    # buffer; the answer is its ``[k, S]`` logits
    block: tuple | None = None

    def rows(self) -> int:
        return self.layer[0].shape[0] if self.layer is not None else 1


Steps = Generator[Ask, tuple, object]


def alone(steps: Steps):
    """Drive one coroutine to its end, each ask answered on its own; returns what it returns."""
    try:
        ask = next(steps)
        while True:
            answer = _timed([ask])[0]
            ask = steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
    except StopIteration as stop:
        return stop.value


def together(coroutines: list[Steps]) -> list:
    """Drive every coroutine to its end in lockstep: each round, the asks of one heads share a
    call. Returns each one's result, or the exception it raised (it fails alone: the others go on)."""
    results: list = [None] * len(coroutines)
    asks: dict[int, Ask] = {}

    def resume(i: int, answer=None, first: bool = False) -> None:
        try:
            if first:
                asks[i] = next(coroutines[i])
            elif isinstance(answer, BaseException):
                asks[i] = coroutines[i].throw(answer)
            else:
                asks[i] = coroutines[i].send(answer)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as exc:  # noqa: BLE001 - this sequence's own drafting: it fails alone
            results[i] = exc

    for i in range(len(coroutines)):
        resume(i, first=True)
    while asks:
        groups: dict[int, list[tuple[int, Ask]]] = {}
        for i, ask in sorted(asks.items()):
            groups.setdefault(id(ask.proposer.heads), []).append((i, ask))
        asks.clear()
        for group in groups.values():
            for (i, _), answer in zip(group, _timed([a for _, a in group])):
                resume(i, answer)
    return results


def _timed(asks: list[Ask]) -> list:
    """:func:`_answer`, its time shared out over the asks by their rows."""
    t0 = time.perf_counter()
    with torch.inference_mode():  # as the proposers draft (their heads' caches are inference tensors)
        answers = _answer(asks)
    seconds, rows = time.perf_counter() - t0, sum(a.rows() for a in asks)
    for a in asks:
        a.seconds = seconds * a.rows() / rows
    return answers


def _answer(asks: list[Ask]) -> list:
    """The answers to asks of one heads, each a tuple or the exception its own call raised: the
    layer in one C call for those whose caches the one-call drafter holds (undone, and each run on
    its own, where that call fails), the others' through their own proposers, then one scoring
    product (each scored on its own where it fails)."""
    heads = asks[0].proposer.heads
    if asks[0].topk is not None:
        return _top(heads, asks)
    if asks[0].block is not None:
        return _blocks(heads, asks)
    outs: list = [None] * len(asks)
    layered = [i for i, a in enumerate(asks) if a.layer is not None]
    table = drafter.table(heads) if len(layered) > 1 else None
    joint = [i for i in layered if table is not None and isinstance(asks[i].proposer.cache, drafter.DraftCache)]
    if len(joint) > 1:
        caches = [asks[i].proposer.cache for i in joint]
        before = [c.length for c in caches]
        try:
            calls = [(*asks[i].layer[:3], c, asks[i].layer[3]) for i, c in zip(joint, caches)]
            for i, out in zip(joint, drafter.step_many(heads, table, calls)):
                outs[i] = out
        except Exception:  # noqa: BLE001 - undone: each runs on its own below, and fails alone
            for i, c, n in zip(joint, caches, before):
                c.crop(n)
                outs[i] = None
    for i in layered:
        if outs[i] is None:
            try:
                outs[i] = asks[i].proposer._layer(*asks[i].layer)
            except Exception as exc:  # noqa: BLE001 - this sequence's own call
                outs[i] = exc
    scored = [i for i, a in enumerate(asks) if a.scored and not isinstance(outs[i], BaseException)]
    logps: list = [None] * len(asks)
    for part in ([scored] if len(scored) > 1 else []) + [[i] for i in scored]:
        if all(logps[i] is not None for i in part):
            continue
        try:
            inputs = [outs[i] if outs[i] is not None else asks[i].features for i in part]
            flat = [x.reshape(-1, x.shape[-1]) for x in inputs]
            logp = torch.log_softmax(heads.logits(torch.cat(flat), heads.draft_vocab).float(), dim=-1)
            for i, x, rows in zip(part, inputs, logp.split([f.shape[0] for f in flat])):
                logps[i] = rows.reshape(*x.shape[:-1], rows.shape[-1])
        except Exception as exc:  # noqa: BLE001 - scored together: each again alone; alone: its own error
            if len(part) == 1:
                outs[part[0]] = exc
    return [outs[i] if isinstance(outs[i], BaseException) else (outs[i], logps[i]) for i in range(len(asks))]


def _top(heads, asks: list[Ask]) -> list:
    """Medusa heads' top-k asks: one call for all of them (as many heads as the deepest asks for,
    each ask's own cut from it) where each input gets its own bits there (``heads.shares_rows``),
    else, or where that call fails, each on its own."""
    if len(asks) > 1 and len({a.topk[0] for a in asks}) == 1 and heads.shares_rows():
        try:
            k, n = asks[0].topk[0], max(a.topk[1] for a in asks)
            top = heads.topk_many(torch.stack([a.features for a in asks]), k, n)  # [B, n, k]
            return [t[:a.topk[1]] for a, t in zip(asks, top)]
        except Exception:  # noqa: BLE001 - each again on its own below, failing alone
            pass
    out: list = []
    for a in asks:
        try:
            out.append(heads.topk(a.features, a.topk[0], num_heads=a.topk[1]))
        except Exception as exc:  # noqa: BLE001 - this sequence's own call
            out.append(exc)
    return out


def _blocks(heads, asks: list[Ask]) -> list:
    """Block heads' drafter passes: one :meth:`draft_many` over every sequence's block where each
    gets its own bits there (``heads.shares_rows``), else, or where it fails, each on its own."""
    if len(asks) > 1 and heads.shares_rows():
        try:
            roots = torch.stack([a.block[0].reshape(()) for a in asks])
            positions = torch.cat([a.block[1] for a in asks])
            out = heads.draft_many(roots, positions, [a.proposer.kv for a in asks], [a.proposer.valid() for a in asks])
            return list(out)
        except Exception:  # noqa: BLE001 - each again on its own below, failing alone
            pass
    done: list = []
    for a in asks:
        try:
            done.append(a.proposer._logits(*a.block, heads.block_size))
        except Exception as exc:  # noqa: BLE001 - this sequence's own pass
            done.append(exc)
    return done
