"""The bench's transformers peers as a user loads them: hf-float32 and hf-bfloat16 beside hf."""

import json
from types import SimpleNamespace

import pytest
import torch
from train_fixtures import tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from infer import bench
from medusa.bench.prompts import DEFAULT_PROMPTS, encode, read_prompts
from medusa.bench.runners import plain_targets
from medusa.bench.summary import against_fastest_peer


def test_hf_dtype_modes_run_generate_on_a_copy_loaded_as_transformers_loads_it(tmp_path, capsys):
    folder = tiny_target(tmp_path / "model")
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--dtype", "bfloat16", "--limit", "2", "--max-new-tokens", "10",
            "--modes", "hf,hf-float32,hf-bfloat16,baseline", "--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    speed = {m: modes[m]["tokens_per_second"] for m in modes}
    fastest = max(("hf", "hf-float32", "hf-bfloat16"), key=speed.get)
    line = f"fastest transformers generate here: {fastest} ({speed[fastest]:.1f} tokens/s); " \
           f"baseline {speed['baseline'] / speed[fastest]:.2f}x"
    assert line in capsys.readouterr().out and result["meta"]["fastest_transformers"] == line
    assert result["meta"]["dtype"] == "torch.bfloat16"  # the engine (and hf) in bfloat16, the peers in their own
    assert modes["baseline"]["identical"] == 2  # the engine's promise holds against hf, on the engine's target
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = read_prompts(DEFAULT_PROMPTS, limit=2)
    for dtype in ("float32", "bfloat16"):
        # what a user runs for transformers alone: that dtype, transformers' default attention
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        assert plain.config._attn_implementation == "sdpa"
        config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=[tok.eos_token_id],
                                  pad_token_id=tok.pad_token_id)
        for prompt, run in zip(prompts, modes[f"hf-{dtype}"]["per_prompt"], strict=True):
            ids = torch.tensor([encode(SimpleNamespace(tokenizer=tok), prompt.text)])
            with torch.inference_mode():
                want = plain.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, ids.shape[1]:]
            assert run["tokens"] == want.tolist(), dtype
        assert modes[f"hf-{dtype}"]["tokens_per_second"] > 0


def test_hf_dtype_modes_need_nothing_else_and_unknown_dtypes_are_unknown_modes(tmp_path, capsys):
    folder = tiny_target(tmp_path / "model")
    assert bench.main(["--model", str(folder), "--limit", "1", "--max-new-tokens", "4", "--modes", "hf-float32"]) == 0
    assert "hf-float32" in capsys.readouterr().out
    assert bench.main(["--model", str(folder), "--limit", "1", "--modes", "hf-float16"]) == 1
    err = capsys.readouterr().err
    assert "unknown mode(s) hf-float16" in err and "hf-float32" in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_targets_load_only_the_copies_asked_for(tmp_path, dtype):
    folder = tiny_target(tmp_path / "model")
    copies = plain_targets(["hf", f"hf-{dtype}"], SimpleNamespace(model=str(folder)), torch.device("cpu"))
    assert list(copies) == [dtype] and copies[dtype].dtype == getattr(torch, dtype)
    assert plain_targets(["hf", "baseline"], SimpleNamespace(model=str(folder)), torch.device("cpu")) == {}


def test_the_fastest_transformers_peer_is_named_with_every_other_mode_against_it():
    summary = {"hf": {"tokens_per_second": 10.0}, "hf-float32": {"tokens_per_second": 16.0},
               "baseline": {"tokens_per_second": 12.0}, "hybrid@eagle": {"tokens_per_second": 24.0}}
    assert against_fastest_peer(summary) == ("fastest transformers generate here: hf-float32 (16.0 tokens/s); "
                                             "baseline 0.75x, hybrid@eagle 1.50x")
    assert against_fastest_peer({"hf": {"tokens_per_second": 10.0}, "baseline": {"tokens_per_second": 12.0}}) is None


def test_each_prompt_runs_the_modes_starting_one_further():
    from medusa.bench.timing import rotated

    modes = ["hf", "baseline", "hybrid"]
    orders = [rotated(modes, i) for i in range(4)]
    assert orders == [["hf", "baseline", "hybrid"], ["baseline", "hybrid", "hf"], ["hybrid", "hf", "baseline"],
                      ["hf", "baseline", "hybrid"]]
    assert all(sorted(o) == sorted(modes) for o in orders)  # every mode once a prompt
    assert rotated([], 3) == []
