"""Benchmark decoding modes side by side, in one run, on the same machine.

    python -m infer.bench --modes hf,baseline,medusa --limit 10 --max-new-tokens 256

Every mode decodes the same chat-formatted prompts with the same target. Models load
before any timing, each mode is warmed up once, and prompts are interleaved across modes
so that machine noise hits every mode alike. Speed is reported as tokens/s and as a ratio
to ``hf`` (transformers' own ``generate``) measured in this run; greedy outputs are checked
token for token against ``hf``.

``hf`` runs the engine's own loaded target (its dtype and, in half precision, its
batch-invariant attention), so that outputs can match token for token. ``hf-float32`` and
``hf-bfloat16`` run ``generate`` on a copy loaded as a user would for transformers alone (that
dtype, transformers' default attention, torch's kernels): the speed a user compares with
where another dtype runs ``generate`` faster (on one AMX Xeon float32 did). Their outputs are
compared too, and may differ where the dtype or the attention differs.

Modes ``eagle`` and ``eagle-hybrid`` (the eagle tree plus the lookup chain) run the EAGLE
heads of ``--eagle-heads`` (default: those shipped for the embedded model) on the same loaded
target, so that Medusa heads (``medusa``, ``hybrid``) and EAGLE heads compare in one run.

Any engine mode with ``+compile`` (``baseline+compile``, ``eagle-hybrid+compile``) runs the
same mode on a twin engine with a compiled verification pass, beside the eager one; every
compiled pass size is compiled in the warm-up, outside the timing (the seconds are printed
and kept in the results' ``meta``).

With ``--temperature`` above 0 every mode samples (``hf`` through transformers' own
sampling with the same temperature, top-p and top-k); outputs then differ run to run by
design, so the identical-output column reads n/a while tau and speedup still compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import CompileConfig, GenerationConfig, StaticCache

import medusa
from infer import bench_vllm
from medusa.autotune.device import adopt_draft_dtype
from medusa.autotune.sizing import size_here
from medusa.config import count, writable_folder
from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.engine import Engine
from medusa.decoding.proposers import MODES as ENGINE_MODES
from medusa.decoding.proposers import ProposerConfig
from medusa.decoding.sampling import ACCEPTANCE, SamplingConfig
from medusa.errors import MedusaError, require_extra
from medusa.runtime import hf as kv
from medusa.runtime.files import cache_root
from medusa.runtime.kernels import KERNELS

DEFAULT_PROMPTS = Path(medusa.__file__).resolve().parent / "assets" / "mt_bench.jsonl"  # package data


@dataclass
class Prompt:
    id: str
    category: str
    text: str
    ids: list[int] = field(default_factory=list)


@dataclass
class Run:
    """One mode on one prompt."""

    tokens: list[int]
    seconds: float
    steps: int | None = None  # target passes after prefill (None when the mode does not say)
    accepted: list[int] | None = None  # tokens emitted per decode step, when the mode says
    phases: dict[str, float] | None = None  # engine modes: seconds in prefill, draft, verify, update


# -- prompts -------------------------------------------------------------------------------
def read_prompts(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """MT-Bench / Spec-Bench jsonl (``turns``: the first turn is used) or ShareGPT json
    (``conversations``: the first human turn). ``per_category`` keeps the first N of each
    category (MT-Bench is ordered by category, so a plain ``limit`` would see only one or two)."""
    path = Path(path)
    if not path.is_file():
        raise MedusaError(f"prompts file not found: {path}")
    records: list[dict] = []
    text = path.read_text()
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise MedusaError(f"{path}:{n} is not valid JSON") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise MedusaError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
        records = data if isinstance(data, list) else [data]
    prompts = []
    for i, rec in enumerate(records):
        if "turns" in rec and rec["turns"]:
            prompts.append(Prompt(str(rec.get("question_id", i)), str(rec.get("category", "all")), str(rec["turns"][0])))
        elif "conversations" in rec:
            first = next((t.get("value") for t in rec["conversations"] if t.get("from") == "human" and t.get("value")), None)
            if first:
                prompts.append(Prompt(str(rec.get("id", i)), "sharegpt", first))
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for pr in prompts:
            seen[pr.category] = seen.get(pr.category, 0) + 1
            if seen[pr.category] <= per_category:
                kept.append(pr)
        prompts = kept
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise MedusaError(f"no prompts found in {path}: expected MT-Bench jsonl (turns) or ShareGPT json (conversations)")
    return prompts


def encode(engine: Engine, prompt: str) -> list[int]:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok(prompt)["input_ids"]


# -- modes ---------------------------------------------------------------------------------
Runner = Callable[[Engine, list[int], argparse.Namespace], Run]
MODES: dict[str, Runner] = {}


def mode(name: str) -> Callable[[Runner], Runner]:
    def register(fn: Runner) -> Runner:
        MODES[name] = fn
        return fn

    return register


def _engine_run(engine: Engine, ids: list[int], args: argparse.Namespace, *, name: str) -> Run:
    res = engine.generate(ids, max_new_tokens=args.max_new_tokens, mode=name, tree=_static_tree(engine, args),
                          sampling=args.sampling)
    st = res.stats
    phases = {"prefill": st.prefill_seconds, "draft": st.draft_seconds, "verify": st.verify_seconds,
              "update": st.update_seconds}
    return Run(tokens=res.tokens, seconds=st.seconds, steps=st.steps + 1, accepted=list(st.accepted), phases=phases)


def _hf_config(engine: Engine, args: argparse.Namespace, **extra) -> GenerationConfig:
    eos = sorted(engine.eos) or None
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                            **{**args.sampling.hf_generate_kwargs(), **extra})


def hf_generate(engine: Engine, ids: list[int], config: GenerationConfig, model=None, **kwargs) -> Run:
    """``generate`` on the engine's target (or on ``model``, another copy of it), timed."""
    x = torch.tensor([ids], device=engine.device)
    _sync(engine)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = (engine.model if model is None else model).generate(x, attention_mask=torch.ones_like(x), generation_config=config, **kwargs)
    _sync(engine)
    seconds = time.perf_counter() - t0
    return Run(tokens=out[0, len(ids):].tolist(), seconds=seconds)


