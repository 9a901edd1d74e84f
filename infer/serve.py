"""``python -m infer.serve``: an OpenAI-compatible server for many users at once.

    python -m infer.serve                        # the embedded default model and its shipped heads
    python -m infer.serve --model Qwen/Qwen2.5-0.5B-Instruct --heads USER/HEADS --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'

Requests are batched continuously by one scheduler thread (medusa/serving/scheduler.py); the
routes and their errors are medusa/serving/server.py's. docs/serving.md has the details.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from medusa.errors import MedusaError

KEY_VARIABLE = "MEDUSA_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hub id, model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", help="heads folder, Hub id, a shipped kind (medusa, eagle, eagle3) or 'init' (default: "
                   "the embedded model's shipped heads; none for another model)")
    p.add_argument("--mode", help="decoding mode for every request (default: the engine's, hybrid with heads)")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists (default: the "
                   "model's folder or Hub name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/ routes (default: ${KEY_VARIABLE} "
                   "if set, else no key)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded side by side (default: 8)")
    p.add_argument("--kv-memory", type=float, metavar="GIB", help="memory the running requests' KV caches may take, "
                   "in GiB; a request waits while its prompt and max_tokens would not fit beside theirs "
                   "(default: half the memory available at start)")
    p.add_argument("--prefix-memory", type=float, metavar="GIB", help="memory kept for finished requests' keys and "
                   "values, copied into later prompts that begin as they did (a conversation's history, a "
                   "system prompt) instead of prefilling them; 0 keeps none (default: 0.25, or a quarter of "
                   "--kv-memory if less)")
    p.add_argument("--prefill-rows", type=int, metavar="N", help="rows of a decoding pass a new prompt's prefill "
                   "shares with the running streams' while they decode: they get theirs, it the rest, a chunk a "
                   "step; 0: prompts prefill in passes of their own (default: 64)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; more get 429 (default: 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a request that names none, lowered to "
                   "what the context has left after its prompt (default: 256)")
    p.add_argument("--max-body", type=int, default=4 * 2**20, help="largest request body in bytes; larger ones get 413 "
                   "before they are read (default: 4194304, 4 MiB)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the machine plan's pick)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def served_name(model: str | None) -> str:
    from medusa.models.target import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.name if path.exists() else model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    key = args.api_key or os.environ.get(KEY_VARIABLE) or None
    try:
        import medusa
        from medusa.serving.process import serve
        from medusa.serving.server import Server, loopback_hosts

        engine = medusa.load(args.model, heads=args.heads, device=args.device, dtype=args.dtype)
        if args.mode is not None:
            engine.proposer(args.mode)  # the engine's one-line error for a mode it cannot run
        server = Server(engine, args.served_model_name or served_name(args.model), api_key=key,
                        max_batch=args.max_batch, max_queue=args.max_queue, default_max_tokens=args.max_tokens,
                        mode=args.mode, max_body=args.max_body, hosts=loopback_hosts(args.host, args.port),
                        kv_memory=None if args.kv_memory is None else int(args.kv_memory * 2**30),
                        prefix_memory=None if args.prefix_memory is None else int(args.prefix_memory * 2**30),
                        **({} if args.prefill_rows is None else {"prefill_rows": args.prefill_rows}))
    except MedusaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print(f"medusa: serving {server.model_name} (mode {args.mode or engine.default_mode}, batches of up to "
          f"{args.max_batch}, {server.scheduler.row_budget} rows a pass, {server.scheduler.kv_memory / 2**30:.1f} GiB "
          f"of KV cache) on http://{args.host}:{args.port}"
          + (" (API key required)" if key else ""), flush=True)
    if key is None and server.hosts is None:
        print(f"medusa: warning: no API key on {args.host}: anyone who can reach it can use it (set --api-key)",
              file=sys.stderr, flush=True)
    try:
        serve(server, args.host, args.port, log_level=args.log_level)
    except MedusaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
