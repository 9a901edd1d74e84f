"""The OpenAI-compatible server, driven by the real ``openai`` client and by concurrent clients on
127.0.0.1 (bounded in count and time): answers equal the engine's alone, streaming or not, and every
bad request, a missing key, an overload and a client that leaves get the right status."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from tiny import tiny_model
from tiny_heads import REPO, VOCAB, word_tokenizer

from medusa.decoding.engine import Engine
from medusa.models.loader import init_heads_for
from medusa.serving.server import Server, create_app

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w5 {% endif %}")
KEY = "sk-test-1234"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server in a thread of this process, on a free loopback port."""

    def __init__(self, api_key: str | None = None, max_batch: int = 4, max_queue: int = 8, window: int | None = None,
                 **server):
        model = tiny_model("llama", vocab_size=VOCAB)
        if window is not None:
            model.config.max_position_embeddings = window
        tokenizer = word_tokenizer()
        tokenizer.chat_template = TEMPLATE
        self.engine = Engine(model, tokenizer=tokenizer, heads=init_heads_for(model, num_heads=3))
        self.server = Server(self.engine, "tiny", api_key=api_key, max_batch=max_batch, max_queue=max_queue,
                             default_max_tokens=16, **server)
        self.port = free_port()
        config = uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def alone(self, text: str, n: int, chat: bool = True) -> str:
        tok = self.engine.tokenizer
        ids = (tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) if chat else tok(text)["input_ids"])
        return tok.decode(self.engine.generate(list(ids), max_new_tokens=n, temperature=0).tokens,
                          skip_special_tokens=True)


QUESTIONS = ["w7 w8 w9", "w10 w11 w10 w11 w10", "w40", "w12 " * 20, "w90 w91 w92 w93"]


@pytest.fixture(scope="module")
def running():
    with Running() as r:
        yield r


def test_chat_completion_equals_the_engine_alone(running):
    out = running.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                   max_tokens=20, temperature=0)
    assert out.choices[0].message.content == running.alone(QUESTIONS[0], 20)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 0
    assert json.loads(out.usage.model_dump_json())["tokens_per_pass"] >= 1.0


def test_streamed_chat_joins_to_the_same_text(running):
    stream = running.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == running.alone(QUESTIONS[1], 20)
    assert reasons[-1] in ("stop", "length") and usage is not None and usage.completion_tokens > 0


def test_completions_stream_and_not(running):
    client = running.client()
    out = client.completions.create(model="tiny", prompt=QUESTIONS[2], max_tokens=12, temperature=0)
    assert out.choices[0].text == running.alone(QUESTIONS[2], 12, chat=False)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=QUESTIONS[2], max_tokens=12, temperature=0, stream=True))
    assert streamed == out.choices[0].text


def test_models_and_health(running):
    assert [m.id for m in running.client().models.list().data] == ["tiny"]
    health = httpx.get(running.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and set(health) >= {"waiting", "running"}


def test_concurrent_clients_each_get_their_own_answer(running):
    def ask(q):
        return running.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    assert answers == [running.alone(q, 24) for q in QUESTIONS]
    assert running.server.scheduler.max_seen > 1  # they were batched


def test_seeded_sampling_repeats(running):
    def ask():
        return running.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTIONS[3]}], max_tokens=16, temperature=0.8,
            seed=7).choices[0].message.content
    assert ask() == ask()


@pytest.mark.parametrize("body, said", [
    ({"model": "other", "messages": [{"role": "user", "content": "w5"}]}, "unknown model"),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": -1}, "temperature must be >= 0"),
    ({"messages": [{"role": "user", "content": "w5"}], "seed": 2**70}, "seed must be <= 18446744073709551615"),
    ({"messages": [{"role": "user", "content": "w5"}], "stream": "false"}, "stream must be true or false"),
    ({"messages": [{"role": "user", "content": "w5"}], "stream_options": "yes"}, "stream_options must be an object"),
    ({"messages": [{"role": "user", "content": "w5"}], "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"messages": [{"role": "robot", "content": "w5"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_p": 0}, "top_p must be > 0"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_p": 1.5}, "top_p must be <= 1"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 100_000}, "over the model's context"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": "many"}, "max_tokens must be an integer"),
])
def test_bad_requests_get_400_with_one_line(running, body, said):
    r = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert said in message and "\n" not in message


def test_malformed_json_is_400(running):
    r = httpx.post(running.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_frees_its_slot(running):
    with httpx.stream("POST", running.url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "w9"}], "max_tokens": 2000, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    deadline = time.monotonic() + 30
    while running.server.scheduler.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.server.scheduler.load() == {"waiting": 0, "prefilling": 0, "running": 0}


def test_an_api_key_is_required_when_set():
    with Running(api_key=KEY) as r:
        with pytest.raises(openai.AuthenticationError):
            r.client(key="wrong").models.list()
        assert httpx.get(r.url + "/v1/models", timeout=10).status_code == 401
        assert [m.id for m in r.client(key=KEY).models.list().data] == ["tiny"]
        assert httpx.get(r.url + "/health", timeout=10).status_code == 200  # health needs no key


def test_overload_is_429_and_nothing_running_is_lost():
    with Running(max_batch=1, max_queue=0) as r:
        body = {"messages": [{"role": "user", "content": "w9"}], "max_tokens": 60, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: httpx.post(r.url + "/v1/chat/completions", json=body, timeout=120), range(4)))
        statuses = sorted(c.status_code for c in codes)
        assert 429 in statuses and 200 in statuses
        assert all(c.json()["choices"][0]["message"]["content"] for c in codes if c.status_code == 200)


@pytest.mark.e2e
def test_the_documented_command_serves_the_embedded_model(tmp_path):
    """``python -m infer.serve`` on the embedded default with its shipped heads, asked by the
    openai client: the answer is the library's default mode's, token for token."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), "--api-key", KEY],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 10 minutes"
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0,
                                             messages=[{"role": "user", "content": "Name three primary colors."}])
        import medusa

        engine = medusa.load()
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        alone = engine.tokenizer.decode(engine.generate(list(ids), max_new_tokens=32).tokens, skip_special_tokens=True)
        assert out.choices[0].message.content == alone
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert KEY not in log  # the key is never logged