def _static_tree(engine: Engine, args: argparse.Namespace) -> str | None:
    """--tree for an engine with Medusa heads; eagle heads grow their own tree per step."""
    return args.tree if engine.heads is not None and engine.heads.config.kind == "medusa" else None


def _tree_nodes(engine: Engine, tree: str | None) -> int | None:
    """Nodes (root included) of the heads' tree: the static tree of Medusa heads, the dynamic
    tree's budget of eagle heads."""
    if engine.heads is None:
        return None
    if engine.heads.config.kind == "eagle":
        from medusa.decoding.eagle_draft import DynamicTree

        if engine.tree_sizes is not None:
            return engine.tree_sizes.eagle.nodes + 1
        return DynamicTree.for_device(engine.heads.dynamic, engine.device, engine.model.dtype).nodes + 1
    return len(engine.tree_paths(tree)) + 1


def _sizes_reason(engine: Engine) -> str | None:
    """How the eagle heads' trees were sized (None: no eagle heads)."""
    if engine.heads is None or engine.heads.config.kind != "eagle":
        return None
    return engine.tree_sizes.reason if engine.tree_sizes is not None else "calibrated for the device type"


def lookahead_size(text: str) -> tuple[int, int, int]:
    """``--lookahead W,N,G``: three positive integers."""
    try:
        w, n, g = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lookahead takes W,N,G (three integers, e.g. 4,3,4), not {text!r}") from None
    if w < 1 or n < 3 or g < 0:
        raise argparse.ArgumentTypeError(f"--lookahead needs W >= 1, N >= 3, G >= 0, got {text!r}")
    return w, n, g


def _lookahead_reason(engine: Engine) -> str:
    """Mode lookahead's W, N, G on ``engine`` and why."""
    size = engine.proposer("lookahead").size
    return f"W={size.window} N={size.ngram} G={size.guesses} ({size.rows} rows): {size.reason}"


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@mode("hf")
def run_hf(engine: Engine, ids: list[int], args: argparse.Namespace, model=None) -> Run:
    """transformers ``generate`` on the engine's target, or on ``model`` (another copy of it)."""
    if not args.sampling.greedy and args.sampling.seed is not None:
        torch.manual_seed(args.sampling.seed)  # transformers samples from the global generator
    run = hf_generate(engine, ids, _hf_config(engine, args), model=model)
    run.steps = len(run.tokens)
    return run


