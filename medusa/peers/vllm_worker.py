"""A long-lived vLLM decoding process, run by the Python of a separate vLLM install.

    VENV/bin/python medusa/peers/vllm_worker.py '{"model": DIR, "speculative_config": {...}}'

This file imports only the standard library and vLLM: it runs inside the vLLM venv, which
has its own pinned torch and transformers and not this project. ``medusa.peers.vllm_client`` starts
it and speaks JSON lines with it:

    worker -> {"ready": true, "vllm": VERSION}                once the model is loaded
    client -> {"prompt_ids": [...], "max_tokens": N}          one greedy decode, batch 1
    worker -> {"tokens": [...], "seconds": S, "spec": {...}}  spec: this request's drafts,
                                                              draft tokens, accepted tokens
                                                              and accepted tokens per position
    worker -> {"error": "..."}                                instead, when a request fails

vLLM logs to stdout, so the protocol gets a private copy of the original stdout and fd 1
is pointed at stderr before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

# Counter names of vLLM's speculative-decoding metrics (V1 engine, get_metrics()).
_SPEC = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
         "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def exit_with_parent(parent: int | None) -> None:
    """End this worker when the client that started it (pid ``parent``) dies, even by SIGKILL:
    a daemon thread sees this process re-parented, or the client gone (a wrapper script between
    them), and kills the process group this worker leads (with the engine processes it started),
    else this process. (The same few lines live in each worker script, which runs in another
    venv and imports nothing from this project.)"""
    first = os.getppid()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch() -> None:
        while os.getppid() == first and (parent is None or alive(parent)):
            time.sleep(0.5)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def spec_counters(llm) -> dict:
    """Cumulative spec-decode counters: drafts, draft tokens, accepted tokens, per position."""
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in _SPEC:
            out[_SPEC[metric.name]] += int(metric.value)
        elif metric.name == _PER_POS:
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    return out


def delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}, "accepted_per_pos": per_pos}


def compile_settings(compile: bool) -> dict:
    """vLLM compiles the model with torch.compile by default: minutes of startup on a small
    CPU. Eager mode (the default here) starts in seconds; ``compile`` keeps vLLM's own default."""
    return {} if compile else {"enforce_eager": True, "compilation_config": {"mode": 0}}


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    settings = json.loads(sys.argv[1])
    exit_with_parent(settings.get("parent"))
    # This file's folder (medusa/hub) must not shadow packages of the vLLM venv.
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=settings["model"], tokenizer=settings.get("tokenizer") or settings["model"],
              dtype=settings.get("dtype", "float32"), seed=0, max_model_len=settings.get("max_model_len", 2048),
              max_num_seqs=1, speculative_config=settings.get("speculative_config"), disable_log_stats=False,
              trust_remote_code=False, **compile_settings(settings.get("compile", False)))
    proto.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]))
            before = spec_counters(llm)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": req["prompt_ids"]}], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            reply = {"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds,
                     "spec": delta(spec_counters(llm), before)}
        except Exception as err:  # noqa: BLE001 - any failure goes back to the client as one line
            reply = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
