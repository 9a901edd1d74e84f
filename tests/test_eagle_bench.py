"""The bench runs Medusa and EAGLE heads side by side on one loaded target."""

import json

from train_fixtures import tiny_target
from transformers import AutoModelForCausalLM

from infer import bench
from medusa.models.eagle_heads import init_eagle_for
from medusa.models.heads_config import save_heads
from medusa.models.loader import init_heads_for


def test_bench_runs_medusa_and_eagle_heads_in_one_run(tmp_path, capsys):
    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    eagle = save_heads(init_eagle_for(model), tmp_path / "eagle")
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--heads", "init", "--eagle-heads", str(eagle), "--limit", "2",
            "--max-new-tokens", "10", "--modes", "hf,medusa,eagle,hybrid@eagle", "--json", str(out)]
    assert bench.main(args) == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"hf", "medusa", "eagle", "hybrid@eagle"}
    ref = [p["tokens"] for p in modes["hf"]["per_prompt"]]
    for name in ("medusa", "eagle", "hybrid@eagle"):
        assert modes[name]["identical"] == 2 and [p["tokens"] for p in modes[name]["per_prompt"]] == ref, name


def test_bench_runs_eagle3_heads_beside_eagle_heads(tmp_path):
    from medusa.models.eagle3_heads import init_eagle3_for

    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    eagle = save_heads(init_eagle_for(model), tmp_path / "eagle")
    eagle3 = save_heads(init_eagle3_for(model, 4, vocab=list(range(0, model.config.vocab_size, 2))), tmp_path / "eagle3")
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--eagle-heads", str(eagle), "--eagle3-heads", str(eagle3), "--limit", "2",
            "--max-new-tokens", "10", "--modes", "hf,eagle,eagle3,hybrid@eagle3", "--json", str(out)]
    assert bench.main(args) == 0
    modes = json.loads(out.read_text())["modes"]
    ref = [p["tokens"] for p in modes["hf"]["per_prompt"]]
    for name in ("eagle", "eagle3", "hybrid@eagle3"):
        assert modes[name]["identical"] == 2 and [p["tokens"] for p in modes[name]["per_prompt"]] == ref, name


def test_bench_eagle_modes_refuse_medusa_heads_as_eagle_heads(tmp_path, capsys):
    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    medusa_heads = save_heads(init_heads_for(model), tmp_path / "medusa")
    args = ["--model", str(folder), "--eagle-heads", str(medusa_heads), "--limit", "1", "--modes", "hf,eagle"]
    assert bench.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --eagle-heads") and "holds medusa heads" in err


