"""The chat's session (``python -m infer.chat``): a multi-turn conversation with the target's
chat template, each turn re-using the KV cache of the turns before it (the engine's ``state=``),
answers streamed as the engine accepts them with their statistics, and the /commands. Ctrl-C
stops an answer at a step boundary (kept); a second one aborts it (dropped).
"""

from __future__ import annotations

import argparse
import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from medusa.chat.prepare import (
    OOM_HINT,
    Style,
    is_out_of_memory,
    prepare_auto,
    release_memory,
    sampling_config,
    sampling_label,
    say,
)
from medusa.conversation import Conversation
from medusa.decoding.text import TextStream

if TYPE_CHECKING:
    from medusa.decoding.engine import Engine, Generation, GenerationResult

# 2 (bad usage) comes from argparse itself.
EXIT_OK, EXIT_USER_ERROR, EXIT_OOM, EXIT_INTERRUPTED = 0, 1, 3, 130

HELP = """commands:
  /reset       forget the conversation (and its cache)
  /mode NAME   switch decoding mode for the next answers ({modes})
  /stats       statistics of this session
  /save FILE   write the conversation (messages and token ids) as JSON
  /help        this list
  /exit        leave (Ctrl-D works too)
Ctrl-C stops the current answer and keeps the session; what was printed stays in the conversation."""


