"""Publish trained heads to the Hugging Face Hub, with a model card.

    python scripts/publish_heads.py HEADS_DIR --repo-id USER/NAME [--bench-json bench.json] [--private]
    python scripts/publish_heads.py HEADS_DIR --repo-id USER/NAME --dry-run   # build and list, no token needed

The token comes from `hf auth login` or HF_TOKEN and is never printed. Only README.md,
config.json and model.safetensors are uploaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medusa.config import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/publish_heads.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("heads", help="heads folder written by train/train_heads.py (or a FasterDecoding Medusa-1 folder)")
    ap.add_argument("--repo-id", required=True, help="Hub repository USER/NAME (created if missing)")
    ap.add_argument("--dry-run", action="store_true", help="build the folder and list what would be uploaded; no token needed")
    ap.add_argument("--private", action="store_true", help="create the repository as private")
    ap.add_argument("--bench-json", default=None, help="results of `python -m infer.bench --json FILE` for the card's "
                    "tau and speedup (default: none)")
    ap.add_argument("--base-model", default=None, help="Hub id of the base model for the card (default: from the heads config)")
    ap.add_argument("--license", default=None, help="license id for the card's metadata, e.g. apache-2.0 (default: none)")
    ap.add_argument("--output", default=None, help="where to build the folder (default: out/publish/NAME; a temporary "
                    "folder when uploading)")
    ap.add_argument("--out", dest="output", help=argparse.SUPPRESS)  # the old spelling
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = None
    if not args.dry_run:
        # First, with huggingface_hub alone (medusa imports torch): a missing token is
        # reported before any heads are read or files written.
        from huggingface_hub import get_token

        token = get_token()
        if not token:
            print("error: no Hugging Face token: run `hf auth login` or set HF_TOKEN (or use --dry-run to only build the folder)",
                  file=sys.stderr)
            return 1
    import tempfile

    from medusa.errors import MedusaError
    from medusa.hub.hub import build_publish_folder, folder_listing, upload

    try:

        name = args.repo_id.split("/")[-1]
        with tempfile.TemporaryDirectory(prefix="medusa-publish-") as tmp:
            out = Path(args.output) if args.output else (Path("out") / "publish" / name if args.dry_run else Path(tmp) / name)
            folder = build_publish_folder(args.heads, out, args.repo_id, bench_json=args.bench_json,
                                          base_model=args.base_model, license=args.license)
            files = folder_listing(folder)
            verb = "would upload" if args.dry_run else "uploading"
            print(f"{verb} to {args.repo_id}{' (private)' if args.private else ''}:")
            for rel, size in files:
                print(f"  {rel:<24} {size / 2**20:10.2f} MiB")
            print(f"  {'total':<24} {sum(s for _, s in files) / 2**20:10.2f} MiB")
            if args.dry_run:
                print(f"dry run: folder built at {folder}; nothing uploaded")
                return 0
            assert token is not None
            url = upload(folder, args.repo_id, token, private=args.private)
            print(f"published: {url}")
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
