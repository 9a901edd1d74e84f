"""A soak test for an OpenAI-compatible server on this machine (``python -m infer.load --soak N``).

N mixed requests from many clients at once, shuffled with a fixed seed: greedy, seeded sampled,
with ``stop`` strings and with ``logprobs`` (each checked against the same request sent alone
before the soak: the answer must be identical); streams cancelled mid-answer; malformed bodies
(each must get a 4xx naming the problem, never a 5xx); oversized bodies (413); and bursts beyond
the server's queue (429 is a right answer to those; the other requests retry a 429, as clients do,
and must then get their answer). Afterwards the server must be idle (``/health``
with nothing waiting or running: no orphaned work). The report counts requests and failures by
kind, the latency p50/p95 of the answered ones, and the server's memory when a pid is given.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from medusa.bench.loadgen import _percentile, check_loopback

# (kind, share of the requests); the rest of each kind's parameters are drawn per request
MIX = (("greedy", 0.30), ("sampled", 0.10), ("stop", 0.10), ("logprobs", 0.10), ("cancelled", 0.20),
       ("malformed", 0.10), ("burst", 0.07), ("oversized", 0.03))
MALFORMED = (  # raw bodies a careless or hostile client sends, each a 4xx
    b"{not json", b"[]", b'{"messages": []}', b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1180591620717411303424}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": "false"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": 7, "stream": true}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"messages": [{"role": "robot", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
)


@dataclass
class SoakReport:
    requests: int = 0
    by_kind: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # kind -> requests that got a wrong answer
    statuses: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # the first few failures, one line each
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests
    seconds: float = 0.0
    idle_after: bool = False
    memory_mb: dict = field(default_factory=dict)  # start, peak, end (the server's resident set)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "by_kind": dict(self.by_kind), "failures": dict(self.failures),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
                "examples": self.examples, "seconds": round(self.seconds, 1),
                "latency_p50": round(_percentile(self.latencies, 0.5), 3),
                "latency_p95": round(_percentile(self.latencies, 0.95), 3),
                "idle_after": self.idle_after, "memory_mb": self.memory_mb}

    def lines(self) -> list[str]:
        d = self.as_dict()
        out = [f"soak: {d['requests']} requests in {d['seconds']} s; failures: "
               + (", ".join(f"{k} {v}" for k, v in d["failures"].items()) or "none"),
               "  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(d["by_kind"].items())),
               "  statuses: " + ", ".join(f"{k}: {v}" for k, v in d["statuses"].items()),
               f"  latency p50 {d['latency_p50']} s, p95 {d['latency_p95']} s; idle afterwards: {d['idle_after']}"]
        if self.memory_mb:
            out.append("  server memory (MB): " + ", ".join(f"{k} {v}" for k, v in self.memory_mb.items()))
        out += [f"  {e}" for e in self.examples]
        return out

    @property
    def ok(self) -> bool:
        return not self.failures and self.idle_after


def rss_mb(pid: int) -> float:
    """A process's resident memory in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def plan(n: int, seed: int) -> list[str]:
    """The kinds of ``n`` requests in the order they go out: MIX's shares, shuffled."""
    kinds = [kind for kind, share in MIX for _ in range(round(share * n))]
    kinds = (kinds + ["greedy"] * n)[:n]
    random.Random(seed).shuffle(kinds)
    return kinds


