"""``python -m infer.load``: the load generator against a real server, the started servers'
shutdown, and vLLM's CPU server as a peer (slow tier: real vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from test_serve import QUESTIONS, Running, free_port

from infer import load
from medusa.bench import servers
from medusa.bench.loadgen import run_load
from medusa.errors import MedusaError
from medusa.peers import vllm_server


@pytest.fixture(scope="module")
def running():
    with Running(max_batch=4, window=2048) as r:  # room for a prompt of several prefill chunks
        yield r


def test_run_load_gets_each_answer_as_decoded_alone_at_every_concurrency(running):
    prompts = QUESTIONS[:4]
    alone = [running.alone(p, 16) for p in prompts]
    for concurrency in (1, 3):
        result = run_load(running.url, "tiny", prompts, concurrency, 16)
        assert result.texts == alone, concurrency
        assert result.requests == 4 and result.tokens > 0 and result.tokens_per_second > 0
        assert result.tau is not None and result.tau >= 1.0  # our server reports tokens per pass
        assert 0 <= result.itl_p50 <= result.itl_p95 and 0 < result.ttft_p50 <= result.ttft_p95


def test_the_command_line_compares_answers_across_concurrencies(running, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in QUESTIONS[:3]))
    out = tmp_path / "load.json"
    rc = load.main(["--servers", f"url={running.url}", "--model-name", "tiny", "--prompts", str(prompts),
                    "--concurrency", "1,2", "--max-tokens", "8", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert report["answers"][f"url={running.url} c=1"] == [running.alone(q, 8) for q in QUESTIONS[:3]]
    assert all(r["same_as_c1"] == 3 and r["requests"] == 3 for r in rows)
    assert "identical to its c=1: 3/3" in capsys.readouterr().out


def test_rounds_run_each_level_again_and_sum_them(running, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in QUESTIONS[:3]))
    out = tmp_path / "load.json"
    rc = load.main(["--servers", f"url={running.url}", "--model-name", "tiny", "--prompts", str(prompts),
                    "--concurrency", "1,2", "--max-tokens", "8", "--rounds", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["rounds"], r["requests"]) for r in rows] == [(1, 2, 6), (2, 2, 6)]
    assert all(r["same_every_round"] == 3 and r["same_as_c1"] == 3 for r in rows)
    printed = capsys.readouterr().out
    assert printed.count("round 1:") == 2 and printed.count("round 2:") == 2
    assert load.main(["--servers", f"url={running.url}", "--rounds", "0"]) == 2
    assert load.main(["--servers", f"url={running.url}", "--rounds", "2", "--soak", "4"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_rounds_combine_as_tokens_over_seconds():
    from medusa.bench.loadgen import LoadResult, combine

    a = LoadResult(2, 4, 2.0, 100, 50.0, 0.1, 0.2, 0.01, 0.03, 2.0, ["x"])
    b = LoadResult(2, 4, 3.0, 50, 16.7, 0.3, 0.4, 0.03, 0.05, None, ["y"])
    both = combine([a, b])
    assert both.tokens_per_second == pytest.approx(150 / 5.0) and both.requests == 8 and both.tokens == 150
    assert both.ttft_p50 == pytest.approx(0.2) and both.itl_p95 == pytest.approx(0.04) and both.tau == 2.0
    assert both.texts == ["x"]


def test_bad_servers_and_prompts_are_one_line_errors(tmp_path, capsys):
    assert load.main(["--servers", "tgi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown server 'tgi'" in err and "vllm-ngram" in err and "\n" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert load.main(["--prompts", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read prompts" in err and "\n" not in err
    with pytest.raises(MedusaError, match="not a loopback address"):
        run_load("http://10.1.2.3:80", "m", ["hi"], 1, 4)


def test_stopping_a_started_server_ends_the_processes_it_started(tmp_path):
    """vLLM's server runs its engine in child processes: ``stop`` ends the whole group, even
    a child that ignores SIGTERM."""
    pids = tmp_path / "pids"
    script = ("import os, signal, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
              f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pids.read_text())
    servers.stop(proc)
    assert proc.poll() is not None
    assert ended(child, within=30), f"process {child} still runs after stop"


def ended(pid: int, within: float) -> bool:
    """Whether ``pid`` is gone within ``within`` seconds. A killed orphan stays a zombie ('Z' in
    /proc/PID/stat) until init reaps it, which may take a moment on a busy machine: that counts
    as ended, since it runs nothing."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_vllm_servers_run_on_loopback_in_float32_and_ngram_speculates():
    plain = vllm_server.server_command("/venv/bin/python", "/m", 8000, 8, "SmolLM2")
    assert plain[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(plain[3::2], plain[4::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--dtype"] == "float32" and flags["--max-num-seqs"] == "8"
    assert flags["--served-model-name"] == "SmolLM2" and "--speculative-config" not in plain
    ngram = vllm_server.server_command("/venv/bin/python", "/m", 8000, 8, "SmolLM2", ngram=True)
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] > 0


@pytest.mark.peers
def test_vllm_cpu_server_answers_like_the_engine_at_every_concurrency(tmp_path):
    """vLLM's own server with its ngram speculation, started by ``infer.load`` on the embedded
    model: its greedy answers at 1 and 2 streams are the engine's, decoded alone."""
    from medusa.peers.vllm_client import vllm_python

    try:
        vllm_python()
    except MedusaError as err:
        pytest.fail(f"vLLM could not be installed on this machine, so its server is unchecked: {err}", pytrace=False)
    import medusa

    questions = ["Name three primary colors.", "Write a haiku about the sea."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in questions))
    out = tmp_path / "load.json"
    assert load.main(["--servers", "vllm-ngram", "--prompts", str(prompts), "--concurrency", "1,2",
                      "--max-tokens", "16", "--port", str(free_port()), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["server"], r["concurrency"]) for r in rows] == [("vllm-ngram", 1), ("vllm-ngram", 2)]
    assert all(r["same_as_c1"] == 2 and r["tokens"] > 0 for r in rows)
    engine = medusa.load()
    tok = engine.tokenizer
    alone = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        alone.append(tok.decode(engine.generate(list(ids), max_new_tokens=16).tokens, skip_special_tokens=True))
    assert report["answers"]["vllm-ngram c=1"] == alone


def test_versus_puts_the_first_server_against_each_other_at_each_concurrency():
    from medusa.bench.loadgen import versus

    rows = [{"server": "a", "concurrency": 1, "tokens_per_second": 30.0},
            {"server": "a", "concurrency": 4, "tokens_per_second": 60.0},
            {"server": "a", "long_prompt_words": 10, "ratio": 2.0},
            {"server": "b", "concurrency": 1, "tokens_per_second": 20.0},
            {"server": "b", "concurrency": 4, "tokens_per_second": 80.0}]
    assert versus(rows) == ["c=1: a 30.0 tok/s = 1.50x b", "c=4: a 60.0 tok/s = 0.75x b"]
    assert versus(rows[:1]) == ["c=1: a 30.0 tok/s"] and versus([]) == []


def test_the_plot_takes_the_rows_a_long_prompt_run_adds(tmp_path):
    rows = [{"server": "a", "concurrency": 1, "tokens_per_second": 30.0},
            {"server": "a", "concurrency": 2, "tokens_per_second": 50.0},
            {"server": "a", "long_prompt_words": 1500, "ratio": 2.0}]
    load.plot(rows, str(tmp_path / "load.png"))
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_long_prompt_is_sent_once_the_streams_run_and_they_run_through_its_prefill(running):
    from medusa.bench.loadgen import interference

    # a prompt of several prefill chunks (256 tokens each), so the streams run steps between them
    # and answers long enough that no stream is between two answers (not yet streaming) meanwhile
    hit = interference(running.url, "tiny", QUESTIONS[:3], "w5 " * 900, 64, warm=4)
    assert hit["steady_gaps"] >= 3 * 4  # every stream had streamed before the long prompt went out
    assert hit["during_gaps"] > 0 and hit["prefill_seconds"] > 0 and hit["ratio"] > 0
    deadline = time.monotonic() + 30  # the streams disconnected: their slots free at the next steps
    while running.server.scheduler.load() != {"waiting": 0, "prefilling": 0, "running": 0}:
        assert time.monotonic() < deadline, running.server.scheduler.load()
        time.sleep(0.05)
