"""Benchmark decoding modes side by side, in one run, on the same machine.

    python -m infer.bench --modes hf,baseline,hybrid --limit 10 --max-new-tokens 256

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
import dataclasses
import functools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import CompileConfig, GenerationConfig, StaticCache

import medusa
from infer import bench_llamacpp, bench_vllm
from medusa.api import SHIPPED
from medusa.config import HelpFormatter, count, writable_folder
from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.factory import MODES as ENGINE_MODES
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.sampling import ACCEPTANCE, SamplingConfig
from medusa.errors import MedusaError, require_extra
from medusa.models import kinds
from medusa.models.target import set_chat_template
from medusa.runtime import hf as kv
from medusa.runtime.kernels import kernels_arg, split_kernels

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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise MedusaError(f"{path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}): "
                          "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
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


# -- run state -----------------------------------------------------------------------------
@dataclass
class Bench:
    """What one bench run decodes with: its settings, and the engines its modes run on, keyed by
    ``(heads kind, compiled, hybrid with lookahead)`` (``None``: the engine ``--heads`` loaded), built on first use
    through ``medusa.load`` on the same target. ``args``: the command line, read only."""

    args: argparse.Namespace
    sampling: SamplingConfig
    max_new_tokens: int
    tree: str | None
    engines: dict[tuple[str | None, bool, bool, str | None], Engine] = field(default_factory=dict)
    plain_targets: dict[str, torch.nn.Module] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def main(self) -> Engine:
        return self.engines[None, False, False, None]

    def shorter(self, max_new_tokens: int) -> Bench:
        return dataclasses.replace(self, max_new_tokens=max_new_tokens)


# -- modes ---------------------------------------------------------------------------------
Runner = Callable[[Engine, list[int], Bench], Run]
MODES: dict[str, Runner] = {}  # registered at import; ENGINE_MODES with suffixes are parsed (mode_spec)


def mode(name: str) -> Callable[[Runner], Runner]:
    def register(fn: Runner) -> Runner:
        MODES[name] = fn
        return fn

    return register


def _engine_run(engine: Engine, ids: list[int], bench: Bench, *, name: str) -> Run:
    res = engine.generate(ids, max_new_tokens=bench.max_new_tokens, mode=name, tree=_static_tree(engine, bench.tree),
                          sampling=bench.sampling)
    st = res.stats
    phases = {"prefill": st.prefill_seconds, "draft": st.draft_seconds, "verify": st.verify_seconds,
              "update": st.update_seconds}
    return Run(tokens=res.tokens, seconds=st.seconds, steps=st.steps + 1, accepted=list(st.accepted), phases=phases)


def _hf_config(engine: Engine, bench: Bench, **extra) -> GenerationConfig:
    eos = sorted(engine.eos) or None
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return GenerationConfig(max_new_tokens=bench.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                            **{**bench.sampling.hf_generate_kwargs(), **extra})


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


def _static_tree(engine: Engine, tree: str | None) -> str | None:
    """--tree for an engine with Medusa heads; eagle heads grow their own tree per step."""
    return tree if _drafts(engine) is False else None


def _drafts(engine: Engine) -> bool | None:
    """Whether the engine's heads draft per step, sized for the machine (False: a static tree;
    None: no heads)."""
    return None if engine.heads is None else kinds.kind(engine.heads.config.kind).drafts_per_step


def _tree_nodes(engine: Engine, tree: str | None) -> int | None:
    """Nodes (root included) of the heads' tree: the static tree of Medusa heads, the dynamic
    tree's budget of eagle heads, the block heads' proposal (chain and siblings)."""
    if engine.heads is None:
        return None
    if _drafts(engine):
        return engine.proposer(engine.heads.config.kind).max_rows
    return len(engine.tree_paths(tree)) + 1


def _sizes_reason(engine: Engine) -> str | None:
    """How the eagle or block heads' trees were sized (None: neither)."""
    if not _drafts(engine):
        return None
    trees = engine.plan.decision("trees")
    return trees.reason if trees is not None else "calibrated for the device type"


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
    proposer = engine.proposer("lookahead")
    return f"{proposer.describe()}: {proposer.size.reason}"


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@mode("hf")
def run_hf(engine: Engine, ids: list[int], bench: Bench, model=None) -> Run:
    """transformers ``generate`` on the engine's target, or on ``model`` (another copy of it)."""
    if not bench.sampling.greedy and bench.sampling.seed is not None:
        torch.manual_seed(bench.sampling.seed)  # transformers samples from the global generator
    run = hf_generate(engine, ids, _hf_config(engine, bench), model=model)
    run.steps = len(run.tokens)
    return run


