"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Speculation is counted under vLLM's spec-decode names with this server's prefix, so dashboards
built for vLLM read it: ``medusa:spec_decode_num_drafts`` (steps that verified a draft),
``..._num_draft_tokens`` (drafted tokens verified), ``..._num_accepted_tokens`` (drafted tokens
kept) and ``..._num_accepted_tokens_per_pos`` (kept at each draft position, label ``position``).
Beside them: requests by how they ended, the queue, the batch, the scheduler's turns by batch
size and whether it let greedy sequences draft (``medusa:scheduler_turns``, labels ``batch``,
``drafting``), and histograms of the time to the first token, the prefill and the batched step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "medusa:"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_POSITIONS = 16  # draft positions counted one by one (deeper ones count at the last)


class Metrics:
    """One server's metrics, in a registry of their own (two servers in one process, as in the
    tests, do not share counts). The scheduler thread records; ``/metrics`` renders."""

    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Sequence steps that verified drafted tokens")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.per_position = counter("spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted at each "
                                    "draft position (1 = the first drafted token)", ["position"])
        self.generated = counter("generation_tokens", "Tokens generated")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.finished = counter("request_success", "Requests finished, by finish reason", ["finished_reason"])
        self.turns = counter("scheduler_turns", "Batched steps by batch size and whether greedy sequences drafted "
                             "(the scheduler's choice at that batch size)", ["batch", "drafting"])
        self.failed = counter("request_failure", "Requests that ended with an error")
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued", [*labels], registry=registry)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests prefilling or decoding", [*labels],
                             registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, [*labels], buckets=buckets, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival to its first token", SECONDS)
        self.prefill = histogram("request_prefill_time_seconds", "A request's prefill, all its chunks", SECONDS)
        self.step = histogram("step_time_seconds", "One batched step: drafting, the packed pass, the updates", SECONDS)
        self.batch = histogram("batch_size", "Sequences in a batched step", (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.labels = labels

    # -- recorded by the scheduler thread ------------------------------------------------
    def step_done(self, batch: int, seconds: float, drafted: list[int], kept: list[int], emitted: int,
                  drafting: bool = True) -> None:
        """One batched step: ``drafted``/``kept`` drafted tokens verified and accepted per sequence;
        ``drafting``: whether the scheduler let its greedy sequences draft."""
        name = self.labels["model_name"]
        self.step.labels(name).observe(seconds)
        self.turns.labels(name, str(batch), "true" if drafting else "false").inc()
        self.batch.labels(name).observe(batch)
        self.generated.labels(name).inc(emitted)
        for d, k in zip(drafted, kept):
            if d <= 0:
                continue
            self.drafts.labels(name).inc()
            self.draft_tokens.labels(name).inc(d)
            self.accepted.labels(name).inc(k)
            for position in range(1, k + 1):
                self.per_position.labels(name, str(min(position, MAX_POSITIONS))).inc()

    def first_token(self, waited: float, prefill: float, prompt: int, emitted: int) -> None:
        """A prefill's end: its first token (``emitted``: 1, or 0 when nothing may be emitted)."""
        name = self.labels["model_name"]
        self.generated.labels(name).inc(emitted)
        self.ttft.labels(name).observe(waited)
        self.prefill.labels(name).observe(prefill)
        self.prompt_tokens.labels(name).inc(prompt)

    def ended(self, reason: str | None) -> None:
        name = self.labels["model_name"]
        if reason is None:
            self.failed.labels(name).inc()
        else:
            self.finished.labels(name, reason).inc()

    def queue(self, waiting: int, running: int) -> None:
        name = self.labels["model_name"]
        self.waiting.labels(name).set(waiting)
        self.running.labels(name).set(running)

    # -- read by /metrics ---------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
