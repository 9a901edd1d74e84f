"""A long-lived llama.cpp decoding process, run by the Python of a llama-cpp-python install.

    VENV/bin/python medusa/peers/llamacpp_worker.py '{"model": FILE.gguf, "n_ctx": N, "n_threads": T, "lookup": null}'

This file imports only the standard library and ``llama_cpp``: it runs inside the llama.cpp
venv, not this project's. ``medusa.peers.llamacpp_client`` starts it and speaks JSON lines with it:

    worker -> {"ready": true, "llama_cpp": VERSION}                    once the model is loaded
    client -> {"prompt_ids": [...], "max_tokens": N, "eos": [...]}      one greedy decode, batch 1
    worker -> {"tokens": [...], "seconds": S, "passes": P,            passes: Llama.eval calls,
               "first_seconds": F}                                     the prompt's included; F: to
                                                                        the first token
    worker -> {"error": "..."}                                          instead, when a request fails

``lookup`` (``{"tokens": K, "ngram": N}``) decodes with llama-cpp-python's
``LlamaPromptLookupDecoding(max_ngram_size=N, num_pred_tokens=K)`` as its draft model: each
``Llama.eval`` then verifies the drafted tokens in one batch. Decoding is greedy (temperature
0: llama.cpp's greedy sampler, no penalties), keeps the KV cache in F32 like the weights, stops
after ``max_tokens`` tokens or after an ``eos`` token (which is kept, as ``generate`` keeps it),
and starts every prompt from an empty cache (llama-cpp-python would otherwise reuse the previous
prompt's common prefix, which changes both the time and the prefill's arithmetic).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

GGML_TYPE_F32 = 0  # ggml_type of an F32 tensor (the KV cache's element type)


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


def load(settings: dict):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = settings.get("lookup")
    draft = None if lookup is None else LlamaPromptLookupDecoding(max_ngram_size=int(lookup["ngram"]),
                                                                  num_pred_tokens=int(lookup["tokens"]))
    threads = int(settings["n_threads"])
    # With a draft model llama-cpp-python keeps every position's logits, in an array it sizes
    # n_ctx rows only when logits_all is passed (else n_batch, 512: past that a verification fails)
    return Llama(model_path=settings["model"], n_ctx=int(settings["n_ctx"]), n_threads=threads,
                 n_threads_batch=threads, logits_all=draft is not None, draft_model=draft, type_k=GGML_TYPE_F32,
                 type_v=GGML_TYPE_F32, seed=0, verbose=False)


def decode(llm, prompt_ids: list[int], max_tokens: int, eos: set[int], drafts: int = 0) -> dict:
    """One greedy decode of ``prompt_ids``, timed alone; the target passes it ran counted.
    ``drafts``: the tokens a prompt-lookup verification can run past the answer's last token."""
    if len(prompt_ids) + max_tokens + drafts + 1 > llm.n_ctx():
        raise ValueError(f"{len(prompt_ids)} prompt + {max_tokens} new tokens (+ {drafts} drafted) exceed the "
                         f"context of {llm.n_ctx()}: start the worker with a larger n_ctx")
    passes = 0
    evaluate = type(llm).eval

    def counted(tokens):
        nonlocal passes
        passes += 1
        return evaluate(llm, tokens)

    llm.eval = counted  # instance attribute: generate() calls self.eval once per target pass
    llm.reset()
    tokens: list[int] = []
    first = None
    t0 = time.perf_counter()
    try:
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter() - t0
            tokens.append(int(token))
            if len(tokens) >= max_tokens or token in eos:
                break
        seconds = time.perf_counter() - t0
    finally:
        del llm.eval
    return {"tokens": tokens, "seconds": seconds, "passes": passes, "first_seconds": first}


def main() -> int:
    # llama.cpp's native logging writes to fd 1: the protocol keeps a private copy of stdout.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    settings = json.loads(sys.argv[1])
    exit_with_parent(settings.get("parent"))
    # This file's folder (medusa/hub) must not shadow packages of the llama.cpp venv.
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

    import llama_cpp

    llm = load(settings)
    proto.write(json.dumps({"ready": True, "llama_cpp": llama_cpp.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            reply = decode(llm, list(req["prompt_ids"]), int(req["max_tokens"]), set(req.get("eos", [])),
                           int((settings.get("lookup") or {}).get("tokens", 0)))
        except Exception as err:  # noqa: BLE001 - any failure goes back to the client as one line
            reply = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
