"""The server against requests that should not hurt anyone else, and the OpenAI fields clients rely
on: a request fails alone and before it queues, bodies are bounded, foreign pages are refused,
``stop`` ends answers where the stop string starts, and fields the server does not implement are
refused by name (a real server on 127.0.0.1, the real ``openai`` client and httpx)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from test_serve import QUESTIONS, Running

from medusa.serving.scheduler import Scheduler
from medusa.serving.server import loopback_hosts

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def running():
    with Running(max_body=64 * 1024) as r:
        yield r


def post(running, body, path=CHAT, **kw):
    return httpx.post(running.url + path, json=body, timeout=60, **kw)


def ask(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


def idle(running, within: float = 30) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if running.server.scheduler.load() == {"waiting": 0, "prefilling": 0, "running": 0}:
            return True
        time.sleep(0.05)
    return False


# -- one request cannot hurt the others -------------------------------------------------------
def test_a_request_whose_own_step_fails_ends_alone_and_the_others_finish(running):
    """A failure in one sequence's own work (its proposal here) ends that request with an error;
    the requests decoding beside it finish with the answers they get alone."""
    engine = running.engine
    sched = Scheduler(engine, max_batch=4).start()
    try:
        prompts = [engine.tokenizer(q)["input_ids"] for q in QUESTIONS[:3]]
        streams = [sched.submit(p, max_new_tokens=24, temperature=0) for p in prompts]

        def broken(cap=None):  # the request's drafting (a coroutine, as the batch drives it) raises
            raise RuntimeError("this request's proposer broke")
            yield

        streams[1].run.propose_steps = broken
        with pytest.raises(Exception, match="this request's proposer broke"):
            streams[1].wait()
        for i in (0, 2):
            assert streams[i].wait().tokens == engine.generate(prompts[i], max_new_tokens=24, temperature=0).tokens
    finally:
        sched.close(timeout=60)


def test_a_bad_seed_is_refused_before_it_queues_and_other_streams_go_on(running):
    """A seed outside torch's 64-bit range used to fail inside the shared step and end every
    stream beside it."""
    answers, errors = {}, []

    def victim(i):
        try:
            answers[i] = running.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=40,
                temperature=0).choices[0].message.content
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=victim, args=(i,)) for i in (0, 1)]
    [t.start() for t in threads]
    for _ in range(5):
        r = post(running, ask(QUESTIONS[2], seed=2**70, temperature=0.7, max_tokens=8))
        assert r.status_code == 400 and "seed must be <=" in r.json()["error"]["message"]
    [t.join(120) for t in threads]
    assert not errors and answers == {i: running.alone(QUESTIONS[i], 40) for i in (0, 1)}


def test_malformed_fields_are_refused_before_anything_is_queued(running):
    for body in (ask("w5", stream_options="x", stream=True), ask("w5", stream="false"), ask("w5", n=2)):
        assert post(running, body).status_code == 400
    assert idle(running, 0.5)  # nothing was queued to decode with nobody listening


@pytest.mark.parametrize("raw, said", [(b'{"messages": [{"role": "user", "content": "w5"}], "temperature": NaN}',
                                        "NaN is not a JSON number"),
                                       (b'{"messages": [{"role": "user", "content": "w5"}], "top_p": Infinity}',
                                        "Infinity is not a JSON number"),
                                       (b'{"messages": [{"role": "user", "content": "w5 \\ud800"}]}',
                                        "unpaired surrogate")])
def test_non_json_numbers_and_lone_surrogates_are_400_not_500(running, raw, said):
    r = httpx.post(running.url + CHAT, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and said in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_and_the_server_stays_responsive(running):
    big = ask("w5 " * 40_000)  # ~120 kB, over the fixture's 64 kB
    r = post(running, big)
    assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]
    chunked = httpx.post(running.url + CHAT, content=iter([b'{"messages": [', b" " * 70_000, b"]}"]),
                         headers={"content-type": "application/json"}, timeout=30)  # no Content-Length
    assert chunked.status_code == 413
    assert httpx.get(running.url + "/health", timeout=5).status_code == 200


def test_a_post_that_is_not_json_is_415():
    with Running() as r:
        got = httpx.post(r.url + CHAT, content=b'{"messages": [{"role": "user", "content": "w5"}]}',
                         headers={"content-type": "text/plain"}, timeout=30)
        assert got.status_code == 415 and "application/json" in got.json()["error"]["message"]


def test_without_a_key_foreign_hosts_and_origins_are_refused():
    """DNS rebinding and cross-site requests: a page the user visits must not drive a server
    on 127.0.0.1 that has no key."""
    with Running() as r:
        r.server.hosts = loopback_hosts("127.0.0.1", r.port)
        body = ask("w5", max_tokens=2)
        assert post(r, body).status_code == 200
        assert post(r, body, headers={"host": "evil.example"}).status_code == 403
        refused = post(r, body, headers={"origin": "http://evil.example"})
        assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]
        assert post(r, body, headers={"origin": f"http://localhost:{r.port}"}).status_code == 200
        r.server.api_key = "k"  # with a key, the key decides
        assert post(r, body, headers={"host": "evil.example", "authorization": "Bearer k"}).status_code == 200


# -- the fields clients rely on ----------------------------------------------------------------
def test_stop_strings_end_the_answer_where_they_start_streamed_or_not(running):
    full = running.alone(QUESTIONS[1], 24)
    words = full.split(" ")
    assert len(words) > 4
    stop = " ".join(words[2:4])  # a stop string spanning two tokens, so two chunks when streamed
    expected = full[: full.index(stop)]
    client = running.client()
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                         max_tokens=24, temperature=0, stop=[stop, "never-said"])
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                max_tokens=24, temperature=0, stop=stop, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == expected and reasons[-1] == "stop"
    text = client.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=24, temperature=0).choices[0].text
    cut = text.split(" ")[1]
    done = client.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=24, temperature=0, stop=cut)
    assert done.choices[0].text == text[: text.index(cut)] and done.choices[0].finish_reason == "stop"
    assert idle(running)  # the stopped requests freed their slots


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("response_format", {"type": "json_object"}), ("echo", True),
                                          ("frobnicate", 1)])
def test_fields_the_server_does_not_implement_are_refused_by_name(running, field, value):
    r = post(running, ask("w5", **{field: value}))
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith(f"{field}: not supported") and "\n" not in message
    assert r.json()["error"]["code"] == "unsupported_field"


def test_neutral_values_of_those_fields_are_accepted(running):
    r = post(running, ask("w5", max_tokens=4, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                          logprobs=False, response_format={"type": "text"}, user="someone", tools=[]))
    assert r.status_code == 200, r.text


def test_content_parts_and_a_null_assistant_turn_are_messages(running):
    plain = post(running, {"messages": [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": ""},
                                        {"role": "user", "content": "w9"}], "max_tokens": 12, "temperature": 0})
    parts = post(running, {"messages": [{"role": "user", "content": [{"type": "text", "text": "w7 "},
                                                                     {"type": "text", "text": "w8"}]},
                                        {"role": "assistant", "content": None},
                                        {"role": "user", "content": [{"type": "text", "text": "w9"}]}],
                           "max_tokens": 12, "temperature": 0})
    assert plain.status_code == parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_a_vanishing_temperature_is_greedy(running):
    tiny = post(running, ask(QUESTIONS[0], max_tokens=16, temperature=1e-40))
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["message"]["content"] == running.alone(QUESTIONS[0], 16)


def test_completions_take_token_ids_and_refuse_several_prompts(running):
    ids = running.engine.tokenizer(QUESTIONS[2])["input_ids"]
    by_ids = post(running, {"prompt": ids, "max_tokens": 8, "temperature": 0}, "/v1/completions")
    by_text = post(running, {"prompt": QUESTIONS[2], "max_tokens": 8, "temperature": 0}, "/v1/completions")
    assert by_ids.status_code == 200 and by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]
    several = post(running, {"prompt": ["w5", "w6"], "max_tokens": 8}, "/v1/completions")
    assert several.status_code == 400 and "one prompt a request" in several.json()["error"]["message"]
    out_of_vocab = post(running, {"prompt": [10**9], "max_tokens": 8}, "/v1/completions")
    assert out_of_vocab.status_code == 400 and "token ids must be in" in out_of_vocab.json()["error"]["message"]


def test_a_long_prompt_without_max_tokens_gets_what_the_context_has_left():
    with Running(window=40) as r:
        prompt = "w12 " * 30
        n = len(r.engine.tokenizer(prompt)["input_ids"])
        out = r.client().completions.create(model="tiny", prompt=prompt, temperature=0)
        assert out.usage.completion_tokens <= 40 - n and out.usage.prompt_tokens == n
        with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
            r.client().completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=20)


# -- speculation per request, and visible --------------------------------------------------------
def _speculated(running) -> tuple[str, dict]:
    """A prompt whose answer the default mode drafts into (a repeating one: lookup copies it)."""
    for q in QUESTIONS:
        r = post(running, ask(q, max_tokens=32))
        usage = r.json()["usage"]
        if usage["accepted_by_position"]:
            return q, r.json()
    raise AssertionError("no question had a drafted token accepted")


def test_a_request_can_cap_or_turn_off_its_speculation_and_its_answer_stays(running):
    q, default = _speculated(running)
    answer = default["choices"][0]["message"]["content"]
    assert answer == running.alone(q, 32) and default["usage"]["tokens_per_pass"] > 1
    off = post(running, ask(q, max_tokens=32, max_draft_tokens=0)).json()
    assert off["choices"][0]["message"]["content"] == answer
    assert off["usage"]["accepted_by_position"] == [] and off["usage"]["tokens_per_pass"] == 1.0
    one = post(running, ask(q, max_tokens=32, max_draft_tokens=1)).json()
    assert one["choices"][0]["message"]["content"] == answer and len(one["usage"]["accepted_by_position"]) <= 1
    assert post(running, ask(q, max_draft_tokens=-1)).status_code == 400


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from Prometheus' text format (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_what_the_requests_report():
    with Running() as r:
        usages = [post(r, ask(q, max_tokens=24)).json()["usage"] for q in QUESTIONS[:4]]
        assert idle(r)
        got = httpx.get(r.url + "/metrics", timeout=10)
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
        text = got.text
        assert metric(text, "medusa:request_success_total", finished_reason="length") + metric(
            text, "medusa:request_success_total", finished_reason="eos") == 4
        assert metric(text, "medusa:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert metric(text, "medusa:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        deepest = max(len(u["accepted_by_position"]) for u in usages)
        for position in range(1, deepest + 1):
            assert metric(text, "medusa:spec_decode_num_accepted_tokens_per_pos_total", position=position) == sum(
                u["accepted_by_position"][position - 1] for u in usages if len(u["accepted_by_position"]) >= position)
        accepted = metric(text, "medusa:spec_decode_num_accepted_tokens_total")
        assert accepted == sum(sum(u["accepted_by_position"]) for u in usages)
        assert metric(text, "medusa:spec_decode_num_draft_tokens_total") >= accepted
        assert metric(text, "medusa:num_requests_running") == 0
        assert metric(text, "medusa:time_to_first_token_seconds_count") == 4
        # every step counted once by batch size and drafting choice; one request at a time drafts as
        # alone: its first steps draft, then its own check may decode plainly (medusa/decoding/payoff.py)
        steps = metric(text, "medusa:step_time_seconds_count")
        drafting = metric(text, "medusa:scheduler_turns_total", batch=1, drafting="true")
        assert steps > 0 and drafting >= 4 * 4 and drafting + metric(
            text, "medusa:scheduler_turns_total", batch=1, drafting="false") == steps


# -- log-probabilities ---------------------------------------------------------------------------
def reference_logprobs(engine, prompt: list[int], answer: list[int]) -> list[float]:
    """Each answer token's log-probability from one plain forward pass over prompt + answer."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + answer])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    return logp.gather(1, torch.tensor(answer).view(-1, 1)).view(-1).tolist()