# -- Ctrl-C while decoding ---------------------------------------------------------------
class StopOnInterrupt:
    """While an answer streams, the first Ctrl-C asks the engine to stop at the next step
    boundary (the cache stays consistent and the printed tokens stay in the conversation);
    a second Ctrl-C aborts at once."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.interrupted = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        self.generation.stop()

    def __enter__(self) -> StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


# -- the session -------------------------------------------------------------------------
@dataclass
class Totals:
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    accepted: int = 0  # tokens emitted by decode steps (the prefill's first token excluded)


class Chat:
    """One chat session: its conversation and the cache of its last answer (each turn prefills
    only the new message), streamed answers, statistics and /commands. ``args``: the chat's
    parsed command line; notices go to stderr through ``style``."""

    def __init__(self, engine: Engine, args: argparse.Namespace, mode: str, style: Style, window: int) -> None:
        self.engine = engine
        self.args = args
        self.sampling = sampling_config(args)
        self.mode = mode
        self.style = style
        self.window = window
        self.conversation = Conversation(engine.tokenizer, args.system)
        self.state = None  # DecodeState of the last answer: its cache seeds the next turn
        self.totals = Totals()
        self.last: GenerationResult | None = None

    # -- answering ------------------------------------------------------------------------
    def generation_kwargs(self) -> dict[str, Any]:
        return {"max_new_tokens": self.args.max_new_tokens, "mode": self.mode, "tree": self.args.tree,
                    "sampling": self.sampling}

    def answer(self, user: str, out: TextIO) -> int:
        """Answer one message, streaming it to ``out``; returns an exit code."""
        from medusa.errors import MedusaError

        try:
            prompt = self.conversation.fit(user, self.window, self.args.max_new_tokens)
            if prompt.dropped:
                say(self.style.dim(f"[dropped the {prompt.dropped} oldest turn(s) to fit the "
                                   f"{self.window}-token context window]"))
            generation = self.engine.stream(prompt.ids, state=self.state, **self.generation_kwargs())
        except MedusaError as err:
            say(self.style.error(f"error: {err}"))
            return EXIT_USER_ERROR
        # The generation writes into the previous state's cache: until it ends cleanly there
        # is no state to reuse (an interruption anywhere leaves None, a full prefill next).
        self.state = None
        decoder = TextStream(self.engine.tokenizer)  # leading spaces, characters split over tokens
        stopper = StopOnInterrupt(generation)
        try:
            with stopper:
                for chunk in generation:
                    out.write(self.render(decoder, chunk, generation.proposed))
                    out.flush()
        except KeyboardInterrupt:
            # Aborted mid-step: the cache may hold half a step, so it and this turn are dropped.
            out.write("\n")
            say(self.style.dim("[aborted: this answer is dropped from the conversation]"))
            return EXIT_INTERRUPTED
        except MedusaError as err:
            out.write("\n")
            say(self.style.error(f"error: {err}"))
            return EXIT_USER_ERROR
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            del err  # its traceback holds the failed pass's tensors
            release_memory()
            out.write("\n")
            say(self.style.error(f"error: {OOM_HINT}"))
            return EXIT_OOM
        out.write(decoder.flush() + "\n")
        out.flush()
        result = generation.result
        assert result is not None
        self.state = result.state
        self.last = result
        self.conversation.add(user, prompt, result.tokens, result.finish_reason, result.stats.as_dict())
        self.count(result)
        say(self.style.dim(self.stats_line(result)))
        return EXIT_INTERRUPTED if result.finish_reason == "stopped" else EXIT_OK

    def render(self, decoder: TextStream, chunk: list[int], proposed: int) -> str:
        """The chunk's text; the first ``proposed`` tokens were drafted (coloured with --show-accepted)."""
        return self.style.drafted(decoder.push(chunk[:proposed])) + decoder.push(chunk[proposed:])

    def count(self, result: GenerationResult) -> None:
        s = result.stats
        self.totals.answers += 1
        self.totals.tokens += s.new_tokens
        self.totals.seconds += s.seconds
        self.totals.steps += s.steps
        self.totals.accepted += sum(s.accepted)

    @staticmethod
    def stats_line(result: GenerationResult) -> str:
        s = result.stats
        ending = {"eos": "", "length": " · hit --max-new-tokens", "context": " · context window full",
                  "stopped": " · stopped"}.get(result.finish_reason, f" · {result.finish_reason}")
        tau = f"{s.tau:.2f}" if s.steps else "-"  # no decode step ran: the answer came from the prefill
        return (f"[{s.new_tokens} tokens in {s.seconds:.2f} s · {s.tokens_per_second:.1f} tok/s · "
                f"tau {tau} · {s.new_tokens / (s.steps + 1):.2f} tok/pass · "
                f"prefill {s.prefill_tokens} tokens in {s.prefill_seconds:.2f} s{ending}]")

    # -- commands -------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        from medusa.decoding.proposers.factory import MODES
        from medusa.errors import MedusaError

        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            say(HELP.format(modes=", ".join(MODES)))
        elif name == "/reset":
            self.conversation.reset()
            self.state = None
            say(self.style.dim("[conversation cleared]"))
        elif name == "/mode":
            if not arg:
                say(f"mode: {self.mode} (available: {', '.join(MODES)})")
                return True
            try:
                self.engine.proposer(arg, self.args.tree)
            except MedusaError as err:
                say(self.style.error(f"error: {err}"))
                return True
            self.mode = arg
            say(self.style.dim(f"[mode: {arg}]"))
            if self.engine.passes.name == "auto":  # this mode's pass sizes: loaded, or built in the background
                prepare_auto(self.engine, arg, self.args, self.style)
        elif name == "/stats":
            say(self.session_stats())
        elif name == "/save":
            if not arg:
                say(self.style.error("error: /save needs a file name, e.g. /save chat.json"))
                return True
            try:
                Path(arg).expanduser().write_text(json.dumps(self.transcript(), indent=1) + "\n")
            except OSError as err:
                say(self.style.error(f"error: cannot write {arg}: {err.strerror or err}"))
                return True
            say(self.style.dim(f"[saved {len(self.conversation.turns)} turn(s) to {arg}]"))
        else:
            say(self.style.error(f"error: unknown command {name}: /help lists the commands"))
        return True

    def session_stats(self) -> str:
        t = self.totals
        rate = t.tokens / t.seconds if t.seconds else 0.0
        tau = t.accepted / t.steps if t.steps else 0.0
        per_pass = t.tokens / (t.steps + t.answers) if t.answers else 0.0
        cached = self.state.length if self.state is not None else 0
        lines = [(f"session: {t.answers} answer(s), {t.tokens} tokens, {rate:.1f} tok/s, tau {tau:.2f}, "
                 f"{per_pass:.2f} tok/pass"),
                 (f"conversation: {len(self.conversation.turns)} turn(s), {cached} tokens cached, "
                 f"context window {self.window}"),
                 (f"decoding: mode {self.mode}, {sampling_label(self.sampling)}, "
                 f"max {self.args.max_new_tokens} new tokens")]
        if self.last is not None:
            lines.append(f"last answer: {self.stats_line(self.last)}")
        return "\n".join(lines)

    def transcript(self) -> dict[str, Any]:
        conv = self.conversation
        return {"system": conv.system, "mode": self.mode,
                "messages": conv.messages(conv.turns, None),
                "turns": [vars(t) for t in conv.turns], "ids": conv.ids}