PLAIN_DTYPES = ("float32", "bfloat16")  # hf-float32, hf-bfloat16: transformers as a user loads the target


def run_hf_as_loaded(engine: Engine, ids: list[int], bench: Bench, *, dtype: str) -> Run:
    """transformers ``generate`` on the target as a user loads it for transformers alone: its
    own copy in ``dtype`` with transformers' default attention and torch's kernels. ``hf``
    runs the engine's own target, in the engine's dtype, with its attention (batch-invariant
    in half precision); on a device where another dtype or attention runs ``generate``
    faster, that is the speed a user would compare with."""
    return run_hf(engine, ids, bench, model=bench.plain_targets[dtype])


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
def run_hf_compile(engine: Engine, ids: list[int], bench: Bench) -> Run:
    """transformers ``generate`` as a user would compile it: its own fixed-size ``StaticCache``
    and its ``torch.compile``'d decoding forward (``CompileConfig``; allowed on every device).
    The cache has ``HF_STATIC_MIN`` slots (a power of two above that for longer runs), so one
    graph serves every prompt; it is compiled in the bench's warm-up, outside the timing."""
    need = len(ids) + bench.max_new_tokens
    size = max(HF_STATIC_MIN, 1 << (need - 1).bit_length())
    if engine.max_positions is not None:
        size = min(size, engine.max_positions)
    cache = StaticCache(config=engine.model.config, max_cache_len=size)
    compiled = CompileConfig(fullgraph=False, mode="default" if engine.device.type != "cuda" else "reduce-overhead")
    compiled._compile_all_devices = True  # transformers compiles on CUDA only unless this is set
    run = hf_generate(engine, ids, _hf_config(engine, bench, compile_config=compiled),
                      **kv.cache_kwarg(engine.model.forward, cache))  # generate takes the model's name
    run.steps = len(run.tokens)
    return run


def _answer_ngrams(engine: Engine, wanted: bool) -> str | None:
    """What the hybrid modes' chains draw on besides the text: the heads' n-gram table, if used."""
    table = getattr(engine.heads, "ngrams", None)
    if table is None or not wanted:
        return None
    return f"{len(table)} contexts from {table.sequences} answers"


COMPILED = "+compile"  # mode suffix: the engine mode with a compiled pass, beside the eager one in the same run
HEAD_KINDS = kinds.KINDS  # mode suffix @KIND: the engine mode on heads of that kind
UNSHIPPED = tuple(k for k in HEAD_KINDS if k not in SHIPPED)  # kinds no heads ship for: their modes need --heads or --KIND-heads
JACOBI = "+lookahead"  # mode hybrid's suffix: its pass also runs lookahead's window and pool n-grams
_SPEC = re.compile(rf"^(?P<base>[a-z0-9]+)(?:@(?P<kind>{'|'.join(HEAD_KINDS)}))?(?P<jacobi>\{JACOBI})?"
                   rf"(?P<compiled>\{COMPILED})?(?::(?P<kernels>[a-z0-9>]+))?$")


@dataclass(frozen=True)
class ModeSpec:
    """An engine mode as the bench names it: ``BASE[@KIND][+lookahead][+compile][:KERNELS]``."""

    base: str  # the engine's mode (medusa, eagle, hybrid, ...)
    kind: str | None  # heads kind it runs on (None: the heads --heads loaded)
    compiled: bool
    lookahead: bool = False  # hybrid only: with lookahead's window and pool (ProposerConfig.hybrid_lookahead)
    kernels: str | None = None  # linear kernels other than the plan's pick (medusa.runtime.kernels.split_kernels)


def mode_spec(name: str) -> ModeSpec | None:
    """The engine mode ``name`` names (None: not an engine mode). ``medusa`` and ``eagle`` run
    heads of their own kind; other modes the loaded heads unless ``@KIND`` says which."""
    found = _SPEC.match(name)
    if found is None or found["base"] not in ENGINE_MODES or (found["jacobi"] and found["base"] != "hybrid"):
        return None
    if found["kernels"] is not None:
        try:
            split_kernels(found["kernels"])
        except ValueError:
            return None
    kind = found["kind"] or (found["base"] if found["base"] in HEAD_KINDS else None)
    return ModeSpec(found["base"], kind, bool(found["compiled"]), bool(found["jacobi"]), found["kernels"])


def runs_lookahead(modes: list[str]) -> bool:
    """Whether a mode of the run runs lookahead's window (mode lookahead, or hybrid+lookahead)."""
    return any(m == "lookahead" or JACOBI in m for m in modes)


def known_mode(name: str) -> bool:
    return name in MODES or mode_spec(name) is not None


