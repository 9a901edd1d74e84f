"""A load generator for OpenAI-compatible servers: this project's, llama.cpp's ``llama-server``
and vLLM's all speak ``/v1/chat/completions``, so one client measures them the same way.

``run_load`` sends every prompt once at a given concurrency (each worker takes the next prompt
when its answer ends), streaming, greedy, and measures total tokens per second, time to first
token and the gaps between streamed chunks' tokens (inter-token latency, p50/p95), plus the
answers themselves so that runs at different concurrencies can be checked token for token.
Only loopback addresses are targets.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx

from medusa.errors import MedusaError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Answer:
    text: str = ""
    tokens: int = 0  # completion tokens (the server's usage, else streamed chunks)
    ttft: float = 0.0  # seconds to the first content
    gaps: list[float] = field(default_factory=list)  # seconds per token between chunks
    tau: float | None = None  # tokens per target pass, where the server reports it
    seconds: float = 0.0


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    tokens_per_second: float
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    tau: float | None
    texts: list[str]

    def row(self) -> dict:
        out = asdict(self)
        out.pop("texts")
        return out


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK and not (host or "").startswith("127."):
        raise MedusaError(f"{url} is not a loopback address: the load generator only targets this machine")


def ask(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Answer:
    """One streamed greedy chat completion, timed chunk by chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    answer, pieces, chunks = Answer(), [], 0
    t0 = last = time.perf_counter()
    with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise MedusaError(f"{url} answered {r.status_code}: {r.read().decode(errors='replace')[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage")
            if usage:
                answer.tokens = usage.get("completion_tokens", 0)
                answer.tau = usage.get("tokens_per_pass")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if not piece:
                    continue
                now = time.perf_counter()
                if not pieces:
                    answer.ttft = now - t0
                else:
                    answer.gaps.append(now - last)
                last = now
                pieces.append(piece)
                chunks += 1
    answer.seconds = time.perf_counter() - t0
    answer.text = "".join(pieces)
    answer.tokens = answer.tokens or chunks
    if answer.gaps and answer.tokens > chunks:  # several tokens per chunk: a gap's time per token
        per = (answer.tokens - 1) / max(len(answer.gaps), 1)
        answer.gaps = [g / per for g in answer.gaps]
    return answer