PLAIN_DTYPES = ("float32", "bfloat16")  # hf-float32, hf-bfloat16: transformers as a user loads the target


def run_hf_as_loaded(engine: Engine, ids: list[int], args: argparse.Namespace, *, dtype: str) -> Run:
    """transformers ``generate`` on the target as a user loads it for transformers alone: its
    own copy in ``dtype`` with transformers' default attention and torch's kernels. ``hf``
    runs the engine's own target, in the engine's dtype, with its attention (batch-invariant
    in half precision); on a device where another dtype or attention runs ``generate``
    faster, that is the speed a user would compare with."""
    return run_hf(engine, ids, args, model=args.plain_targets[dtype])


for _dtype in PLAIN_DTYPES:
    mode(f"hf-{_dtype}")(functools.partial(run_hf_as_loaded, dtype=_dtype))


def plain_targets(modes: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, torch.nn.Module]:
    """The copies of the target that the hf-DTYPE modes run, loaded before any timing."""
    from medusa.models.target import load_target

    wanted = [d for d in PLAIN_DTYPES if f"hf-{d}" in modes]
    if "bfloat16" in wanted and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MedusaError("mode hf-bfloat16 needs bfloat16, which this GPU lacks: drop it")
    return {d: load_target(args.model, device=device, dtype=d)[0] for d in wanted}


HF_STATIC_MIN = 2048  # hf-compile's cache slots: one size for every prompt, so generate compiles once


@mode("hf-compile")
def run_hf_compile(engine: Engine, ids: list[int], args: argparse.Namespace) -> Run:
    """transformers ``generate`` as a user would compile it: its own fixed-size ``StaticCache``
    and its ``torch.compile``'d decoding forward (``CompileConfig``; allowed on every device).
    The cache has ``HF_STATIC_MIN`` slots (a power of two above that for longer runs), so one
    graph serves every prompt; it is compiled in the bench's warm-up, outside the timing."""
    need = len(ids) + args.max_new_tokens
    size = max(HF_STATIC_MIN, 1 << (need - 1).bit_length())
    if engine.max_positions is not None:
        size = min(size, engine.max_positions)
    cache = StaticCache(config=engine.model.config, max_cache_len=size)
    compiled = CompileConfig(fullgraph=False, mode="default" if engine.device.type != "cuda" else "reduce-overhead")
    compiled._compile_all_devices = True  # transformers compiles on CUDA only unless this is set
    run = hf_generate(engine, ids, _hf_config(engine, args, compile_config=compiled),
                      **kv.cache_kwarg(engine.model.forward, cache))  # generate takes the model's name
    run.steps = len(run.tokens)
    return run


# The engine's own modes: the same runner, by name (baseline, medusa, draft, lookup, hybrid;
# eagle is registered below, on the engine holding eagle heads).
for _name in ENGINE_MODES:
    MODES[_name] = functools.partial(_engine_run, name=_name)


def _eagle_engine(engine: Engine, args: argparse.Namespace) -> Engine:
    """The engine whose heads are eagle heads: the main one when ``--heads`` loaded eagle heads."""
    return engine if args.eagle_engine is None else args.eagle_engine


@mode("eagle")
def run_eagle(engine: Engine, ids: list[int], args: argparse.Namespace) -> Run:
    return _engine_run(_eagle_engine(engine, args), ids, args, name="eagle")


@mode("eagle-hybrid")
def run_eagle_hybrid(engine: Engine, ids: list[int], args: argparse.Namespace) -> Run:
    return _engine_run(_eagle_engine(engine, args), ids, args, name="hybrid")


def _answer_ngrams(engine: Engine, wanted: bool) -> str | None:
    """What the hybrid modes' chains draw on besides the text: the heads' n-gram table, if used."""
    table = getattr(engine.heads, "ngrams", None)
    if table is None or not wanted:
        return None
    return f"{len(table)} contexts from {table.sequences} answers"


EAGLE_MODES = ("eagle", "eagle-hybrid")  # bench modes on the engine holding eagle heads
COMPILED = "+compile"  # mode suffix: the engine mode with a compiled pass, beside the eager one in the same run