def _heads_source(bench: Bench, kind: str):
    """The heads of ``kind`` a mode runs: the loaded ones if of that kind (and not overridden),
    else --eagle-heads / --medusa-heads, else the kind shipped for the embedded model."""
    main, given = bench.main, getattr(bench.args, f"{kind}_heads")
    if given is None and main.heads is not None and main.heads.config.kind == kind:
        return main.heads
    if given is None and kind in UNSHIPPED:
        raise MedusaError(f"modes on {kind} heads need a folder of them: pass --heads FOLDER or --{kind}-heads FOLDER "
                          f"(no {kind} heads ship with this install)")
    return given or kind  # "medusa"/"eagle": medusa.load's shipped heads of that kind


def engine_for(bench: Bench, spec: ModeSpec) -> Engine:
    """The engine ``spec`` runs on, loaded through ``medusa.load`` on the bench's target (once)."""
    main = bench.main
    heads = main.heads if spec.kind is None else _heads_source(bench, spec.kind)
    slot = (None if heads is main.heads else spec.kind, spec.compiled, spec.lookahead, spec.kernels)
    if slot not in bench.engines:
        a = bench.args
        proposers = dataclasses.replace(main.proposer_config, hybrid_lookahead=spec.lookahead)
        engine = medusa.load(target=main, heads=heads, static_cache=a.static_cache, compile=spec.compiled or a.compile,
                             proposers=proposers, draft_dtype=a.draft_dtype, autotune=AUTOTUNE[a.autotune],
                             kernels=spec.kernels)
        if spec.kind is not None and engine.heads.config.kind != spec.kind:
            flag = f"--{spec.kind}-heads" if getattr(a, f"{spec.kind}_heads") else "--heads"
            raise MedusaError(f"{flag} {getattr(a, f'{spec.kind}_heads') or a.heads} holds "
                              f"{engine.heads.config.kind} heads: pass a folder of {spec.kind} heads")
        bench.engines[slot] = engine
    return bench.engines[slot]


def run_mode(name: str, engine: Engine, ids: list[int], bench: Bench) -> Run:
    """One mode on one prompt: an engine mode on its engine, else the registered runner."""
    spec = mode_spec(name)
    if spec is None:
        return MODES[name](engine, ids, bench)
    return _engine_run(engine_for(bench, spec), ids, bench, name=spec.base)


def precompile(modes: list[str], bench: Bench) -> dict[str, float]:
    """Compile, before any timing, every pass size each compiled mode can use; seconds per mode."""
    seconds = {}
    for name in modes:
        spec = mode_spec(name)
        if spec is None or not engine_for(bench, spec).passes.compiled:
            continue
        engine = engine_for(bench, spec)
        t0 = time.perf_counter()
        buckets = engine.precompile(spec.base, _static_tree(engine, bench.tree))
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: compiled pass sizes {', '.join(map(str, buckets))} in {seconds[name]:.1f} s", file=sys.stderr)
    return seconds


@mode("hf-assisted")
def run_hf_assisted(engine: Engine, ids: list[int], bench: Bench) -> Run:
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
    return hf_generate(engine, ids, _hf_config(engine, bench, **settings), assistant_model=engine.draft)


@mode("prompt-lookup")
def run_prompt_lookup(engine: Engine, ids: list[int], bench: Bench) -> Run:
    """transformers' prompt lookup decoding with the same settings as ``lookup``."""
    config = _hf_config(engine, bench, prompt_lookup_num_tokens=engine.proposer_config.chain(),
                        max_matching_ngram_size=engine.proposer_config.lookup_ngram)
    return hf_generate(engine, ids, config)


# vLLM as a peer: vllm, vllm-ngram, vllm-heads, vllm-eagle and vllm-eagle3, each a long-lived worker in vLLM's own venv.
bench_vllm.register(mode, Run)
# llama.cpp as a peer: llamacpp and llamacpp-lookup, a long-lived llama-cpp-python worker on an F32 GGUF.
bench_llamacpp.register(mode, Run)


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
                    help="tokens copied per step (lookup, hybrid, prompt-lookup; default 8, and for hybrid on eagle "
                         "heads the chain sized with the tree for this machine)")
    ap.add_argument("--lookup-ngram", type=count(), default=pc.lookup_ngram, help="longest n-gram matched (lookup, hybrid, prompt-lookup)")
    ap.add_argument("--no-answer-ngrams", dest="answer_ngrams", action="store_false",
                    help="hybrid modes: draft no chain from the heads folder's n-gram table of the target's "
                         "answers where the text has no match (ngrams.safetensors; default: use it when there is one)")
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
    ap.add_argument("--output", default=None, help="folder for results.json, table.md and plots, e.g. bench_out/NAME "
                    "(default: none)")
    ap.add_argument("--out", dest="output", help=argparse.SUPPRESS)  # the old spelling
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def machine_flags(ap: argparse.ArgumentParser) -> None:
    """Sampling, device, dtype, kernels, compile: how every mode runs."""
    d = SamplingConfig()  # the one place sampling defaults live
    ap.add_argument("--temperature", type=float, default=None, help=f"0 is greedy (default: {d.temperature:g})")
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


