"""Export heads for serving: the speculators format, vLLM's Medusa, EAGLE-1 or EAGLE-3 layout, or FasterDecoding's.

    python scripts/export_heads.py EAGLE3_HEADS --output heads-spec [--model TARGET]   # --to speculators
    vllm serve heads-spec
    python scripts/export_heads.py MEDUSA_HEADS --output medusa-vllm [--model TARGET]  # --to vllm
    vllm serve TARGET --speculative-config '{"method": "medusa", "model": "medusa-vllm", "num_speculative_tokens": K}'

HEADS is a heads folder (this repo's, or a published layout: see medusa/models/published.py) or a
Hub id USER/NAME. ``--to speculators`` (the default for EAGLE-3 heads) writes
vllm-project/speculators' format: its config names the target (``verifier``) and the number of
speculative tokens, so ``vllm serve FOLDER`` needs no --speculative-config. Medusa heads write it
too when asked, for speculators' own tools; vLLM serves no speculators ``medusa`` folder, so their
default is ``--to vllm``, vLLM's Medusa layout served with a speculative config. Heads that share the target's lm_head
(the default) need the target (--model, default: the base model the heads record) so that
its lm_head can be copied: once for vLLM (which all heads then use), once per head for
FasterDecoding. EAGLE-style heads (kind: eagle) trained with ``eagle_layout: eagle1`` export
to vLLM's EAGLE-1 drafter (``"method": "eagle"``): the target's config cut to one layer and
the head's weights alone (vLLM shares the target's embeddings and lm_head); eagle heads in
the ``norms`` layout compute another function and are refused (see medusa/hub/export.py).
EAGLE-3 heads (kind: eagle3) export to vLLM's EAGLE-3 Llama drafter (``"method": "eagle3"``):
their weights under their own names, their draft vocabulary as ``d2t`` and the target layers
they read as ``eagle_aux_hidden_state_layer_ids``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa.config import HelpFormatter, writable_folder
from medusa.errors import MedusaError
from medusa.hub.export import (
    LAYOUTS,
    check_eagle_exportable,
    check_kind_exportable,
    export_heads,
    target_for,
    target_lm_head,
    target_text_config,
)
from medusa.hub.hub import card_base_model, folder_listing, read_heads, resolve_heads_folder
from medusa.models.heads_config import CALIBRATION_NAME
from medusa.models.kinds import kind
from medusa.models.target import parse_dtype
from medusa.runtime.files import read_json


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/export_heads.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("heads", help="heads folder (ours or FasterDecoding's) or Hub id USER/NAME")
    ap.add_argument("--to", default=None, choices=LAYOUTS,
                    help="layout to write (default: speculators for eagle3 heads, vllm for medusa and eagle heads)")
    ap.add_argument("--output", help="folder to write: new, empty, or an earlier export (required)")
    ap.add_argument("--out", dest="output", help=argparse.SUPPRESS)  # the old spelling
    ap.add_argument("--model", default=None,
                    help="target model for shared-projection heads: Hub id, folder or .gguf (default: the heads' base model)")
    ap.add_argument("--dtype", default=None, help="cast weights to float32, bfloat16 or float16 (default: as stored)")
    ap.add_argument("--draft-vocab", action="store_true",
                    help="vllm: draft from the calibrated draft vocabulary of the heads (calibration.json) only")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.output is None:  # not required=True: the old spelling --out also sets it
        ap.error("the following arguments are required: --output")
    return args


def read_draft_vocab(folder: Path) -> list[int]:
    path = folder / CALIBRATION_NAME
    fix = "run scripts/calibrate_tree.py again, or drop --draft-vocab"
    vocab = read_json(path, fix).get("draft_vocab") if path.is_file() else None
    if not vocab:
        raise MedusaError(f"{folder} has no calibrated draft vocabulary: run scripts/calibrate_tree.py first, or drop --draft-vocab")
    return vocab


def target_model(folder: Path, model: str | None):
    """The target, loaded, for published heads that leave its layers implicit (SafeAILab's
    EAGLE-3); None for every other folder (the heads' own config says all)."""
    from medusa.models import published
    from medusa.models.target import load_target

    if published.detect(folder) != published.SAFEAILAB_EAGLE3 or model is None:
        return None
    return load_target(model, device="cpu")[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        dtype = parse_dtype(args.dtype) if args.dtype else None
        writable_folder(Path(args.output).parent, "--output")
        folder = resolve_heads_folder(args.heads)
        config, state = read_heads(folder, target_model(folder, args.model))
        facts = kind(config.kind)
        layout = args.to or (*facts.exports, "speculators")[0]  # the kind's default layout (none: refused below)
        draft_vocab = read_draft_vocab(folder) if args.draft_vocab else None
        check_kind_exportable(config)
        lm_head, target_config = None, None
        if "eagle_layout" in facts.own_fields:
            check_eagle_exportable(config, layout)  # before loading the target
        if facts.on_target:
            target_config = target_text_config(config, args.model)
        elif config.projection == "shared":
            target = target_for(config, args.model)
            copies = "once, for all heads" if layout != "fasterdecoding" else f"into each of {config.num_heads} heads"
            print(f"copying lm_head of {target or 'the embedded default model'} {copies}", file=sys.stderr)
            lm_head = target_lm_head(config, args.model, dtype=dtype or next(iter(state.values())).dtype)
        base = args.model or card_base_model(config.base_model)
        verifier = {"name_or_path": base, "architectures": (target_config or {}).get("architectures") or []}
        out = export_heads(config, state, args.output, layout, lm_head=lm_head, dtype=dtype, draft_vocab=draft_vocab,
                           target_config=target_config, verifier=verifier)
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for rel, size in folder_listing(out):
        print(f"  {out / rel}  {size / 2**20:.2f} MiB")
    if layout == "speculators":
        print(f"serve with:\n  vllm serve {out}" + ("" if base else "   (its config names no target: pass --model)"))
    if layout == "vllm":
        method = config.kind  # vLLM's method is the kind's name
        spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": config.num_heads})
        base = args.model or card_base_model(config.base_model) or "TARGET"
        print(f"serve with:\n  vllm serve {base} --speculative-config '{spec}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