def test_bench_tree_goes_to_medusa_modes_only(tmp_path, capsys):
    # --tree shapes the Medusa heads' static tree; the eagle engine beside it grows its own
    # tree (the bench used to hand it --tree, silently ignored), and --tree without a mode
    # that uses it is an error
    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    eagle = save_heads(init_eagle_for(model), tmp_path / "eagle")
    out = tmp_path / "bench.json"
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0], [0, 0], [1]]))
    common = ["--model", str(folder), "--eagle-heads", str(eagle), "--limit", "1", "--max-new-tokens", "8",
              "--tree", str(tree)]
    assert bench.main(common + ["--heads", "init", "--modes", "hf,medusa,eagle", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["tree_nodes"] == 4
    assert result["modes"]["medusa"]["identical"] == 1 and result["modes"]["eagle"]["identical"] == 1
    capsys.readouterr()
    assert bench.main(common + ["--modes", "hf,eagle"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --tree shapes the static tree of Medusa heads") and err.endswith("drop --tree")


def test_bench_eagle_heads_given_win_over_the_eagle_heads_loaded(tmp_path):
    # --eagle-heads B beside eagle heads A as --heads: the eagle modes run B, with B's
    # calibrated tree (they once ran A's, silently)
    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    a = save_heads(init_eagle_for(model), tmp_path / "a")
    b = save_heads(init_eagle_for(model), tmp_path / "b")
    (b / "calibration.json").write_text(json.dumps({"dynamic": {"cpu": {"nodes": 6, "depth": 3, "topk": 3}}}))
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--heads", str(a), "--eagle-heads", str(b), "--limit", "1",
            "--max-new-tokens", "8", "--modes", "baseline,eagle", "--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["eagle_tree_nodes"] == 7 and result["meta"]["tree_nodes"] != 7
    assert result["modes"]["eagle"]["identical_baseline"] == 1


def test_bench_runs_every_mode_at_several_temperatures_in_one_run(tmp_path, capsys):
    from medusa.models.eagle3_heads import init_eagle3_for

    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    eagle3 = save_heads(init_eagle3_for(model, 3), tmp_path / "eagle3")
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--heads", str(eagle3), "--limit", "2", "--max-new-tokens", "8", "--seed", "0",
            "--modes", "baseline,eagle3,hybrid", "--temperature", "0,0.7,1", "--autotune", "off", "--json", str(out)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "temperature 0.7" in printed and "T=1 tok/s (x baseline, tau)" in printed
    by_t = json.loads(out.read_text())["temperatures"]
    assert list(by_t) == ["0", "0.7", "1"] and all(set(s) == {"baseline", "eagle3", "hybrid"} for s in by_t.values())
    greedy = [p["tokens"] for p in by_t["0"]["baseline"]["per_prompt"]]
    assert all([p["tokens"] for p in by_t["0"][m]["per_prompt"]] == greedy for m in ("eagle3", "hybrid"))
    # seeded sampling: each mode keeps the target's distribution, not its samples; a sample differs from greedy
    assert any([p["tokens"] for p in by_t["1"][m]["per_prompt"]] != greedy for m in ("baseline", "eagle3"))
    assert bench.main([*args[:-2], "--output", str(tmp_path / "report")]) == 2
    assert "--output draws one temperature's report" in capsys.readouterr().err


def test_the_length_table_groups_prompts_by_their_length():
    from medusa.bench.prompts import Prompt
    from medusa.bench.records import Run
    from medusa.bench.summary import length_table, summarise

    prompts = [Prompt(str(i), f"{task}-{n}", "x") for i, (task, n) in enumerate([("rag", "2k"), ("code", "1k"),
                                                                                  ("rag", "1k")])]

    def run(tokens: int, seconds: float, steps: int) -> Run:
        return Run(tokens=[1] * tokens, seconds=seconds, steps=steps)

    runs = {"baseline": [run(10, 2.0, 10), run(10, 1.0, 10), run(10, 1.0, 10)],
            "hybrid": [run(10, 1.0, 5), run(10, 0.5, 4), run(10, 0.5, 6)]}
    lines = length_table(summarise(prompts, runs, None))
    assert lines[0] == "| mode | 1k tokens: tok/s (x baseline, tau) | 2k tokens: tok/s (x baseline, tau) |"
    assert lines[2] == "| baseline | 10.0 (1.00x, 1.00) | 5.0 (1.00x, 1.00) |"
    assert lines[3] == "| hybrid | 20.0 (2.00x, 2.00) | 10.0 (2.00x, 2.00) |"
    assert length_table(summarise([Prompt("0", "writing", "x")], {"baseline": [run(4, 1.0, 4)]}, None)) == []


def test_the_decode_rate_leaves_each_prompts_first_token_out():
    """After the first token: a long prompt's pass is most of a short answer's time, so the length
    table also gives tokens/s of the decoding alone, from when each answer's first token came;
    modes that do not say show "-", and the summary keeps the rate per mode."""
    from medusa.bench.prompts import Prompt
    from medusa.bench.records import Run
    from medusa.bench.summary import length_table, summarise

    prompts = [Prompt("0", "rag-8k", "x"), Prompt("1", "rag-8k", "x")]
    runs = {"baseline": [Run(tokens=[1] * 11, seconds=12.0, steps=11, first_seconds=10.0)] * 2,
            "hybrid": [Run(tokens=[1] * 11, seconds=11.0, steps=5, first_seconds=10.0)] * 2,
            "hf": [Run(tokens=[1] * 11, seconds=13.0)] * 2}
    summary = summarise(prompts, runs, None)
    assert summary["baseline"]["decode_tokens_per_second"] == 5.0  # 20 tokens after the first in 4 s
    assert summary["hybrid"]["decode_tokens_per_second"] == 10.0 and summary["hf"]["decode_tokens_per_second"] is None
    whole, decode = length_table(summary), length_table(summary, decode=True)
    assert whole[3] == "| hybrid | 1.0 (1.09x, 2.20) |"  # 22 tokens in 22 s against 22 in 24 s
    assert decode[0] == "| mode | 8k tokens: after the first token: tok/s (x baseline, tau) |"
    assert decode[2:] == ["| baseline | 5.0 (1.00x, 1.00) |", "| hybrid | 10.0 (2.00x, 2.20) |", "| hf | - |"]


def test_every_step_drafts_turns_the_lone_check_off(tmp_path):
    folder = tiny_target(tmp_path / "model")
    heads = save_heads(init_eagle_for(AutoModelForCausalLM.from_pretrained(folder)), tmp_path / "heads")
    common = ["--model", str(folder), "--heads", str(heads), "--limit", "2", "--max-new-tokens", "24",
              "--modes", "baseline,eagle", "--autotune", "off"]
    runs = {}
    for name, extra in (("checked", []), ("every", ["--every-step-drafts"])):
        out = tmp_path / f"{name}.json"
        assert bench.main(common + extra + ["--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())["modes"]["eagle"]["per_prompt"]
    # each prompt says its plain steps; with the flag there are none: every step drafted
    assert all(isinstance(p["plain_steps"], int) for p in runs["checked"])
    assert all(p["plain_steps"] == 0 for p in runs["every"])
    assert [p["tokens"] for p in runs["checked"]] == [p["tokens"] for p in runs["every"]]


def test_the_step_profile_says_how_many_steps_went_plain():
    from medusa.bench.summary import profile_lines

    ms = {"draft": 1.0, "verify": 8.0, "update": 0.5, "other": 0.5}
    summary = {"eagle": {"step_ms": ms, "per_prompt": [{"steps": 11, "plain_steps": 3}, {"steps": 11, "plain_steps": 0}]},
               "hybrid": {"step_ms": ms, "per_prompt": [{"steps": 11, "plain_steps": 0}]}}
    eagle, hybrid = profile_lines(summary)
    assert eagle.endswith("; 3 of 20 steps plain (drafting did not pay)") and "plain" not in hybrid


def test_the_step_profile_says_how_many_steps_went_lean():
    from medusa.bench.summary import profile_lines

    ms = {"draft": 1.0, "verify": 8.0, "update": 0.5, "other": 0.5}
    summary = {"hybrid": {"step_ms": ms, "per_prompt": [{"steps": 11, "plain_steps": 2, "lean_steps": 5},
                                                        {"steps": 11, "lean_steps": 1}]},
               "lookup": {"step_ms": ms, "per_prompt": [{"steps": 11, "plain_steps": 0, "lean_steps": 0}]}}
    hybrid, lookup = profile_lines(summary)
    assert hybrid.endswith("; 2 of 20 steps plain (drafting did not pay); 6 of 20 steps lean (the heads did not pay)")
    assert "lean" not in lookup