class Soak:
    """One soak run against ``url``: ``prompts`` to draw from, ``max_tokens`` per answer."""

    def __init__(self, url: str, model: str, prompts: list[str], max_tokens: int = 16, max_body: int = 4 * 2**20,
                 pid: int | None = None, timeout: float = 300.0) -> None:
        check_loopback(url)
        self.url, self.model, self.prompts, self.max_tokens = url.rstrip("/"), model, prompts, max_tokens
        self.max_body, self.pid, self.timeout = max_body, pid, timeout
        self.report = SoakReport()
        self.lock = threading.Lock()
        self.references: dict[tuple, str] = {}

    # -- the requests ---------------------------------------------------------------------
    def body(self, kind: str, i: int) -> dict:
        prompt = self.prompts[i % len(self.prompts)]
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": self.max_tokens,
                "temperature": 0}
        if kind == "sampled":
            body.update(temperature=0.8, seed=i % 5)
        elif kind == "stop":
            body["stop"] = [self.stop_for(prompt)]
        elif kind == "logprobs":
            body.update(logprobs=True, top_logprobs=2)
        elif kind == "cancelled":
            body.update(max_tokens=4 * self.max_tokens, stream=True)
        return body

    def stop_for(self, prompt: str) -> str:
        """A stop string the greedy answer to ``prompt`` contains (its third word), or a space."""
        words = self.references.get(("greedy", prompt), "").split()
        return words[2] if len(words) > 2 else " "

    @staticmethod
    def key(body: dict) -> tuple:
        return (json.dumps(body["messages"]), body.get("temperature"), body.get("seed"), json.dumps(body.get("stop")),
                bool(body.get("logprobs")))

    def references_alone(self) -> None:
        """Each distinct checked request sent alone, one after another: the answers to match."""
        with httpx.Client(timeout=self.timeout) as client:
            for prompt in self.prompts:
                body = self.body("greedy", self.prompts.index(prompt))
                self.references[("greedy", prompt)] = self.post(client, body).json()["choices"][0]["message"]["content"]
            for kind in ("greedy", "sampled", "stop", "logprobs"):
                for i in range(len(self.prompts) * (5 if kind == "sampled" else 1)):
                    body = self.body(kind, i)
                    self.references[self.key(body)] = self.post(client, body).json()["choices"][0]["message"]["content"]

    def post(self, client: httpx.Client, body: dict | bytes, **headers) -> httpx.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return client.post(self.url + "/v1/chat/completions", content=raw,
                           headers={"content-type": "application/json", **headers})

    def one(self, kind: str, i: int) -> None:
        t0 = time.perf_counter()
        with httpx.Client(timeout=self.timeout) as client:
            if kind == "malformed":
                r = self.post(client, MALFORMED[i % len(MALFORMED)])
                self.check(kind, 400 <= r.status_code < 500, r, f"a malformed body got {r.status_code}")
            elif kind == "oversized":
                r = self.post(client, b'{"messages": [{"role": "user", "content": "' + b"x" * (self.max_body + 1) + b'"}]}')
                self.check(kind, r.status_code == 413, r, f"an oversized body got {r.status_code}")
            elif kind == "cancelled":
                with client.stream("POST", self.url + "/v1/chat/completions", json=self.body(kind, i)) as r:
                    if r.status_code == 200:
                        for n, _ in enumerate(r.iter_lines()):
                            if n >= 3:
                                break  # leave mid-answer: the server frees the slot
                    self.check(kind, r.status_code in (200, 429), r, f"a stream got {r.status_code}")
            else:
                body = self.body("greedy" if kind == "burst" else kind, i)
                r = self.post(client, body)
                while r.status_code == 429 and kind != "burst" and time.perf_counter() - t0 < self.timeout:
                    self.check(kind, True, r, "")  # overloaded by the bursts: retried, as clients do
                    time.sleep(0.1)
                    r = self.post(client, body)
                if r.status_code == 429 and kind == "burst":
                    self.check(kind, True, r, "")
                    return
                good = r.status_code == 200
                if good:
                    answer = r.json()["choices"][0]
                    good = answer["message"]["content"] == self.references[self.key(body)]
                    if kind == "logprobs":
                        content = (answer.get("logprobs") or {}).get("content") or []
                        good = good and len(content) == r.json()["usage"]["completion_tokens"]
                    with self.lock:
                        self.report.latencies.append(time.perf_counter() - t0)
                self.check(kind, good, r, f"{kind} request {i}: status {r.status_code}, not the answer it gets alone")

    def check(self, kind: str, good: bool, response: httpx.Response, said: str) -> None:
        with self.lock:
            self.report.statuses[response.status_code] += 1
            if not good:
                self.report.failures[kind] += 1
                if len(self.report.examples) < 5:
                    self.report.examples.append(said)

    # -- the run ------------------------------------------------------------------------------
    def run(self, n: int, clients: int = 16, seed: int = 0) -> SoakReport:
        self.references_alone()
        kinds = plan(n, seed)
        report, cursor, peak = self.report, [0], [0.0]
        report.requests, report.by_kind = n, Counter(kinds)
        if self.pid is not None:
            report.memory_mb["start"] = round(rss_mb(self.pid), 1)
        done = threading.Event()

        def watch_memory() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], rss_mb(self.pid))

        def worker() -> None:
            while True:
                with self.lock:
                    i = cursor[0]
                    cursor[0] += 1
                if i >= n:
                    return
                kind = kinds[i]
                try:
                    if kind == "burst":  # a burst: several at once beyond the queue, 429 allowed
                        burst = [threading.Thread(target=self.one, args=(kind, i + k)) for k in range(4)]
                        [t.start() for t in burst]
                        [t.join() for t in burst]
                    else:
                        self.one(kind, i)
                except httpx.HTTPError as exc:
                    with self.lock:
                        report.failures[kind] += 1
                        if len(report.examples) < 5:
                            report.examples.append(f"{kind} request {i}: {type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        if self.pid is not None:
            threads.append(threading.Thread(target=watch_memory))
        [t.start() for t in threads]
        [t.join() for t in threads[:clients]]
        report.seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 60  # cancelled streams free their slots at the next steps
        while time.monotonic() < deadline and not report.idle_after:
            health = httpx.get(self.url + "/health", timeout=10).json()
            report.idle_after = all(health.get(k, 0) == 0 for k in ("waiting", "prefilling", "running"))
            time.sleep(0.1)
        done.set()
        if self.pid is not None:
            report.memory_mb.update(peak=round(peak[0], 1), end=round(rss_mb(self.pid), 1))
        return report