def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
             timeout: float = 600.0) -> LoadResult:
    """Every prompt once, ``concurrency`` at a time; answers in prompt order."""
    check_loopback(url)
    answers: list[Answer | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    lock, cursor = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(prompts) or errors:
                return
            try:
                # a connection per request: a server closing an idle keep-alive connection as the
                # next request goes out on it would read as a failed request
                with httpx.Client() as client:
                    answers[i] = ask(client, url, model, prompts[i], max_tokens, timeout)
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    seconds = time.perf_counter() - t0
    if errors:
        raise MedusaError(f"a request to {url} failed: {errors[0]}")
    done = [a for a in answers if a is not None]
    tokens = sum(a.tokens for a in done)
    ttft = [a.ttft for a in done]
    gaps = [g for a in done for g in a.gaps]
    taus = [a.tau for a in done if a.tau]
    return LoadResult(concurrency=concurrency, requests=len(done), seconds=seconds, tokens=tokens,
                      tokens_per_second=tokens / seconds, ttft_p50=_percentile(ttft, 0.5), ttft_p95=_percentile(ttft, 0.95),
                      itl_p50=_percentile(gaps, 0.5), itl_p95=_percentile(gaps, 0.95),
                      tau=statistics.fmean(taus) if taus else None, texts=[a.text for a in done])


def wait_ready(url: str, seconds: float = 900.0, proc=None) -> None:
    """Until ``url``'s ``/health`` answers 200 (both llama-server and vLLM have it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise MedusaError(f"the server for {url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise MedusaError(f"{url} was not ready after {seconds:.0f} s")


def interference(url: str, model: str, prompts: list[str], long_prompt: str, max_tokens: int,
                 streams: int = 3, warm: int = 8, timeout: float = 600.0) -> dict:
    """What a long prompt arriving does to running streams: ``streams`` answers start; once each
    has streamed ``warm`` tokens, ``long_prompt`` is sent; the streams keep going (an answer of at
    most ``max_tokens`` that ends is followed by the next prompt's) until its first token comes
    back, then disconnect. Returns the streams' inter-token latency p95 before it arrived (steady)
    and from its arrival to its first token (while it prefills), in seconds per token, their
    ratio, and how many gaps each side had (a gap that overlaps the prefill counts as during it)."""
    check_loopback(url)
    marks: list[list[tuple[float, float]]] = [[] for _ in range(streams)]  # (time, seconds per token)
    arrival, first = [0.0], [0.0]
    over = threading.Event()

    def stream(i: int) -> None:
        for n in itertools.count():  # an answer that ends is followed by the next prompt's
            body = {"model": model, "messages": [{"role": "user", "content": prompts[(i + n * streams) % len(prompts)]}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True}
            last = None
            with httpx.Client() as client, client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body,
                                                         timeout=timeout) as r:
                for line in r.iter_lines():
                    if over.is_set():
                        return  # leaving frees the slot
                    if line.startswith("data: {") and _has_content(line):
                        now = time.perf_counter()
                        if last is not None:
                            marks[i].append((now, now - last))
                        last = now
            if over.is_set():
                return

    def long() -> None:
        deadline = time.monotonic() + timeout
        while any(len(m) < warm for m in marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        arrival[0] = time.perf_counter()
        try:
            with httpx.Client() as client:
                a = ask(client, url, model, long_prompt, 8, timeout)
            first[0] = arrival[0] + a.ttft
        finally:
            over.set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)] + [threading.Thread(target=long)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    steady = [g for m in marks for t, g in m if t < arrival[0]]
    # every gap that overlaps the prefill, the one it ends with included (a server that pauses the
    # streams for the whole prefill shows one gap as long as the prefill, ending after it)
    during = [g for m in marks for t, g in m if t >= arrival[0] and t - g <= first[0] + 1e-3]
    p_steady, p_during = _percentile(steady, 0.95), _percentile(during, 0.95)
    return {"steady_itl_p95": p_steady, "during_prefill_itl_p95": p_during, "ratio": p_during / max(p_steady, 1e-9),
            "prefill_seconds": first[0] - arrival[0], "steady_gaps": len(steady), "during_gaps": len(during)}


def _has_content(line: str) -> bool:
    """Whether a streamed chunk carries text (servers differ in their JSON spacing)."""
    try:
        event = json.loads(line[6:])
    except json.JSONDecodeError:
        return False
    return any((c.get("delta") or {}).get("content") for c in event.get("choices") or [])


def combine(results: list[LoadResult]) -> LoadResult:
    """One server's rounds at one concurrency as one result: tokens over seconds summed, the
    latency percentiles and tau averaged over rounds, the first round's answers."""
    n = len(results)
    tokens, seconds = sum(r.tokens for r in results), sum(r.seconds for r in results)
    taus = [r.tau for r in results if r.tau is not None]
    return LoadResult(concurrency=results[0].concurrency, requests=sum(r.requests for r in results), seconds=seconds,
                      tokens=tokens, tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                      ttft_p50=sum(r.ttft_p50 for r in results) / n, ttft_p95=sum(r.ttft_p95 for r in results) / n,
                      itl_p50=sum(r.itl_p50 for r in results) / n, itl_p95=sum(r.itl_p95 for r in results) / n,
                      tau=sum(taus) / len(taus) if taus else None, texts=results[0].texts)


def versus(rows: list[dict]) -> list[str]:
    """One line per concurrency: the first server's total tokens per second against every other
    server's at that concurrency, as ratios (the numbers the goals are stated in)."""
    rows = [r for r in rows if "concurrency" in r]
    if not rows:
        return []
    first = rows[0]["server"]
    lines = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        speed = {r["server"]: r["tokens_per_second"] for r in rows if r["concurrency"] == c}
        if first not in speed:
            continue
        others = [f"{speed[first] / v:.2f}x {s}" for s, v in speed.items() if s != first and v > 0]
        lines.append(f"c={c}: {first} {speed[first]:.1f} tok/s" + (" = " + ", ".join(others) if others else ""))
    return lines