AUTOTUNE = {"on": True, "cached": "cached", "off": False}  # --autotune -> medusa.load(autotune=...)


def parse_modes(text: str | None, engine: Engine | None = None) -> list[str]:
    """The modes asked for (default: hf, baseline and ``engine``'s default mode), all known."""
    names = [m.strip() for m in (text or f"hf,baseline,{engine.default_mode}").split(",") if m.strip()]
    modes = list(dict.fromkeys(names))
    unknown = [m for m in modes if not known_mode(m)]
    if unknown:
        raise MedusaError(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}, "
                          f"{', '.join(ENGINE_MODES)} (an engine mode with @KIND, {', '.join(HEAD_KINDS)}, runs those heads, "
                          f"with {COMPILED} compiled)")
    return modes


def check_outputs(args: argparse.Namespace) -> None:
    """Before the run: the report's plots need matplotlib, and the outputs must be writable."""
    if args.output:
        require_extra("bench")
    for flag, folder in (("--json", args.json and Path(args.json).parent), ("--output", args.output and Path(args.output))):
        if folder:
            writable_folder(folder, flag)  # before the run: a long bench never ends in a traceback


def load_bench(args: argparse.Namespace) -> Bench:
    """The main engine through ``medusa.load`` and the run's settings."""
    wanted = set(args.modes.split(",")) if args.modes else set()
    draft = args.draft or ("default" if {"draft", "hf-assisted"} & wanted else None)
    proposers = ProposerConfig(draft_tokens=args.draft_tokens, adaptive_draft=args.adaptive_draft,
                               draft_confidence=args.draft_confidence, lookup_tokens=args.lookup_tokens,
                               lookup_ngram=args.lookup_ngram, answer_ngrams=args.answer_ngrams,
                               **dict(zip(("lookahead_window", "lookahead_ngram", "lookahead_guesses"),
                                          args.lookahead or ())))
    engine = medusa.load(model=args.model, heads=args.heads, draft=draft, device=args.device, dtype=args.dtype,
                         tree=None, static_cache=args.static_cache, compile=args.compile, proposers=proposers,
                         kernels=args.kernels, draft_dtype=args.draft_dtype, autotune=AUTOTUNE[args.autotune])
    set_chat_template(engine.tokenizer, args.chat_template)  # every engine of the run encodes with the main one's
    sampling = SamplingConfig().override(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         seed=args.seed, acceptance=args.acceptance)
    return Bench(args=args, sampling=sampling, max_new_tokens=args.max_new_tokens, tree=args.tree,
                 engines={(None, False, False, None): engine})


def prepare(bench: Bench, modes: list[str]) -> None:
    """Every engine the modes run on, loaded before any timing; --tree used by one of them."""
    specs = [s for s in map(mode_spec, modes) if s is not None]
    engines = [(s, engine_for(bench, s)) for s in specs]
    static = [s.base for s, e in engines if s.base in ("medusa", "hybrid") and _drafts(e) is False]
    if bench.tree is not None and not static:
        raise MedusaError(f"--tree shapes the static tree of Medusa heads (modes medusa, hybrid on Medusa heads), which "
                          f"none of {', '.join(modes)} uses (eagle heads grow their tree per step): drop --tree")
    bench.plain_targets = plain_targets(modes, bench.args, bench.main.device)


def eagle_engine(bench: Bench) -> Engine | None:
    """The engine the eagle (or block) modes ran on (loaded for them, else the main one with such heads)."""
    eager = [(kind, e) for (kind, compiled, _, _), e in bench.engines.items() if not compiled]
    found = [e for kind, e in eager if kind is not None and kinds.kind(kind).sized] + [e for _, e in eager if _drafts(e)]
    return found[0] if found else None