def _engine_and_name(engine: Engine, name: str, args: argparse.Namespace) -> tuple[Engine, str] | None:
    """The engine a bench mode runs on and the engine's own mode name (None: not an engine mode)."""
    compiled = name.endswith(COMPILED)
    base = name.removesuffix(COMPILED)
    if base in EAGLE_MODES:
        eng = (args.compiled_eagle_engine or args.compiled_engine) if compiled else _eagle_engine(engine, args)
        return eng, "eagle" if base == "eagle" else "hybrid"
    if base in ENGINE_MODES:
        return (args.compiled_engine if compiled else engine), base
    return None


def _compiled_run(engine: Engine, ids: list[int], args: argparse.Namespace, *, base: str) -> Run:
    """``base`` on the compiled twin of the engine (same loaded target and heads)."""
    twin = argparse.Namespace(**{**vars(args), "eagle_engine": args.compiled_eagle_engine})
    return MODES[base](args.compiled_engine, ids, twin)


def _register_compiled(modes: list[str]) -> None:
    for name in modes:
        base = name.removesuffix(COMPILED)
        if name.endswith(COMPILED) and (base in ENGINE_MODES or base in EAGLE_MODES):
            MODES[name] = functools.partial(_compiled_run, base=base)


def _compiled_twin(engine: Engine, heads, proposers: ProposerConfig) -> Engine:
    """``engine`` with compiled passes: the same target, heads, kernels and rows per pass; its
    eagle trees sized as ``medusa.load(compile=True)`` sizes them (on the CPU: here, for passes
    padded to their buckets; on a GPU: calibrated), unless the engine's are the calibrated ones."""
    twin = Engine(engine.model, engine.tokenizer, heads=heads, tree=engine.tree, draft=engine.draft, compile=True,
                  proposer_config=proposers, kernels=engine.kernels, max_rows=engine.max_rows)
    if engine.tree_sizes is not None:
        twin.tree_sizes = size_here(twin, cache_root() / "sizing.json")
    return twin


