"""``python -m infer.chat``: chat with a model, answers streamed as the engine accepts them.

Multi-turn, with the target's chat template. Each turn re-uses the KV cache of the turns
before it (the engine's ``state=``), so only the new message is prefilled. Answers go to
stdout; the banner, notices, stats lines and errors go to stderr, so
``python -m infer.chat --prompt "..." > answer.txt`` keeps only the answer.

Exit codes: 0 done, 1 a problem the user can fix (bad path, heads for another model, a
message too long, ...), 2 bad command-line usage, 3 out of memory, 130 interrupted.

This module parses the flags and talks to the terminal (readline, stdin, the prompt loop); the
session, its startup and the banner are library code in medusa/chat/ (session.py,
prepare.py, banner.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from medusa.chat.banner import banner
from medusa.chat.prepare import (
    OOM_HINT,
    Style,
    conversation_window,
    is_out_of_memory,
    load_engine,
    pick_mode,
    prepare_passes,
    sampling_config,
    say,
    start_problem,
)
from medusa.chat.session import EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM, EXIT_USER_ERROR, Chat
from medusa.config import HelpFormatter, count
from medusa.decoding import MAX_NEW_TOKENS
from medusa.runtime.kernels import kernels_arg


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
        window = conversation_window(engine, args)
        problem = start_problem(engine, args, window)
        if problem is not None:
            say(style.error(f"error: {problem}"))
            return EXIT_USER_ERROR
        say(style.dim(banner(args, engine, mode, window, style)))
        prepare_passes(engine, mode, args, style)
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
