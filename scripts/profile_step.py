"""Where does a decode step's time go? Times each phase of the engine's step in isolation.

    python scripts/profile_step.py [--model M] [--heads H] [--tree cpu] [--prefix 200] [--reps 20]

Reports the median milliseconds of: a one-token target pass (plain decoding's whole step),
the tree pass, the heads' top-k, verification with its host sync, and cache compaction.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import medusa
from medusa.config import HelpFormatter, count
from medusa.decoding.tree import compile_tree
from medusa.decoding.verify import verify_greedy
from medusa.runtime import hf as kv


def timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # device work is asynchronous: time it to completion


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/profile_step.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="Hub id, model folder or .gguf file (default: the embedded model)")
    ap.add_argument("--heads", default="init", help="heads folder, Hub id, or 'init' for untrained heads")
    ap.add_argument("--tree", default=None, help="a name in medusa/assets/trees or a JSON file of paths "
                    "(default: calibrated per device)")
    ap.add_argument("--prefix", type=count(1), default=200, help="tokens in the cache before the profiled step")
    ap.add_argument("--reps", type=count(1), default=20, help="repetitions of each profiled step")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: picked per device)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    eng = medusa.load(model=args.model, heads=args.heads, tree=args.tree, device=args.device, dtype=args.dtype)
    model, heads = eng.model, eng.heads
    tree = compile_tree(eng.tree_paths(args.tree)).to(eng.device)
    prefix = torch.randint(100, 10000, (1, args.prefix), device=eng.device)
    cache = kv.new_cache()
    with torch.inference_mode():
        _, hidden = kv.forward(model, prefix, torch.arange(args.prefix, device=eng.device)[None], cache, None)
        h = hidden[-1]
        tokens = torch.randint(100, 10000, (tree.num_nodes,), device=eng.device)
        positions = (args.prefix + tree.depth)[None]

        def one_token():
            kv.forward(model, tokens[:1][None], positions[:, :1], cache, None)
            kv.crop(cache, args.prefix)

        def tree_pass():
            mask = kv.tree_attention_mask(model, args.prefix, tree.ancestor, tree.depth, model.dtype)
            kv.forward(model, tokens[None], positions, cache, mask)
            kv.crop(cache, args.prefix)

        mask = kv.tree_attention_mask(model, args.prefix, tree.ancestor, tree.depth, model.dtype)
        logits, _ = kv.forward(model, tokens[None], positions, cache, mask)

        def verify():
            acc = verify_greedy(tree, tokens, logits)
            torch.cat([acc.length.view(1), acc.next_token.view(1), acc.path]).tolist()

        def keep():
            kv.keep_nodes(cache, args.prefix, torch.tensor([0, 1, 3], device=eng.device), contiguous=False)

        rows = {
            "target pass, 1 token (plain decoding step)": timed(one_token, args.reps),
            f"target pass, tree of {tree.num_nodes} nodes": timed(tree_pass, args.reps),
            f"heads top-k ({tree.max_depth} heads)": timed(lambda: heads.topk(h, max(tree.topk), num_heads=tree.max_depth), args.reps),
            "tree mask build": timed(lambda: kv.tree_attention_mask(model, args.prefix, tree.ancestor, tree.depth, model.dtype), args.reps),
            "verify + host sync": timed(verify, args.reps),
        }
        kv.crop(cache, args.prefix)
        kv.forward(model, tokens[None], positions, cache, mask)
        rows["cache compaction"] = timed(keep, 1)
    print(f"device {eng.device}, {model.dtype}, {torch.get_num_threads()} threads, prefix {args.prefix}")
    for name, ms in rows.items():
        print(f"{ms:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