def precompile(engine: Engine, modes: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Compile, before any timing, every pass size each compiled mode can use; seconds per mode."""
    seconds = {}
    for name in modes:
        target = _engine_and_name(engine, name, args)
        if target is None or not target[0].passes.compiled:
            continue
        t0 = time.perf_counter()
        buckets = target[0].precompile(target[1], _static_tree(target[0], args))
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: compiled pass sizes {', '.join(map(str, buckets))} in {seconds[name]:.1f} s", file=sys.stderr)
    return seconds


@mode("hf-assisted")
def run_hf_assisted(engine: Engine, ids: list[int], args: argparse.Namespace) -> Run:
    """transformers' assisted generation with the same draft and draft length as ``draft``."""
    if engine.draft is None:
        raise MedusaError("mode hf-assisted needs a draft: pass --draft FOLDER_OR_HUB_ID (or --draft default)")
    cfg = engine.proposer_config
    schedule = "heuristic" if cfg.adaptive_draft else "constant"
    settings = dict(num_assistant_tokens=cfg.draft_tokens, num_assistant_tokens_schedule=schedule,
                    assistant_confidence_threshold=cfg.draft_confidence)
    # transformers reads these from the assistant's own generation config too (where the
    # confidence stop otherwise defaults to 0.4): set both, so both modes draft alike.
    for name, value in settings.items():
        setattr(engine.draft.generation_config, name, value)
    return hf_generate(engine, ids, _hf_config(engine, args, **settings), assistant_model=engine.draft)


@mode("prompt-lookup")
def run_prompt_lookup(engine: Engine, ids: list[int], args: argparse.Namespace) -> Run:
    """transformers' prompt lookup decoding with the same settings as ``lookup``."""
    config = _hf_config(engine, args, prompt_lookup_num_tokens=engine.proposer_config.chain(),
                        max_matching_ngram_size=engine.proposer_config.lookup_ngram)
    return hf_generate(engine, ids, config)


# vLLM as a peer: vllm, vllm-ngram, vllm-heads and vllm-eagle, each a long-lived worker in vLLM's own venv.
bench_vllm.register(mode, Run)


# -- report --------------------------------------------------------------------------------
def summarise(prompts: list[Prompt], runs: dict[str, list[Run]], reference: str | None, sampled: bool = False) -> dict:
    out: dict[str, dict] = {}
    ref_tps = None
    if reference in runs:
        ref_tps = sum(len(r.tokens) for r in runs[reference]) / max(sum(r.seconds for r in runs[reference]), 1e-9)
    for name, rs in runs.items():
        tokens = sum(len(r.tokens) for r in rs)
        seconds = sum(r.seconds for r in rs)
        steps = [r.steps for r in rs if r.steps is not None]
        tps = tokens / seconds if seconds else 0.0
        same = same_base = None
        if reference in runs and name != reference and not sampled:
            same = sum(r.tokens == ref.tokens for r, ref in zip(rs, runs[reference]))
        if "baseline" in runs and name not in (reference, "baseline") and not sampled:
            # the engine's own promise: speculation never changes what plain decoding emits
            same_base = sum(r.tokens == b.tokens for r, b in zip(rs, runs["baseline"]))
        categories: dict[str, dict] = {}
        for p, r in zip(prompts, rs):
            c = categories.setdefault(p.category, {"tokens": 0, "seconds": 0.0})
            c["tokens"] += len(r.tokens)
            c["seconds"] += r.seconds
        out[name] = {
            "tokens": tokens, "seconds": seconds, "tokens_per_second": tps,
            "speedup": tps / ref_tps if ref_tps else None,
            "tau": tokens / sum(steps) if len(steps) == len(rs) and sum(steps) else None,
            "identical": same, "identical_baseline": same_base, "sampled": sampled, "prompts": len(rs),
            "step_ms": step_profile(rs),
            "categories": {k: {**v, "tokens_per_second": v["tokens"] / v["seconds"] if v["seconds"] else 0.0}
                           for k, v in categories.items()},
            "per_prompt": [{"id": p.id, "category": p.category, "tokens": r.tokens, "seconds": r.seconds, "steps": r.steps,
                            "accepted": r.accepted} for p, r in zip(prompts, rs)],
        }
    return out


def step_profile(rs: list[Run]) -> dict[str, float] | None:
    """Milliseconds per decode step in each phase, over a mode's prompts (engine modes): the
    proposer's drafting, the verification pass (acceptance and cache bookkeeping included), the
    proposer's update, and the rest of the loop; None for modes that do not report phases."""
    if not rs or any(r.phases is None for r in rs):
        return None
    steps = sum(r.steps - 1 for r in rs)  # Run.steps counts the prefill's pass
    if steps <= 0:
        return None
    ms = {k: sum(r.phases[k] for r in rs) * 1e3 / steps for k in ("draft", "verify", "update")}
    ms["other"] = max(0.0, (sum(r.seconds - sum(r.phases.values()) for r in rs)) * 1e3 / steps)
    return ms


def profile_lines(summary: dict) -> list[str]:
    """One line per engine mode: where a decode step's time went (see :func:`step_profile`)."""
    lines = []
    for name, s in summary.items():
        ms = s.get("step_ms")
        if ms:
            total = sum(ms.values())
            parts = " + ".join(f"{k} {v:.1f}" + (f" ({v / total:.0%})" if k == "verify" else "") for k, v in ms.items())
            lines.append(f"step profile, {name}: {total:.1f} ms per step = {parts}")
    return lines


TRANSFORMERS_PEERS = ("hf", "hf-compile", *(f"hf-{d}" for d in PLAIN_DTYPES))  # plain generate, as a user runs it


def against_fastest_peer(summary: dict) -> str | None:
    """A line naming the fastest plain transformers ``generate`` of the run (where several
    ran: ``hf`` and ``hf-float32``, say) and every other mode's speed as a multiple of it."""
    peers = {name: s["tokens_per_second"] for name, s in summary.items() if name in TRANSFORMERS_PEERS}
    if len(peers) < 2:
        return None
    best = max(peers, key=peers.get)
    others = ", ".join(f"{name} {s['tokens_per_second'] / peers[best]:.2f}x" for name, s in summary.items()
                       if name not in peers and peers[best] > 0)
    return f"fastest transformers generate here: {best} ({peers[best]:.1f} tokens/s)" + (f"; {others}" if others else "")


def table(summary: dict, reference: str | None) -> str:
    head = f"| mode | tokens/s | speedup vs {reference or '-'} | tau | identical to {reference or '-'} |"
    lines = [head, "|---|---|---|---|---|"]
    for name, s in summary.items():
        speed = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        if name == reference:
            same = "(reference)"
        elif s["identical"] is None:
            same = "n/a (sampled)" if s.get("sampled") else "-"
        else:
            same = f"{'yes' if s['identical'] == s['prompts'] else 'NO'} ({s['identical']}/{s['prompts']})"
        base = s.get("identical_baseline")
        if base is not None:
            same += f"; baseline: {'yes' if base == s['prompts'] else 'NO'} ({base}/{s['prompts']})"
        lines.append(f"| {name} | {s['tokens_per_second']:.1f} | {speed} | {tau} | {same} |")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hub id, model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--heads", default=None, help="heads folder, Hub id, or 'init' (default: the heads shipped for the default model)")
    ap.add_argument("--eagle-heads", default=None,
                    help="eagle heads for modes eagle and eagle-hybrid when --heads are not eagle heads "
                         "(default: the eagle heads shipped for the default model)")
    ap.add_argument("--draft", default=None,
                    help="draft model for draft and hf-assisted: folder, Hub id, or 'default' (the default when they run)")
    pc = ProposerConfig()  # the one place the per-mode defaults live
    ap.add_argument("--draft-tokens", type=count(), default=pc.draft_tokens, help="tokens the draft proposes per step (draft, hf-assisted)")
    ap.add_argument("--adaptive-draft", action="store_true", help="adapt the draft length per step (draft, hf-assisted)")
    ap.add_argument("--draft-confidence", type=float, default=pc.draft_confidence,
                    help=f"end a draft chain after a token the draft gave less probability (default {pc.draft_confidence:g}, transformers' own; 0: off; draft, hf-assisted)")
    ap.add_argument("--lookup-tokens", type=count(), default=pc.lookup_tokens,
                    help="tokens copied per step (lookup, hybrid, prompt-lookup; default 8, and for eagle-hybrid "
                         "the chain sized with the tree for this machine)")
    ap.add_argument("--lookup-ngram", type=count(), default=pc.lookup_ngram, help="longest n-gram matched (lookup, hybrid, prompt-lookup)")
    ap.add_argument("--no-answer-ngrams", dest="answer_ngrams", action="store_false",
                    help="hybrid, eagle-hybrid: draft no chain from the heads folder's n-gram table of the target's "
                         "answers where the text has no match (ngrams.safetensors; default: use it when there is one)")
    ap.add_argument("--lookahead", type=lookahead_size, default=None, metavar="W,N,G",
                    help="lookahead: window columns, n-gram size, n-grams verified per pass (default: sized here)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="MT-Bench jsonl or ShareGPT json (default: MT-Bench, 80 questions)")
    ap.add_argument("--limit", type=count(), default=None, help="use the first N prompts")
    ap.add_argument("--per-category", type=count(), default=None, help="use the first N prompts of each category")
    ap.add_argument("--max-new-tokens", type=count(), default=MAX_NEW_TOKENS)
    ap.add_argument("--modes", default="hf,baseline,medusa", help=f"comma-separated, from: {', '.join(MODES)}")
    ap.add_argument("--tree", default=None, help="Medusa heads' tree (modes medusa, hybrid): a name in medusa/assets/trees "
                    "or a JSON file of paths (default: calibrated per device)")
    d = SamplingConfig()  # the one place sampling defaults live
    ap.add_argument("--temperature", type=float, default=None, help=f"0 is greedy (default: {d.temperature:g})")
    ap.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {d.top_p:g} = off)")
    ap.add_argument("--top-k", type=int, default=None, help=f"sample from the k likeliest tokens (default: {d.top_k} = off)")
    ap.add_argument("--seed", type=int, default=None, help="seed for sampled runs: the same seed, the same outputs")
    ap.add_argument("--acceptance", choices=ACCEPTANCE, default=None,
                    help=f"verification when sampling: lossless, or the lossy typical (default: {d.acceptance})")
    ap.add_argument("--device", default=None)
    ap.add_argument("--static-cache", action="store_true", help="engine modes keep the KV cache in fixed tensors")
    ap.add_argument("--compile", action="store_true",
                    help="engine modes: static cache and a torch.compile'd verification pass (CUDA graphs on CUDA); "
                         "every pass size is compiled before the timing (the seconds are reported). A mode named "
                         "MODE+compile (e.g. eagle-hybrid+compile) runs compiled beside the eager MODE in one run")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kernels", choices=KERNELS, default=None,
                    help="engine modes' linear kernels: torch's default or packed oneDNN weights on a CPU "
                         "(default: the faster here, measured once); hf modes always run stock transformers")
    ap.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                    help="the heads' dtype (drafts only: the target verifies in --dtype); default: the target's, "
                         "or bfloat16 beside a float32 target where it measures faster here; int8: eagle heads on "
                         "int8 weights, CPU")
    ap.add_argument("--tree-sizes", choices=("here", "calibrated"), default="here",
                    help="eagle heads' trees and eagle-hybrid's lookup chain: sized from this machine's pass costs "
                         "(measured once, cached) or as calibrated for the device type (calibration.json)")
    ap.add_argument("--json", default=None, help="write aggregate and per-prompt results here")
    ap.add_argument("--out", default=None, help="folder for results.json, table.md and plots (e.g. bench_out/NAME)")
    return ap.parse_args(argv)


