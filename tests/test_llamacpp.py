"""llama.cpp as a bench peer: modes llamacpp and llamacpp-lookup beside hf on the embedded model.

Builds the llama.cpp venv on first use (``~/.cache/medusa/llamacpp-venv``: llama-cpp-python
compiles llama.cpp, about 7 minutes on 2 cores, then reused) and the F32 GGUF copy of the
embedded SmolLM2-135M, then runs ``python -m infer.bench --modes hf,llamacpp,llamacpp-lookup``
on 3 MT-Bench prompts x 32 tokens. llama.cpp is not exact (its kernels sum in another order):
the test asserts that the comparison with ``hf`` is made and reported, and that plain llama.cpp
matches ``hf`` on the first prompt, where it does on the machines it was run on.
"""

from __future__ import annotations

import json

import pytest

from infer import bench
from medusa.errors import MedusaError
from medusa.peers.llamacpp_client import llamacpp_python

pytestmark = pytest.mark.peers


def test_bench_runs_llama_cpp_plain_and_lookup_beside_hf_and_compares_tokens(tmp_path, capsys):
    try:
        llamacpp_python()
    except MedusaError as err:
        pytest.fail(f"llama-cpp-python could not be installed on this machine: {err}", pytrace=False)
    out = tmp_path / "bench.json"
    rc = bench.main(["--modes", "hf,llamacpp,llamacpp-lookup", "--limit", "3", "--max-new-tokens", "32",
                     "--heads", "init", "--autotune", "off", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    modes = json.loads(out.read_text())["modes"]
    hf = modes["hf"]["per_prompt"]
    for name in ("llamacpp", "llamacpp-lookup"):
        row = modes[name]
        assert f"| {name} | {row['tokens_per_second']:.1f} |" in table
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
        assert row["prompts"] == 3 and row["identical"] is not None  # compared with hf, prompt by prompt
        assert row["identical"] == sum(r["tokens"] == h["tokens"] for r, h in zip(row["per_prompt"], hf))
        for run in row["per_prompt"]:
            # 32 tokens, or fewer ending with SmolLM2's end-of-turn token (kept, as generate keeps it)
            assert len(run["tokens"]) == 32 or (len(run["tokens"]) < 32 and run["tokens"][-1] == 2)
            assert run["steps"] is not None and 1 <= run["steps"] <= len(run["tokens"])
            assert 0 < run["first_seconds"] < run["seconds"]  # the first token came before the last
        assert row["decode_tokens_per_second"] > 0
    # Plain decoding: one target pass per token; the lookup drafts were accepted some of the time.
    assert modes["llamacpp"]["tau"] == 1.0
    assert modes["llamacpp-lookup"]["tau"] > 1.0
    # Identical where llama.cpp's float32 arithmetic lands on the same greedy tokens: prompt 1.
    assert modes["llamacpp"]["per_prompt"][0]["tokens"] == hf[0]["tokens"]



def test_a_prompt_longer_than_the_first_context_restarts_the_worker_larger(tmp_path):
    """The workers start with room for MT-Bench's prompts; a longer prompt (ShareGPT turns run to
    thousands of tokens) starts a worker with a context that holds it, the answer and the
    drafts a last verification can run past the answer's end, instead of failing the run."""
    long_turn = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(160))  # ~2,300 tokens
    prompts = tmp_path / "long.json"
    prompts.write_text(json.dumps([{"id": "long", "conversations": [{"from": "human", "value": long_turn}]},
                                   {"id": "short", "conversations": [{"from": "human", "value": "Say hi."}]}]))
    out = tmp_path / "bench.json"
    rc = bench.main(["--prompts", str(prompts), "--modes", "baseline,llamacpp,llamacpp-lookup", "--max-new-tokens",
                     "16", "--heads", "init", "--autotune", "off", "--json", str(out)])
    assert rc == 0
    modes = json.loads(out.read_text())["modes"]
    for name in ("llamacpp", "llamacpp-lookup"):
        assert [len(r["tokens"]) > 0 for r in modes[name]["per_prompt"]] == [True, True]
