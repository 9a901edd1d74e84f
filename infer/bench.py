"""Benchmark decoding modes side by side, in one run, on the same machine.

    python -m infer.bench --modes hf,baseline,hybrid --limit 10 --max-new-tokens 256

Every mode decodes the same chat-formatted prompts with the same target. Models load
before any timing, each mode is warmed up once, and prompts are interleaved across modes
(each prompt starting one mode further),
so that machine noise hits every mode alike. Speed is reported as tokens/s and as a ratio
to ``hf`` (transformers' own ``generate``) measured in this run; greedy outputs are checked
token for token against ``hf``.

``hf`` runs the engine's own loaded target (its dtype and, in half precision, its
batch-invariant attention), so that outputs can match token for token. ``hf-float32`` and
``hf-bfloat16`` run ``generate`` on a copy loaded as a user would for transformers alone (that
dtype, transformers' default attention, torch's kernels): the speed a user compares with
where another dtype runs ``generate`` faster (docs/performance.md records where). Their outputs are
compared too, and may differ where the dtype or the attention differs.

Engine modes mean what they mean in the library and the chat: ``medusa``, ``eagle``, ``eagle3``
and ``block`` run heads of that kind, ``hybrid`` the loaded heads plus the lookup chain. A heads
suffix picks the kind for any engine mode: ``hybrid@eagle``, ``hybrid@block`` (a kind's own mode
alone implies it). Heads of a kind that ``--heads`` did not load are loaded through
``medusa.load(target=...)`` on the same target: ``--eagle-heads`` / ``--medusa-heads`` /
``--block-heads``, else those shipped for the embedded model (none are shipped of kind block). So Medusa and EAGLE heads compare in one run. The default ``--modes`` is ``hf``,
``baseline`` and the engine's default mode (``hybrid`` with heads).

Any engine mode with ``+compile`` (``baseline+compile``, ``hybrid@eagle+compile``) runs the
same mode on a twin engine with a compiled verification pass, beside the eager one; every
compiled pass size is compiled in the warm-up, outside the timing (the seconds are printed
and kept in the results' ``meta``). ``hybrid+lookahead`` (``hybrid@eagle3+lookahead``) runs
hybrid with lookahead decoding's window and pool n-grams in the same pass
(``ProposerConfig.hybrid_lookahead``; docs/lookahead.md), beside plain ``hybrid``. A
``:KERNELS`` suffix runs a mode with those linear kernels instead of the plan's pick
(``hybrid:default``, ``'hybrid:gemv>3'``: quote the ``>`` in a shell), its trees sized for them,
beside the others.

With ``--temperature`` above 0 every mode samples (``hf`` through transformers' own
sampling with the same temperature, top-p and top-k); outputs then differ run to run by
design, so the identical-output column reads n/a while tau and speedup still compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medusa.bench.engines import AUTOTUNE, load_bench, prepare
from medusa.bench.modes import COMPILED, HEAD_KINDS, MODES, UNSHIPPED, parse_modes
from medusa.bench.prompts import DEFAULT_PROMPTS, encode, read_prompts
from medusa.bench.report import run_meta, write_results, write_temperatures
from medusa.bench.runners import close_peers
from medusa.bench.split import split_lines, step_split
from medusa.bench.summary import against_fastest_peer, length_table, profile_lines, summarise, table, temperature_table
from medusa.bench.timing import timed_runs
from medusa.config import HelpFormatter, count, writable_folder
from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.proposers.factory import MODES as ENGINE_MODES
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.sampling import ACCEPTANCE, SamplingConfig
from medusa.errors import MedusaError, require_extra
from medusa.runtime.kernels import kernels_arg


def lookahead_size(text: str) -> tuple[int, int, int]:
    """``--lookahead W,N,G``: three positive integers."""
    try:
        w, n, g = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lookahead takes W,N,G (three integers, e.g. 4,3,4), not {text!r}") from None
    if w < 1 or n < 3 or g < 0:
        raise argparse.ArgumentTypeError(f"--lookahead needs W >= 1, N >= 3, G >= 0, got {text!r}")
    return w, n, g


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="Hub id, model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--heads", default=None, help="heads folder, Hub id, or 'init' (default: the heads shipped for the default model)")
    for kind in HEAD_KINDS:
        shipped = "none: pass one for these modes" if kind in UNSHIPPED else f"the {kind} heads shipped for the default model"
        ap.add_argument(f"--{kind}-heads", default=None,
                        help=f"{kind} heads for modes {kind} and MODE@{kind} when --heads did not load {kind} heads "
                             f"(default: {shipped})")
    ap.add_argument("--draft", default=None,
                    help="draft model for draft and hf-assisted: folder, Hub id, or 'default' (the default when they run)")
    pc = ProposerConfig()  # the one place the per-mode defaults live
    ap.add_argument("--draft-tokens", type=count(), default=pc.draft_tokens, help="tokens the draft proposes per step (draft, hf-assisted)")
    ap.add_argument("--adaptive-draft", action="store_true", help="adapt the draft length per step (draft, hf-assisted)")
    ap.add_argument("--draft-confidence", type=float, default=pc.draft_confidence,
                    help=f"end a draft chain after a token the draft gave less probability (default {pc.draft_confidence:g}, transformers' own; 0: off; draft, hf-assisted)")
    ap.add_argument("--lookup-tokens", type=count(), default=pc.lookup_tokens,
                    help="tokens copied per step (lookup, hybrid, prompt-lookup; default: sized per match up to 16 "
                         "where this machine's passes were timed, else 8, or for hybrid the chain sized with its tree)")
    ap.add_argument("--fixed-chains", dest="match_chains", action="store_false",
                    help="lookup, hybrid: chains of the default or sized length, not sized per match (MatchChains)")
    ap.add_argument("--lookup-ngram", type=count(), default=pc.lookup_ngram, help="longest n-gram matched (lookup, hybrid, prompt-lookup)")
    ap.add_argument("--no-answer-ngrams", dest="answer_ngrams", action="store_false",
                    help="hybrid modes: draft no chain from the heads folder's n-gram table of the target's "
                         "answers where the text has no match (ngrams.safetensors; default: use it when there is one)")
    ap.add_argument("--draw", type=count(0), default=pc.draw,
                    help="sampled runs: candidates per depth the heads draw from their own distribution (default: "
                         "as many as the plan sized at the run's temperature, one where uncalibrated; 0: their "
                         "deterministic top-k, verified as point masses)")
    ap.add_argument("--draft-window", type=count(0), default=pc.draft_window,
                    help=f"eagle heads: the accepted pairs their own cache keeps and attends to, a sliding window "
                         f"(default {pc.draft_window}; 0: the whole context)")
    ap.add_argument("--every-step-drafts", action="store_true",
                    help="draft every step in full: no check of whether drafting pays (by default a lone greedy "
                         "sequence decodes plainly, or in mode hybrid lean, while drafts keep less than they cost)")
    ap.add_argument("--lookahead", type=lookahead_size, default=None, metavar="W,N,G",
                    help="lookahead: window columns, n-gram size, n-grams verified per pass (default: sized here)")
    ap.add_argument("--chat-template", default=None,
                    help="Jinja chat template (file or text) the prompts are formatted with, for a model whose tokenizer "
                         "has none or whose heads were trained on another, e.g. configs/chat_templates/"
                         "question_answer.jinja for Gemma 3 270M (default: the tokenizer's own)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="MT-Bench jsonl or ShareGPT json (default: MT-Bench, 80 questions)")
    ap.add_argument("--limit", type=count(), default=None, help="use the first N prompts (default: all)")
    ap.add_argument("--per-category", type=count(), default=None, help="use the first N prompts of each category (default: all)")
    ap.add_argument("--max-new-tokens", type=count(), default=MAX_NEW_TOKENS, help="longest answer in tokens")
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated, from: {', '.join(MODES)}, {', '.join(ENGINE_MODES)} (an engine mode may "
                         f"carry @KIND, {', '.join(HEAD_KINDS)}: the heads kind, and {COMPILED}); default: hf, baseline and the "
                         "engine's default mode (hybrid with heads)")
    ap.add_argument("--tree", default=None, help="Medusa heads' tree (modes medusa, hybrid): a name in medusa/assets/trees "
                    "or a JSON file of paths (default: calibrated per device)")
    machine_flags(ap)
    ap.add_argument("--json", default=None, help="write aggregate and per-prompt results to this JSON file (default: none)")
    ap.add_argument("--split", action="store_true", help="also time plain decoding's step at 1 and 8 sequences, split "
                    "into linear layers, attention and the rest (medusa/bench/split.py)")
    ap.add_argument("--output", default=None, help="folder for results.json, table.md and plots, e.g. bench_out/NAME "
                    "(default: none)")
    ap.add_argument("--out", dest="output", help=argparse.SUPPRESS)  # the old spelling
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def machine_flags(ap: argparse.ArgumentParser) -> None:
    """Sampling, device, dtype, kernels, compile: how every mode runs."""
    d = SamplingConfig()  # the one place sampling defaults live
    ap.add_argument("--temperature", type=temperatures_arg, default=None,
                    help=f"0 is greedy (default: {d.temperature:g}); several, comma-separated (0,0.7,1.0), run every "
                         "mode at each in one run, a table each and one side by side")
    ap.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {d.top_p:g} = off)")
    ap.add_argument("--top-k", type=int, default=None, help=f"sample from the k likeliest tokens (default: {d.top_k} = off)")
    ap.add_argument("--seed", type=int, default=None, help="seed for sampled runs: the same seed, the same outputs "
                    "(default: none)")
    ap.add_argument("--acceptance", choices=ACCEPTANCE, default=None,
                    help=f"verification when sampling: lossless, or the lossy typical (default: {d.acceptance})")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")
    ap.add_argument("--static-cache", action="store_true", help="engine modes keep the KV cache in fixed tensors")
    ap.add_argument("--compile", action="store_true",
                    help="engine modes: static cache and a torch.compile'd verification pass (CUDA graphs on CUDA); "
                         "every pass size is compiled before the timing (the seconds are reported). A mode named "
                         "MODE+compile (e.g. hybrid@eagle+compile) runs compiled beside the eager MODE in one run")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the faster exact one on "
                    "this device, measured once and cached)")
    ap.add_argument("--kernels", type=kernels_arg, default=None,
                    help="engine modes' linear kernels: torch's default, packed oneDNN weights on a CPU, gemv "
                         "(this package's float32 CPU kernels), or gemv above N rows and torch's below (gemv>N) "
                         "(default: the fastest here, measured once); hf modes always run stock transformers")
    ap.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                    help="the heads' dtype (drafts only: the target verifies in --dtype); default: the target's, "
                         "or bfloat16 beside a float32 target where it measures faster here; int8: eagle heads on "
                         "int8 weights, CPU")
    ap.add_argument("--autotune", choices=tuple(AUTOTUNE), default="on", help="the machine plan (medusa.load's "
                    "autotune): on measures what is not cached, cached uses only what is, off the defaults")


def check_outputs(args: argparse.Namespace) -> None:
    """Before the run: the report's plots need matplotlib, and the outputs must be writable."""
    if args.output:
        require_extra("bench")
    for flag, folder in (("--json", args.json and Path(args.json).parent), ("--output", args.output and Path(args.output))):
        if folder:
            writable_folder(folder, flag)  # before the run: a long bench never ends in a traceback