def test_chat_logprobs_are_the_target_s_streamed_or_not_and_with_or_without_speculation(running):
    q, _ = _speculated(running)
    body = ask(q, max_tokens=24, logprobs=True, top_logprobs=3)
    out = post(running, body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    tok = running.engine.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    answer = running.engine.generate(prompt, max_new_tokens=24, temperature=0).tokens
    assert [e["token"] for e in content] == [tok.decode([t]) for t in answer]
    assert [e["logprob"] for e in content] == pytest.approx(reference_logprobs(running.engine, prompt, answer), abs=1e-4)
    for e in content:  # greedy: the chosen token is the likeliest, listed first among its alternatives
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"], abs=1e-6)
        assert e["bytes"] == list(e["token"].encode())
    plain = post(running, {**body, "max_draft_tokens": 0}).json()["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in plain] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    streamed = []
    with httpx.stream("POST", running.url + CHAT, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_completion_logprobs_list_tokens_offsets_and_alternatives(running):
    out = post(running, {"prompt": QUESTIONS[2], "max_tokens": 8, "temperature": 0, "logprobs": 2},
               "/v1/completions").json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == out["usage"]["completion_tokens"]
    assert all(len(alt) <= 2 and max(alt.values()) == pytest.approx(v, abs=1e-6)
               for alt, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("extra, said", [({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be <= 20")])
def test_bad_logprob_requests_are_400(running, extra, said):
    r = post(running, ask("w5", **extra))
    assert r.status_code == 400 and said in r.json()["error"]["message"]


# -- the target's distribution adjusted ----------------------------------------------------------
def penalized_greedy(engine, prompt: list[int], n: int, presence=0.0, frequency=0.0, bias=None, min_tokens=0):
    """Plain greedy decoding, one full forward pass a token, with vLLM's penalties written out."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, -1].float()
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        for t, v in (bias or {}).items():
            logits[t] += v
        if len(out) < min_tokens:
            logits[list(engine.eos)] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
        if out[-1] in engine.eos:
            break
    return out


@pytest.mark.parametrize("mode", ["baseline", "lookup", None])
def test_penalties_choose_the_penalized_greedy_tokens_in_every_mode_alone_and_batched(running, mode):
    from medusa.decoding.penalties import Penalties

    engine = running.engine
    prompts = [engine.tokenizer(q)["input_ids"] for q in QUESTIONS[:3]]
    settings = [dict(presence=0.6, frequency=0.4), dict(frequency=1.5), dict(presence=-0.5, bias={7: 2.5})]
    sched = Scheduler(engine, max_batch=3).start()
    try:
        streams = [sched.submit(p, max_new_tokens=20, temperature=0, mode=mode,
                                penalties=Penalties(presence=s.get("presence", 0.0), frequency=s.get("frequency", 0.0),
                                                    bias=tuple((s.get("bias") or {}).items())))
                   for p, s in zip(prompts, settings)]
        got = [s.wait().tokens for s in streams]
    finally:
        sched.close(timeout=60)
    want = [penalized_greedy(engine, p, 20, **s) for p, s in zip(prompts, settings)]
    assert got == want
    assert got[1] != engine.generate(prompts[1], max_new_tokens=20, temperature=0).tokens  # the penalty mattered


def test_logit_bias_min_tokens_and_ignore_eos_through_the_server(running):
    eos = min(running.engine.eos)
    forced = post(running, ask(QUESTIONS[0], max_tokens=6, logit_bias={"9": 100}, logprobs=True)).json()
    assert [e["token"] for e in forced["choices"][0]["logprobs"]["content"]] == [running.engine.tokenizer.decode([9])] * 6
    held = post(running, ask(QUESTIONS[0], max_tokens=12, logit_bias={str(eos): 100}, min_tokens=5)).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    ignored = post(running, ask(QUESTIONS[0], max_tokens=7, logit_bias={str(eos): 100}, ignore_eos=True)).json()
    assert ignored["usage"]["completion_tokens"] == 7 and ignored["choices"][0]["finish_reason"] == "length"
    for bad, said in (({"logit_bias": {"x": 1}}, "is not a token id"), ({"logit_bias": {"5": 101}}, "<= 100"),
                      ({"presence_penalty": 3}, "presence_penalty must be <= 2"), ({"min_tokens": -1}, ">= 0")):
        r = post(running, ask("w5", **bad))
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