def timed_runs(bench: Bench, modes: list[str], prompts: list[Prompt]) -> dict[str, list[Run]]:
    """Warm every mode up once, then run the prompts interleaved across modes."""
    for p in prompts:
        p.ids = encode(bench.main, p.text)
    print(f"{len(prompts)} prompts from {bench.args.prompts}, {bench.max_new_tokens} new tokens, modes: "
          f"{', '.join(modes)}", file=sys.stderr)
    for engine in {id(e): e for e in bench.engines.values()}.values():
        if _drafts(engine):
            proposal = engine.proposer(engine.heads.config.kind).describe()
            print(f"{engine.heads.config.kind} heads' {proposal}{' (compiled)' if engine.passes.compiled else ''}: "
                  f"{_sizes_reason(engine)}", file=sys.stderr)
    if runs_lookahead(modes):
        print(f"lookahead: {_lookahead_reason(bench.main)}", file=sys.stderr)
    bench.compile_seconds = precompile(modes, bench)  # compiled passes: every size, before any timing
    short = bench.shorter(8)
    for m in modes:  # warm-up: allocator, kernels and caches, outside the timing
        run_mode(m, bench.main, prompts[0].ids, short)
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for p in tqdm(prompts, desc="prompts", file=sys.stderr):
        for m in modes:
            runs[m].append(run_mode(m, bench.main, p.ids, bench))
    return runs


def run_meta(bench: Bench, prompts: list[Prompt], modes: list[str], fastest: str | None) -> dict:
    """What the results were measured with (the engines' plans from ``engine.describe()``)."""
    a, engine, eagle = bench.args, bench.main, eagle_engine(bench)
    compiled = next((e for (_, on, _, _), e in bench.engines.items() if on), None)
    return {"model": a.model or "embedded default", "heads": a.heads or "default", "max_new_tokens": a.max_new_tokens,
            "draft": None if engine.draft is None else (a.draft or "default"), "draft_tokens": a.draft_tokens,
            "adaptive_draft": a.adaptive_draft, "draft_confidence": a.draft_confidence,
            "lookup_tokens": a.lookup_tokens, "lookup_ngram": a.lookup_ngram,
            "answer_ngrams": _answer_ngrams(eagle or engine, a.answer_ngrams),
            "prompts": a.prompts, "num_prompts": len(prompts), "device": str(engine.device),
            "dtype": str(engine.model.dtype), "torch_threads": torch.get_num_threads(), "kernels": engine.kernels,
            "plan": engine.describe(), "eagle_plan": None if eagle is None or eagle is engine else eagle.describe(),
            "sampling": dataclasses.asdict(bench.sampling), "default_mode": engine.default_mode,
            "tree_nodes": _tree_nodes(engine, bench.tree), "compile_seconds": bench.compile_seconds,
            "eagle_tree_nodes": _tree_nodes(eagle, None) if eagle is not None and eagle is not engine else None,
            "tree_sizes": _sizes_reason(eagle or engine),
            "compiled_tree_sizes": _sizes_reason(compiled) if compiled is not None else None,
            "lookahead": _lookahead_reason(engine) if runs_lookahead(modes) else None,
            "kernel_plans": {k[3]: e.describe() for k, e in bench.engines.items() if k[3] is not None} or None,
            "proposals": _proposals(bench, modes), "fastest_transformers": fastest}


def _proposals(bench: Bench, modes: list[str]) -> dict[str, str]:
    """Each engine mode's proposal, in its proposer's words (Proposer.describe)."""
    out = {}
    for name in modes:
        spec = mode_spec(name)
        if spec is not None:
            engine = engine_for(bench, spec)
            out[name] = engine.proposer(spec.base, _static_tree(engine, bench.tree)).describe()
    return out


def write_results(args: argparse.Namespace, meta: dict, summary: dict, reference: str | None, heads) -> None:
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "modes": summary}, indent=1))
    if args.output:
        from infer.report import write_report

        folder = write_report(Path(args.output), meta, summary, reference,
                              "\n\n".join([table(summary, reference), *profile_lines(summary)]), heads)
        print(f"report written to {folder}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.modes:
            parse_modes(args.modes)  # before loading anything: an unknown mode is a one-line error now
        check_outputs(args)
        prompts = read_prompts(args.prompts, args.limit, args.per_category)
        bench = load_bench(args)
        modes = parse_modes(args.modes, bench.main)
        prepare(bench, modes)
        runs = timed_runs(bench, modes, prompts)
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:  # the peers' workers belong to this run (their model and settings are this run's)
        bench_vllm.close_all()
        bench_llamacpp.close_all()
    reference = "hf" if "hf" in modes else None
    summary = summarise(prompts, runs, reference, sampled=not bench.sampling.greedy)
    print(table(summary, reference))
    for line in profile_lines(summary):
        print(line)
    fastest = against_fastest_peer(summary)
    if fastest:
        print(fastest)
    write_results(args, run_meta(bench, prompts, modes, fastest), summary, reference, bench.main.heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
