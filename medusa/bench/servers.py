"""The servers a load run compares, started and stopped: this project's (``python -m
infer.serve``), llama.cpp's ``llama-server`` and vLLM's, each in its own process group with its
log in the temporary folder (``python -m infer.load``; the soak test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from medusa.bench.loadgen import wait_ready
from medusa.errors import MedusaError
from medusa.peers import vllm_server

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout: infer.serve runs from it


def start(server: str, port: int, max_batch: int, model_name: str, max_queue: int = 256,
          ) -> tuple[str, str, subprocess.Popen | None]:
    """``(url, model id, process)`` of a started (or, for ``url=URL``, a running) server: ``medusa``
    (``python -m infer.serve``), ``medusa-baseline`` (the same, ``--mode baseline``),
    ``llama-server``, ``vllm`` or ``vllm-ngram``, on ``port`` with ``max_batch`` sequences at once
    (and, for ours, ``max_queue`` waiting); ready when this returns."""
    if server.startswith("url="):
        return server[4:], model_name, None
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if server in ("medusa", "medusa-baseline"):
        cmd = [sys.executable, "-m", "infer.serve", "--port", str(port), "--max-batch", str(max_batch),
               "--max-queue", str(max_queue), "--log-level", "warning"]
        if server == "medusa-baseline":
            cmd += ["--mode", "baseline"]
    elif server == "llama-server":
        from medusa.peers.gguf_f32 import f32_gguf
        from medusa.peers.llama_server import ensure_llama_server, server_command

        ensure_llama_server()
        cmd = server_command(f32_gguf(None), port, max_batch, torch.get_num_threads())
    elif server in vllm_server.SERVERS:
        from medusa.models.target import default_model_dir
        from medusa.peers.vllm_client import vllm_python, worker_env

        cmd = vllm_server.server_command(vllm_python(), default_model_dir(), port, max_batch,
                                         model_name, ngram=server == "vllm-ngram")
        env = worker_env()
    else:
        raise MedusaError(f"unknown server {server!r}: use medusa, medusa-baseline, llama-server, vllm, vllm-ngram "
                          "or url=URL")
    log = open(Path(tempfile.gettempdir()) / f"medusa-load-{server}.log", "w")  # a full pipe would stall it
    # its own process group: vLLM's server runs its engine in child processes, stopped with it
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_ready(url, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return url, model_name, proc


def stop(proc: subprocess.Popen) -> None:
    """Ends a started server and every process it started: SIGTERM to its group, SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            os.killpg(proc.pid, 0)  # the server is gone; are its children?
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
        time.sleep(1)