def eagle_heads(args: argparse.Namespace, engine: Engine):
    """The eagle heads of ``--eagle-heads``, or those shipped for the embedded default model."""
    from medusa.api import SHIPPED_EAGLE_HEADS
    from medusa.hub.hub import load_heads_from

    source = args.eagle_heads
    if source is None:
        if args.model is not None or not (SHIPPED_EAGLE_HEADS / "config.json").is_file():
            raise MedusaError("modes eagle and eagle-hybrid need eagle heads: pass --eagle-heads FOLDER (or --heads FOLDER)")
        source = SHIPPED_EAGLE_HEADS
    heads = load_heads_from(source, engine.model)
    if heads.config.kind != "eagle":
        raise MedusaError(f"--eagle-heads {source} holds {heads.config.kind} heads: pass a folder of eagle heads")
    adopt_draft_dtype(heads, engine.model, cache_root() / "draft_dtype.json", args.draft_dtype)  # as medusa.load's heads
    return heads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.sampling = SamplingConfig().override(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                  seed=args.seed, acceptance=args.acceptance)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        _register_compiled(modes)
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise MedusaError(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)} "
                              f"(an engine mode with {COMPILED} runs it compiled)")
        if args.out:
            require_extra("bench")  # the report's plots need matplotlib: say so before the run, not after
        for flag, folder in (("--json", args.json and Path(args.json).parent), ("--out", args.out and Path(args.out))):
            if folder:
                writable_folder(folder, flag)  # before the run: a long bench never ends in a traceback
        prompts = read_prompts(args.prompts, args.limit, args.per_category)
        bases = {m.removesuffix(COMPILED) for m in modes}
        uses_heads = sorted({"medusa", "hybrid"} & bases)
        uses_eagle = bool({"eagle", "eagle-hybrid"} & bases)
        if args.tree is not None and not uses_heads:
            raise MedusaError(f"--tree shapes the static tree of Medusa heads (modes medusa, hybrid), which none of "
                              f"{', '.join(modes)} uses (eagle heads grow their tree per step): drop --tree")
        heads = args.heads
        if heads is None and uses_heads and args.model is None:
            from medusa.api import SHIPPED_HEADS

            heads = str(SHIPPED_HEADS)  # modes medusa and hybrid: the shipped Medusa heads
        draft = args.draft or ("default" if {"draft", "hf-assisted"} & bases else None)
        proposers = ProposerConfig(draft_tokens=args.draft_tokens, adaptive_draft=args.adaptive_draft,
                                   draft_confidence=args.draft_confidence, lookup_tokens=args.lookup_tokens,
                                   lookup_ngram=args.lookup_ngram, answer_ngrams=args.answer_ngrams,
                                   **dict(zip(("lookahead_window", "lookahead_ngram", "lookahead_guesses"),
                                              args.lookahead or ())))
        engine = medusa.load(model=args.model, heads=heads, draft=draft, device=args.device, dtype=args.dtype, tree=args.tree,
                             static_cache=args.static_cache, compile=args.compile, proposers=proposers,
                             kernels=args.kernels, draft_dtype=args.draft_dtype, size_trees=args.tree_sizes == "here")
        if uses_heads and engine.heads is None:
            raise MedusaError(f"mode {uses_heads[0]} needs heads: pass --heads FOLDER (or --heads init for untrained ones)")
        args.eagle_engine = None
        own_eagle = engine.heads is not None and engine.heads.config.kind == "eagle"
        if uses_eagle and (args.eagle_heads is not None or not own_eagle):  # --eagle-heads wins over --heads
            args.eagle_engine = Engine(engine.model, engine.tokenizer, heads=eagle_heads(args, engine),
                                       static_cache=args.static_cache, compile=args.compile, proposer_config=proposers,
                                       kernels=engine.kernels, max_rows=engine.max_rows)
            if args.tree_sizes == "here":
                args.eagle_engine.tree_sizes = size_here(args.eagle_engine, cache_root() / "sizing.json")
        args.compiled_engine = args.compiled_eagle_engine = None
        if any(m.endswith(COMPILED) for m in modes):
            args.compiled_engine = _compiled_twin(engine, engine.heads, proposers)
            if args.eagle_engine is not None:
                args.compiled_eagle_engine = _compiled_twin(args.eagle_engine, args.eagle_engine.heads, proposers)
        args.plain_targets = plain_targets(modes, args, engine.device)
        for p in prompts:
            p.ids = encode(engine, p.text)
        reference = "hf" if "hf" in modes else None
        print(f"{len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens, modes: {', '.join(modes)}",
              file=sys.stderr)
        if uses_eagle or own_eagle:
            print(f"eagle trees: {_sizes_reason(args.eagle_engine or engine)}", file=sys.stderr)
            if args.compiled_engine is not None:
                print(f"compiled eagle trees: {_sizes_reason(args.compiled_eagle_engine or args.compiled_engine)}",
                      file=sys.stderr)
        if "lookahead" in bases:
            print(f"lookahead: {_lookahead_reason(engine)}", file=sys.stderr)
        args.compile_seconds = precompile(engine, modes, args)  # compiled passes: every size, before any timing
        for m in modes:  # warm-up: allocator, kernels and caches, outside the timing
            MODES[m](engine, prompts[0].ids, argparse.Namespace(**{**vars(args), "max_new_tokens": 8}))
        runs: dict[str, list[Run]] = {m: [] for m in modes}
        for p in tqdm(prompts, desc="prompts", file=sys.stderr):
            for m in modes:
                runs[m].append(MODES[m](engine, p.ids, args))
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = summarise(prompts, runs, reference, sampled=not args.sampling.greedy)
    print(table(summary, reference))
    for line in profile_lines(summary):
        print(line)
    fastest = against_fastest_peer(summary)
    if fastest:
        print(fastest)
    meta = {"model": args.model or "embedded default", "heads": args.heads or "default", "max_new_tokens": args.max_new_tokens,
            "draft": draft, "draft_tokens": args.draft_tokens, "adaptive_draft": args.adaptive_draft,
            "draft_confidence": args.draft_confidence,
            "lookup_tokens": args.lookup_tokens, "lookup_ngram": args.lookup_ngram,
            "answer_ngrams": _answer_ngrams(args.eagle_engine or engine, args.answer_ngrams),
            "prompts": args.prompts, "num_prompts": len(prompts), "device": str(engine.device),
            "dtype": str(engine.model.dtype), "torch_threads": torch.get_num_threads(),
            "dtype_reason": getattr(getattr(engine.model, "dtype_choice", None), "reason", "asked for (--dtype)"),
            "kernels": engine.kernels, "kernel_reason": engine.kernel_choice.reason if engine.kernel_choice else None,
            "draft_dtype_reason": engine.draft_dtype_choice.reason if engine.draft_dtype_choice else None,
            "sampling": dataclasses.asdict(args.sampling),
            "tree_nodes": _tree_nodes(engine, args.tree), "compile_seconds": args.compile_seconds,
            "eagle_tree_nodes": _tree_nodes(args.eagle_engine, None) if args.eagle_engine else None,
            "tree_sizes": _sizes_reason(args.eagle_engine or engine),
            "compiled_tree_sizes": (_sizes_reason(args.compiled_eagle_engine or args.compiled_engine)
                                    if args.compiled_engine is not None else None),
            "lookahead": _lookahead_reason(engine) if "lookahead" in bases else None,
            "fastest_transformers": fastest}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "modes": summary}, indent=1))
    if args.out:
        from infer.report import write_report

        folder = write_report(Path(args.out), meta, summary, reference,
                              "\n\n".join([table(summary, reference), *profile_lines(summary)]), engine.heads)
        print(f"report written to {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
