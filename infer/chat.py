"""``python -m infer.chat``: chat with a model, answers streamed as the engine accepts them.

Multi-turn, with the target's chat template. Each turn re-uses the KV cache of the turns
before it (the engine's ``state=``), so only the new message is prefilled. Answers go to
stdout; the banner, notices, stats lines and errors go to stderr, so
``python -m infer.chat --prompt "..." > answer.txt`` keeps only the answer.

Exit codes: 0 done, 1 a problem the user can fix (bad path, heads for another model, a
message too long, ...), 2 bad command-line usage, 3 out of memory, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # the heavy imports wait until the banner has been printed
    from medusa.decoding.engine import Engine, Generation, GenerationResult
    from medusa.decoding.sampling import SamplingConfig

from medusa.config import HelpFormatter, count
from medusa.conversation import Conversation
from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.text import TextStream
from medusa.models import kinds
from medusa.models.target import set_chat_template
from medusa.runtime.kernels import kernels_arg

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


# -- terminal output ---------------------------------------------------------------------
class Style:
    """ANSI colours: on terminals only, except the drafted-token colour of ``--show-accepted``,
    which was asked for explicitly."""

    def __init__(self, enabled: bool, show_accepted: bool = False) -> None:
        self.enabled = enabled
        self.show_accepted = show_accepted

    def wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled and text else text

    def dim(self, text: str) -> str:
        return self.wrap("2", text)

    def drafted(self, text: str) -> str:
        return f"\x1b[32m{text}\x1b[0m" if self.show_accepted and text else text

    def error(self, text: str) -> str:
        return self.wrap("31", text)


def say(text: str, stream: TextIO | None = None) -> None:
    """A line for the user on stderr (banner, notices, stats): stdout carries only answers."""
    stream = stream or sys.stderr
    stream.write(text + "\n")
    stream.flush()


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


def is_out_of_memory(err: BaseException) -> bool:
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(err).lower()
    # oneDNN (bfloat16 linears and matmuls, packed float32 linears) reports a failed allocation
    # only as "could not create a primitive"; the packed linears fall back to torch's kernel,
    # but bfloat16 has no other CPU kernel to fall back to
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("out of memory", "can't allocate memory", "could not create a primitive"))


def release_memory() -> None:
    """After a failed allocation: free what the failed turn left, and hand the freed heap back to
    the system (glibc keeps it otherwise), so that the next turn has the memory it had before."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


OOM_HINT = ("out of memory: /reset the conversation, lower --max-new-tokens or --max-context, "
            "use a smaller --tree, or --dtype bfloat16")


# -- the session -------------------------------------------------------------------------
@dataclass
class Totals:
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    accepted: int = 0  # tokens emitted by decode steps (the prefill's first token excluded)


class Chat:
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


# -- startup -----------------------------------------------------------------------------
def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The options given, over SamplingConfig's defaults (raises MedusaError on bad values)."""
    from medusa.decoding.sampling import SamplingConfig

    return SamplingConfig().override(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                     seed=args.seed, acceptance=args.acceptance)


