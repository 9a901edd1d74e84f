"""The server process's layout (medusa/serving/process.py): decoding on the calling (initial)
thread, HTTP on another; a signal drains what runs and returns; a taken port is one error."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest
from test_serve import TEMPLATE, free_port
from tiny import tiny_model
from tiny_heads import VOCAB, word_tokenizer

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.loader import init_heads_for
from medusa.serving.process import serve
from medusa.serving.server import Server


def tiny_server() -> tuple[Server, Engine]:
    model = tiny_model("llama", vocab_size=VOCAB)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    engine = Engine(model, tokenizer=tokenizer, heads=init_heads_for(model, num_heads=3))
    return Server(engine, "tiny", max_batch=4, default_max_tokens=16), engine


def alone(engine: Engine, text: str, n: int) -> str:
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return tok.decode(engine.generate(list(ids), max_new_tokens=n, temperature=0).tokens, skip_special_tokens=True)


def test_decoding_runs_on_the_serving_thread_and_a_signal_drains_what_runs():
    server, engine = tiny_server()
    port, stepped_on, answers, errors = free_port(), set(), [], []
    step_done = server.metrics.step_done

    def spy(*args, **kwargs):  # the real metrics, and which thread ran the step
        stepped_on.add(threading.current_thread())
        return step_done(*args, **kwargs)

    server.metrics.step_done = spy
    body = {"messages": [{"role": "user", "content": "w7 w8 w9"}], "max_tokens": 12, "temperature": 0}

    def client():
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "the server did not come up"
                    time.sleep(0.05)
            answers.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json())
            # a request in flight when the signal comes still gets its whole answer
            late = threading.Thread(target=lambda: answers.append(
                httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 16}, timeout=60).json()))
            late.start()
            while server.scheduler.load()["running"] + server.scheduler.load()["prefilling"] == 0 and late.is_alive():
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGTERM)
            late.join(60)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client)
    thread.start()
    handler = signal.getsignal(signal.SIGTERM)
    serve(server, "127.0.0.1", port, log_level="warning", graceful=30)  # returns once the signal has drained it
    thread.join(60)
    assert not errors, errors
    assert stepped_on == {threading.main_thread()}  # every step on the serving (here: initial) thread
    assert signal.getsignal(signal.SIGTERM) is handler  # its handlers are put back
    assert len(answers) == 2
    assert answers[0]["choices"][0]["message"]["content"] == alone(engine, "w7 w8 w9", 12)
    assert answers[1]["choices"][0]["message"]["content"] == alone(engine, "w7 w8 w9", 16)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # gone


def test_a_taken_port_is_one_error_and_nothing_waits():
    server, _ = tiny_server()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(MedusaError, match=f"could not serve on 127.0.0.1:{port}.*pick another --port"):
            serve(server, "127.0.0.1", port, log_level="critical")
    assert time.monotonic() - t0 < 60
    with pytest.raises(MedusaError, match="runs already"):
        server.scheduler.start()
        server.scheduler.run()
