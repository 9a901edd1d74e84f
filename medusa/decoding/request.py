"""A request as data, its sequence's status, and the typed events a generation emits.

A :class:`Request` is made by one function, :func:`make_request`, from what a caller passes
(:meth:`Engine.stream <medusa.decoding.engine.Engine.stream>`'s arguments, a scheduler's
``submit``, the server's checked body), and checked there as far as it can be without the
engine; the engine checks the rest (the vocabulary, the context window, the mode) when it turns
the request into a running sequence (:class:`~medusa.decoding.run.Decoding`), whose
:class:`Status` says where it is.

What the sequence emits are the typed events of :mod:`medusa.decoding.generation`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.generation import as_token_list
from medusa.decoding.penalties import Penalties
from medusa.decoding.sampling import SamplingConfig
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.decoding.state import DecodeState, Proposer


class Status(enum.Enum):
    """Where a request's sequence is: queued, prefilling its prompt, decoding, or ended."""

    WAITING = "waiting"  # made, its prompt not yet run
    PREFILLING = "prefilling"  # its prompt runs, a chunk at a time
    RUNNING = "running"  # decoding: propose -> verify -> accept
    FINISHED = "finished"  # ended with a finish reason (eos, length, context, stopped)
    FAILED = "failed"  # ended by an error in its own work


@dataclass(frozen=True, eq=False)
class Request:
    """One generation's request, as data (see :func:`make_request`, which makes and checks it).

    ``state``: an earlier generation's final state whose cache a chat's next turn reuses (the
    library only: a scheduler owns its caches). ``max_draft``: drafted tokens one step may verify
    (0: no speculation; None: as many as the proposer and the batch allow). ``logprobs``: record
    each emitted token's log-probability and this many alternatives (None: none). ``penalties``:
    adjustments to the target's distribution (medusa/decoding/penalties.py). ``ignore_eos``: an
    EOS token does not end the answer."""

    prompt: tuple[int, ...]
    max_new_tokens: int = MAX_NEW_TOKENS
    mode: str | Proposer | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: str | Sequence[Sequence[int]] | None = None
    state: DecodeState | None = None
    max_draft: int | None = None
    logprobs: int | None = None
    penalties: Penalties | None = None
    ignore_eos: bool = False


def make_request(
    input_ids: Sequence[int] | torch.Tensor | Mapping | Request,
    max_new_tokens: int = MAX_NEW_TOKENS,
    mode: str | Proposer | None = None,
    temperature: float | None = None,
    tree: str | Sequence[Sequence[int]] | None = None,
    state: DecodeState | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    acceptance: str | None = None,
    sampling: SamplingConfig | None = None,
    max_draft: int | None = None,
    logprobs: int | None = None,
    penalties: Penalties | None = None,
    ignore_eos: bool = False,
) -> Request:
    """The :class:`Request` for these arguments (a Request passed alone is returned as is).

    ``input_ids``: token ids (a list, a ``[T]``/``[1, T]`` tensor or a tokenizer's output).
    ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``seed`` and ``acceptance``
    (``"lossless"`` or the lossy ``"typical"``) override ``sampling`` (default:
    :class:`~medusa.decoding.sampling.SamplingConfig`, which documents them). The other
    arguments are :class:`Request`'s fields. A bad argument raises a one-line
    :class:`~medusa.errors.MedusaError`."""
    if isinstance(input_ids, Request):
        return input_ids
    ids = as_token_list(input_ids)
    if not ids:
        raise MedusaError("input_ids is empty: give at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise MedusaError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}")
    if max_draft is not None and (isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 0):
        raise MedusaError(f"max_draft must be a whole number >= 0 (0: no speculation), got {max_draft!r}")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise MedusaError(f"logprobs must be a whole number >= 0 (alternatives per token), got {logprobs!r}")
    # defaults come from SamplingConfig alone; the keyword arguments override them
    sampling = (sampling or SamplingConfig()).override(temperature=temperature, top_p=top_p, top_k=top_k,
                                                       seed=seed, acceptance=acceptance)
    return Request(prompt=tuple(ids), max_new_tokens=max_new_tokens, mode=mode, sampling=sampling, tree=tree,
                   state=state, max_draft=max_draft, logprobs=logprobs, penalties=penalties,
                   ignore_eos=bool(ignore_eos))
