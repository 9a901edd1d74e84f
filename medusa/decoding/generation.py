"""What a generation gives back: its typed events (:class:`Tokens`, then :class:`Done` or
:class:`Failed`, read by every reader with :func:`read`), the token stream, its result and its
statistics, and the prompt forms :meth:`medusa.decoding.engine.Engine.stream` takes."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from medusa.decoding.state import DecodeState
from medusa.errors import MedusaError


@dataclass
class GenerationStats:
    steps: int = 0  # target passes after the prefill
    new_tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per target pass
    prefill_tokens: int = 0  # prompt tokens run at prefill: only the new ones when a state's cache is reused
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # prefill + decode, wall clock
    # Where the decode steps' time went (wall clock, summed over steps): the proposer drafting,
    # the target's verification pass with acceptance and cache bookkeeping (it ends in the step's
    # host sync, so on a GPU it also holds whatever queued work had not finished), the proposer's
    # update. The rest of ``seconds`` is the prefill and the loop itself (and the caller's time
    # between streamed chunks).
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    update_seconds: float = 0.0
    # steps decoded plainly because this sequence's drafts kept fewer tokens than they cost
    # (medusa/decoding/payoff.py)
    plain_steps: int = 0
    # steps drafted lean (mode hybrid's lookup chain without the heads) because that paid more here
    lean_steps: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (the mean accepted length, bonus token included)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "new_tokens": self.new_tokens, "tau": self.tau,
                "tokens_per_second": self.tokens_per_second, "prefill_tokens": self.prefill_tokens,
                "prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
                "verify_seconds": self.verify_seconds, "update_seconds": self.update_seconds, "plain_steps": self.plain_steps,
                "lean_steps": self.lean_steps,
                "seconds": self.seconds, "accepted": list(self.accepted)}


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos", "length", "context" or "stopped"
    state: DecodeState | None = None
    logprobs: list | None = None  # a TokenLogprob per token when asked for (Request.logprobs)


# -- events: what a generation tells its reader, read in one place (read) ------------
@dataclass(frozen=True)
class Tokens:
    """Token ids a step accepted (the prefill's first token, then each step's); ``drafted``: how
    many of the leading ones the proposer drafted (the rest is the target's own token)."""

    ids: list[int]
    drafted: int = 0


@dataclass(frozen=True)
class Done:
    """The generation ended: its result."""

    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    """The generation ended with an error (its own work failed, or the pass it was in)."""

    error: BaseException


Event = Tokens | Done | Failed  # what a generation emits


def read(event: Event, into) -> list[int] | None:
    """Read one event for ``into`` (a stream or generation with ``result`` and ``error``
    attributes): a :class:`Tokens`'s ids; None once :class:`Done` (its result stored in
    ``into.result``); a :class:`Failed` stores its error in ``into.error`` and raises it."""
    if isinstance(event, Tokens):
        return event.ids
    if isinstance(event, Done):
        into.result = event.result
        return None
    if isinstance(event, Failed):
        into.error = event.error
        raise event.error
    raise TypeError(f"not a generation event: {event!r}")


class Generation:
    """An iterator over lists of new token ids as they are accepted; ``result`` when done.

    After each list, ``proposed`` says how many of its leading tokens the proposer drafted
    (heads, draft model, lookup); the rest is the target's own token. ``stop()`` (safe from
    a signal handler or another thread) ends decoding at the next step boundary, with a
    ``result.state`` that holds every token yielded so far and can seed the next turn.
    ``events``: the generation's events, read here with :func:`read`.
    """

    def __init__(self, events: Iterator, stop: threading.Event) -> None:
        self._events = events
        self._stop = stop
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.proposed = 0

    def stop(self) -> None:
        self._stop.set()

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> list[int]:
        event = next(self._events)
        ids = read(event, self)
        if ids is None:
            raise StopIteration
        self.proposed = event.drafted
        return ids

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def as_token_list(input_ids: Sequence[int] | torch.Tensor | Mapping) -> list[int]:
    """Token ids from a list, a ``[T]``/``[1, T]`` tensor or a tokenizer's output (what
    ``apply_chat_template`` returns in transformers 5: a mapping with ``input_ids``)."""
    if isinstance(input_ids, (str, bytes)):
        raise MedusaError("generate and stream take token ids, not text: encode it first, e.g. "
                          "engine.tokenizer.apply_chat_template([{'role': 'user', 'content': text}], "
                          "add_generation_prompt=True)")
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise MedusaError("input_ids is a mapping without an 'input_ids' entry: pass token ids or a tokenizer's output")
        input_ids = input_ids["input_ids"]
        if not isinstance(input_ids, torch.Tensor) and input_ids and isinstance(input_ids[0], (list, tuple)):
            if len(input_ids) != 1:
                raise MedusaError(f"input_ids has batch size {len(input_ids)}: medusa decodes one sequence at a time")
            input_ids = input_ids[0]
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise MedusaError(f"input_ids has batch size {input_ids.shape[0]}: medusa decodes one sequence at a time")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise MedusaError(f"input_ids must be a 1-D list or a [1, T] tensor, got shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    try:
        return [int(t) for t in input_ids]
    except (TypeError, ValueError):
        raise MedusaError("input_ids must be token ids (ints), a [1, T] tensor or a tokenizer's output; "
                          f"got {type(input_ids).__name__} holding {type(next(iter(input_ids), None)).__name__}") from None