def temperatures_arg(text: str) -> list[float]:
    """``--temperature``: one value or several, comma-separated."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature or a comma-separated list of them") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one temperature")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    temperatures = args.temperature or [None]
    if len(temperatures) > 1 and args.output:
        print("error: --output draws one temperature's report: pass one --temperature, or use --json for several",
              file=sys.stderr)
        return 2
    args.temperature = temperatures[0]
    by_temperature = {}
    try:
        if args.modes:
            parse_modes(args.modes)  # before loading anything: an unknown mode is a one-line error now
        check_outputs(args)
        prompts = read_prompts(args.prompts, args.limit, args.per_category)
        bench = load_bench(args)
        modes = parse_modes(args.modes, bench.main)
        prepare(bench, modes)
        for t in temperatures:  # every mode at each temperature, in this one run
            bench.sampling = bench.sampling.override(temperature=t)
            by_temperature[bench.sampling.temperature] = (bench.sampling, timed_runs(bench, modes, prompts))
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:  # the peers' workers belong to this run (their model and settings are this run's)
        close_peers()
    reference = "hf" if "hf" in modes else None
    if len(by_temperature) > 1:
        return several_temperatures(args, bench, prompts, modes, by_temperature, reference)
    bench.sampling, runs = next(iter(by_temperature.values()))
    summary = summarise(prompts, runs, reference, sampled=not bench.sampling.greedy)
    print(table(summary, reference))
    if by_length := length_table(summary):  # prompts of named lengths (long-context.jsonl): a table by length
        print("\n" + "\n".join(by_length))
        print("\n" + "\n".join(length_table(summary, decode=True)))
    for line in profile_lines(summary):
        print(line)
    fastest = against_fastest_peer(summary)
    if fastest:
        print(fastest)
    if args.split:
        print("\n".join(split_lines(step_split(bench.main, [encode(bench.main, p.text) for p in prompts[:8]]))))
    folder = write_results(args, run_meta(bench, prompts, modes, fastest), summary, reference, bench.main.heads)
    if folder is not None:
        print(f"report written to {folder}", file=sys.stderr)
    return 0


def several_temperatures(args: argparse.Namespace, bench, prompts, modes: list[str], by_temperature: dict,
                         reference: str | None) -> int:
    """The tables of a run at several temperatures: one per temperature, then each mode's tokens/s,
    tau and speedup over the engine's own baseline side by side; --json holds every summary."""
    summaries = {}
    for t, (sampling, runs) in by_temperature.items():
        bench.sampling = sampling
        summaries[t] = summarise(prompts, runs, reference, sampled=not sampling.greedy)
        print(f"\ntemperature {t:g}\n")
        print(table(summaries[t], reference))
    print("\n" + "\n".join(temperature_table(summaries)))
    write_temperatures(args, run_meta(bench, prompts, modes, None), summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