def sampling_label(sampling: SamplingConfig) -> str:
    if sampling.greedy:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    if sampling.top_p < 1:
        parts.append(f"top-p {sampling.top_p:g}")
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    parts.append(f"{sampling.acceptance} acceptance")
    if sampling.seed is not None:
        parts.append(f"seed {sampling.seed}")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="medusa-chat" if Path(sys.argv[0]).name == "medusa-chat" else "python -m infer.chat",
        description="Chat with a model through Medusa heads, a draft model, prompt lookup or plain decoding.",
        epilog="Exit codes: 0 done, 1 a problem to fix (bad path, mismatched heads, message too long), "
               "2 bad usage, 3 out of memory, 130 interrupted.", formatter_class=HelpFormatter,
    )
    p.add_argument("--model", help="Hub id, model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", help="heads folder, or 'init' for untrained heads (default: the embedded model's shipped "
                                   "heads for the device, EAGLE-3 on a CPU and Medusa on CUDA; with --mode medusa, "
                                   "eagle or eagle3 its shipped heads of that kind)")
    p.add_argument("--draft", help="draft model for --mode draft: folder, Hub id, .gguf file or 'default' "
                                   "(default: none)")
    p.add_argument("--mode", help="medusa, eagle, eagle3 or block (the loaded heads' kind), hybrid (heads + prompt lookup), draft, lookup, "
                                  "lookahead (greedy only) or baseline "
                                  "(default: hybrid when heads are loaded, "
                                  "draft when --draft is given, else baseline)")
    p.add_argument("--temperature", type=float, help="0 is greedy (the default); above 0 samples")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with this much probability "
                                               "(default: 1.0 = off)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, help="seed for sampling: the same seed gives the same answer (default: none)")
    p.add_argument("--acceptance", help="with sampling: lossless (exactly the target's distribution, default) "
                                        "or typical (Medusa's, accepts more, lossy)")
    p.add_argument("--max-new-tokens", type=count(1), default=MAX_NEW_TOKENS, help="longest answer in tokens")
    p.add_argument("--max-context", type=count(1), default=None,
                   help="keep the conversation within this many tokens (default: the model's context window); "
                        "the oldest turns are dropped")
    p.add_argument("--system", help="system prompt (default: the chat template's)")
    p.add_argument("--chat-template", help="Jinja chat template (a file or the text) for a model whose tokenizer has "
                                           "none, e.g. configs/chat_templates/question_answer.jinja for a base model (default: the "
                                           "tokenizer's own)")
    p.add_argument("--tree", help="Medusa tree: a name in medusa/assets/trees (cpu, gpu) or a JSON file of paths "
                                  "(default: calibrated per device)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the faster exact one on this device, measured once and cached)")
    p.add_argument("--compile", nargs="?", const="on", choices=("auto", "on", "off"),
                   default=os.environ.get("MEDUSA_COMPILE", "auto"),
                   help="auto (the default; MEDUSA_COMPILE sets another): on a CPU, the pass sizes "
                        "this machine has saved run compiled and the others eagerly while python -m "
                        "infer.precompile compiles them in the background, at low priority (a --prompt answer "
                        "stays eager); on: static KV cache and a torch.compile'd pass (CUDA graphs on CUDA), "
                        "every pass size compiled before the first message (minutes the first time on a CPU, "
                        "then saved); off: eager")
    p.add_argument("--kernels", type=kernels_arg,
                   help="linear kernels: torch's default, packed oneDNN weights on a CPU, gemv (this package's "
                        "float32 CPU kernels), or gemv above N rows and torch's below (gemv>N) (default: the "
                        "fastest here, measured once and cached)")
    p.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"),
                   help="the heads' dtype: drafts only, the target verifies every token in --dtype (default: the "
                        "target's, or bfloat16 beside a float32 target where it measures faster here; int8: eagle "
                        "heads on int8 weights, CPU)")
    p.add_argument("--show-accepted", action="store_true",
                   help="colour the tokens drafted by the heads/draft that the target accepted")
    p.add_argument("--prompt", help="answer this one message and exit (default: an interactive chat)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.max_context is not None and args.max_context < 2:
        p.error("--max-context must be at least 2")
    return args


def embedded_needs_dequantising() -> bool:
    from medusa.models.target import DEFAULT_MODEL_NAME
    from medusa.runtime.files import cache_root

    return not (cache_root() / "models" / DEFAULT_MODEL_NAME / "config.json").is_file()


def heads_for(args: argparse.Namespace) -> str | None:
    """The heads to load: --heads, else for the embedded default model the shipped heads of the
    kind --mode names (every kind in medusa.api.SHIPPED), else None (medusa.load's default)."""
    from medusa.api import SHIPPED

    if args.heads is None and args.model is None and args.mode in SHIPPED:
        return args.mode  # this mode names a kind: the shipped heads of it (medusa.api.default_heads)
    return args.heads


def load_engine(args: argparse.Namespace, style: Style) -> Engine:
    import medusa
    from medusa.runtime.files import cache_root

    if args.model is None and embedded_needs_dequantising():
        say(style.dim("first use: dequantising the embedded model from GGUF, about 40 s (cached for next time)"))
    if not (cache_root() / "plan.json").is_file():  # what load() measures and caches (the machine plan)
        say(style.dim("first start on this machine: measuring the machine plan (dtype, kernels, tree sizes; "
                      "cached for next time)"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        heads = heads_for(args)
        # --tree goes with each call (pick_mode says when the loaded heads cannot use it)
        engine = medusa.load(args.model, heads=heads, draft=args.draft, device=args.device, dtype=args.dtype,
                             compile={"on": True, "off": False, "auto": "auto"}[args.compile], kernels=args.kernels,
                             draft_dtype=args.draft_dtype)
    # medusa's own warnings (e.g. an undistilled default draft) are notes for the user; they
    # point into medusa or at this caller. Other libraries' warnings are noise here.
    ours = (str(Path(medusa.__file__).resolve().parent), str(Path(__file__).resolve()))
    for w in caught:
        if issubclass(w.category, UserWarning) and str(Path(w.filename).resolve()).startswith(ours):
            say(style.dim(f"note: {str(w.message).splitlines()[0]}"))
    return engine


def pick_mode(args: argparse.Namespace, engine: Engine, style: Style) -> str:
    mode = args.mode or engine.default_mode  # the library's default (hybrid with heads)
    if mode == "baseline" and args.mode is None:
        whose = "ship with this install yet" if args.model is None else f"were given for {args.model}"
        say(style.dim(f"note: no trained heads {whose}: decoding in baseline mode (--heads FOLDER for trained "
                      "heads, --heads init for untrained ones, --mode lookup for prompt lookup)"))
    engine.proposer(mode, args.tree)  # the engine's one-line error for a mode it cannot run (a tree for eagle heads)
    return mode


def precompile(engine: Engine, mode: str, args: argparse.Namespace, style: Style) -> None:
    """--compile on: every pass size the mode can use is ready now, not inside the first answers
    (on the CPU each size compiles once per machine and is saved; later starts load it)."""
    t0 = time.perf_counter()
    say(style.dim("preparing the compiled verification pass (compiled once and saved, loaded after) ..."))
    buckets = engine.precompile(mode, args.tree,
                                progress=lambda rows, s: say(style.dim(f"  {rows} rows: {s:.1f} s")))
    n = len(buckets)
    say(style.dim(f"{n} pass size{'s' if n != 1 else ''} ready in {time.perf_counter() - t0:.1f} s"))


def prepare_auto(engine: Engine, mode: str, args: argparse.Namespace, style: Style) -> None:
    """--compile auto: load the pass sizes this machine has saved, and have the others built in
    the background (``Engine.build_passes``; once all are saved, the next answer runs compiled).
    Nothing compiles in this process."""
    build = engine.build_passes(mode, args.tree)
    if build.loaded:
        say(style.dim(f"compiled passes: {_sizes(build.loaded)} loaded in {build.seconds:.1f} s"))
    if not build.missing:
        return
    if build.skipped is not None:
        say(style.dim(f"compiled passes: {_sizes(build.missing)} not saved on this machine yet, so eager; not built "
                      f"in the background: {build.skipped} (python -m infer.precompile builds them with the chat closed)"))
        return
    if build.started:
        started = f"compiling them in the background at low priority (pid {build.pid}, log {build.log})"
    else:
        started = (f"process {build.pid} is compiling passes of this model already (python -m infer.precompile "
                   f"--sizes {','.join(map(str, build.missing))} after it, for any it leaves out)")
    say(style.dim(f"compiled passes: {_sizes(build.missing)} not saved on this machine yet, so eager for now; "
                  f"{started}; answers run compiled once all are saved (--compile off: never)"))


def _sizes(sizes: list[int]) -> str:
    return f"size{'s' if len(sizes) != 1 else ''} {', '.join(map(str, sizes))}"


def block_line(args: argparse.Namespace, engine: Engine, mode: str) -> str:
    """The banner's line for block heads: the block, its layers and vocabulary, the proposal."""
    c = engine.heads.config
    facts = kinds.kind(c.kind)
    proposer = engine.proposer(mode if mode in facts.modes else c.kind)  # lookup, baseline: the heads' own
    label = "sized here" if engine.plan.eagle is not None else "default"
    return (f"heads   {args.heads} · block of {c.num_heads} tokens per drafter pass (layers "
            f"{', '.join(map(str, c.feature_layers))}, {c.draft_vocab_size:,}-token draft vocabulary) · "
            f"proposal {label}: {proposer.describe()}")


def banner(args: argparse.Namespace, engine: Engine, mode: str, window: int, style: Style) -> str:
    from medusa.decoding.tree import compile_tree

    lm = engine.model
    params = sum(p.numel() for p in lm.parameters()) / 1e6
    model = args.model or "SmolLM2-135M-Instruct (embedded)"
    lines = [(f"model   {model} · {params:.1f}M parameters · {engine.device} {str(lm.dtype).removeprefix('torch.')} "
             f"· context {window} tokens")]
    # what the machine plan picked and why (dtype, kernels, rows, heads' dtype, trees)
    lines += [line for line in engine.describe() if not line.startswith(("passes", "mode"))]
    facts = None if engine.heads is None else kinds.kind(engine.heads.config.kind)
    if facts is not None and facts.dynamic_tree:
        from medusa.decoding.tree import tree_key

        c, key = engine.heads.config, tree_key(engine.device.type, engine.model.dtype)
        proposer = engine.proposer(mode if mode in facts.modes else c.kind)  # lookup, baseline: the heads' own
        device = key if key in engine.heads.dynamic else engine.device.type
        label = f"calibrated for {device}" if device in engine.heads.dynamic else "default"
        label = "sized here" if engine.plan.eagle is not None else label
        kind = (f"eagle3 (layers {', '.join(map(str, c.feature_layers))}, {c.draft_vocab_size:,}-token draft vocabulary)"
                if facts.fused else f"eagle ({c.eagle_layout})")
        lines.append(f"heads   {args.heads or 'shipped'} · {kind}, {c.num_heads} draft steps trained · "
                     f"proposal {label}: {proposer.describe()}")
    elif facts is not None and facts.drafts_per_step:
        lines.append(block_line(args, engine, mode))
    elif engine.heads is not None:
        c = engine.heads.config
        source = args.heads or "shipped"
        tree = compile_tree(engine.tree_paths(args.tree))
        device = engine.device.type
        label = args.tree or (f"calibrated for {device}" if engine.heads.trees.get(device) is not None
                              else ("gpu" if device == "cuda" else "cpu"))
        lines.append(f"heads   {source} · {c.num_heads} heads x {c.num_layers} layer(s) · tree {label} "
                     f"({tree.num_nodes} nodes, depth {tree.max_depth})")
    if args.draft is not None:
        lines.append(f"draft   {args.draft}")
    if args.compile == "auto" and not engine.passes.compiled:  # the auto pick said no: say why
        lines.append(f"passes  {engine.passes.reason}")
    lines.append(f"mode    {mode} · {sampling_label(sampling_config(args))} · up to {args.max_new_tokens} new tokens")
    if args.show_accepted:
        lines.append("colours " + style.drafted("drafted and accepted") + " · plain: the target's own token")
    return "\n".join(lines)


def read_stdin_prompt() -> str | None:
    """The whole of a piped stdin as one prompt; None when stdin is a terminal."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    return data.decode("utf-8").strip()


def not_utf8(err: UnicodeError, what: str) -> str:
    """The one line for a message that is not UTF-8 text (piped, typed or passed as --prompt)."""
    where = f" (byte 0x{err.object[err.start]:02x} at offset {err.start})" if isinstance(err, UnicodeDecodeError) else ""
    return f"{what} is not UTF-8 text{where}: send UTF-8 (e.g. iconv -f latin1 -t utf-8), or set a UTF-8 locale"


def setup_readline() -> Callable[[], None]:
    """Line editing and a persistent input history where readline exists; returns the saver."""
    try:
        import readline
    except ImportError:
        return lambda: None
    from medusa.runtime.files import cache_root

    path = Path(os.environ.get("MEDUSA_CHAT_HISTORY", cache_root() / "chat_history"))
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save


def interactive(chat: Chat, style: Style) -> int:
    save_history = setup_readline()
    # \001 and \002 tell readline the colour codes take no room on the line.
    prompt = "\001\x1b[1;34m\002you>\001\x1b[0m\002 " if style.enabled else "you> "
    say(style.dim("type a message; /help for commands, Ctrl-C stops an answer, Ctrl-D exits"))
    try:
        while True:
            # Ctrl-C at the prompt, or between an answer's end and the next prompt, only
            # clears the line: the engine re-checks its cache against every new prompt.
            try:
                try:
                    line = input(prompt)
                    line.encode("utf-8")  # under the C locale, bytes that are not UTF-8 arrive as surrogates
                except UnicodeError as err:
                    say(style.error(f"error: {not_utf8(err, 'that line')}"))
                    continue
                if line.lstrip().startswith("/"):
                    if not chat.command(line):
                        return EXIT_OK
                elif line.strip():
                    chat.answer(line, sys.stdout)
            except KeyboardInterrupt:
                sys.stdout.write("\n")
            except EOFError:
                sys.stdout.write("\n")
                return EXIT_OK
    finally:
        save_history()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    style = Style(sys.stdout.isatty() and sys.stderr.isatty() and "NO_COLOR" not in os.environ, args.show_accepted)
    try:
        prompt = args.prompt if args.prompt is not None else read_stdin_prompt()
        if prompt is not None:
            prompt.encode("utf-8")  # --prompt bytes that are not UTF-8 arrive as surrogates
    except UnicodeError as err:
        say(style.error(f"error: {not_utf8(err, 'the message')}"))
        return EXIT_USER_ERROR
    if prompt is not None and not prompt.strip():
        say("error: the prompt is empty: pass --prompt TEXT or pipe a message on stdin")
        return EXIT_USER_ERROR
    try:
        # Said before the first import of torch and transformers, which takes seconds.
        say(style.dim(f"loading {args.model or 'SmolLM2-135M-Instruct (embedded)'} ..."))
        from medusa.errors import MedusaError

        if prompt is not None and args.compile == "auto":
            args.compile = "off"  # one answer does not repay loading compiled passes (docs/cli.md#compiled-passes-built-in-the-background)
        try:
            sampling_config(args)
            engine = load_engine(args, style)
            mode = pick_mode(args, engine, style)
        except MedusaError as err:
            say(style.error(f"error: {err}"))
            return EXIT_USER_ERROR
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            say(style.error(f"error: {OOM_HINT}"))
            return EXIT_OOM
        # A model that declares no context window gets 2,048 tokens, the smallest in common use.
        model_window = engine.max_positions or 2048
        window = min(model_window, args.max_context or model_window)
        if args.max_new_tokens >= window:
            say(style.error(f"error: --max-new-tokens {args.max_new_tokens} leaves no room for a message in the "
                            f"{window}-token context window: lower it"))
            return EXIT_USER_ERROR
        if engine.tokenizer is not None:
            set_chat_template(engine.tokenizer, args.chat_template)
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            say(style.error(f"error: {args.model} has no chat template: pass --chat-template FILE (for a base "
                            "model, e.g. configs/chat_templates/question_answer.jinja) or use an instruction-tuned "
                            "model"))
            return EXIT_USER_ERROR
        say(style.dim(banner(args, engine, mode, window, style)))
        if engine.passes.name == "auto":
            prepare_auto(engine, mode, args, style)
        elif engine.passes.compiled:
            precompile(engine, mode, args, style)
        chat = Chat(engine, args, mode, style, window)
        if prompt is not None:
            return chat.answer(prompt, sys.stdout)
        return interactive(chat, style)
    except KeyboardInterrupt:
        say("\ninterrupted")
        return EXIT_INTERRUPTED


def cli() -> None:
    """Console-script entry point (``medusa-chat``)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
