"""What ``python -m infer.chat`` does before its first message, and the pieces its session
shares: the engine loaded (notes for the user kept, other libraries' warnings dropped), the mode
picked, the compiled passes prepared (compiled now with ``--compile on``; with ``--compile auto``
loaded, or built in the background), the sampling the flags ask for, the out-of-memory
handling, and the notices on stderr (stdout carries only answers), coloured on terminals.

``args`` is the chat's parsed command line (infer/chat.py: ``build_parser``).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from medusa.decoding.passes.build_args import sizes_text

if TYPE_CHECKING:  # the heavy imports wait until the banner has been printed
    from medusa.decoding.engine import Engine
    from medusa.decoding.sampling import SamplingConfig


# -- notices -----------------------------------------------------------------------------
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
    # point into medusa (this module, medusa.load's caller, included). Other libraries' are noise here.
    ours = str(Path(medusa.__file__).resolve().parent)
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


def conversation_window(engine: Engine, args: argparse.Namespace) -> int:
    """The tokens the conversation is kept within: ``--max-context``, at most the model's window
    (a model that declares none gets 2,048 tokens, the smallest in common use)."""
    model_window = engine.max_positions or 2048
    return min(model_window, args.max_context or model_window)


def start_problem(engine: Engine, args: argparse.Namespace, window: int) -> str | None:
    """Why the chat cannot start on ``engine`` (one line), else None; sets ``--chat-template`` on
    its tokenizer."""
    from medusa.models.target import set_chat_template

    if args.max_new_tokens >= window:
        return (f"--max-new-tokens {args.max_new_tokens} leaves no room for a message in the "
                f"{window}-token context window: lower it")
    if engine.tokenizer is not None:
        set_chat_template(engine.tokenizer, args.chat_template)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        return (f"{args.model} has no chat template: pass --chat-template FILE (for a base "
                "model, e.g. configs/chat_templates/question_answer.jinja) or use an instruction-tuned "
                "model")
    return None


def prepare_passes(engine: Engine, mode: str, args: argparse.Namespace, style: Style) -> None:
    """The compiled passes of ``mode``, before the first message: ``--compile auto`` loads or
    builds them in the background (:func:`prepare_auto`), ``--compile on`` compiles them now."""
    if engine.passes.name == "auto":
        prepare_auto(engine, mode, args, style)
    elif engine.passes.compiled:
        precompile(engine, mode, args, style)


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
        say(style.dim(f"compiled passes: {sizes_text(build.loaded)} loaded in {build.seconds:.1f} s"))
    if not build.missing:
        return
    if build.skipped is not None:
        say(style.dim(f"compiled passes: {sizes_text(build.missing)} not saved on this machine yet, so eager; not built "
                      f"in the background: {build.skipped} (python -m infer.precompile builds them with the chat closed)"))
        return
    if build.started:
        started = f"compiling them in the background at low priority (pid {build.pid}, log {build.log})"
    else:
        started = (f"process {build.pid} is compiling passes of this model already (python -m infer.precompile "
                   f"--sizes {','.join(map(str, build.missing))} after it, for any it leaves out)")
    say(style.dim(f"compiled passes: {sizes_text(build.missing)} not saved on this machine yet, so eager for now; "
                  f"{started}; answers run compiled once all are saved (--compile off: never)"))
