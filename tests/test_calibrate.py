import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny import tiny_model
from transformers import AutoTokenizer

import medusa
from medusa.autotune.trees import candidate_ranks, choose_tree, interpolate, path_counts
from medusa.decoding.tree import compile_tree
from medusa.models.heads_config import save_heads
from medusa.models.loader import init_heads_for
from medusa.models.target import default_model_dir

ROOT = Path(__file__).resolve().parent.parent


def test_path_counts_stop_at_the_first_miss():
    ranks = torch.tensor([[0, 0, 1], [0, -1, 0], [1, 0, -1], [-1, 0, 0], [0, 0, 1]])
    assert path_counts(ranks) == Counter({(0,): 3, (0, 0): 2, (0, 0, 1): 2, (1,): 1, (1, 0): 1})


def test_choose_tree_follows_the_cost_curve():
    counts = Counter({(0,): 60, (1,): 20, (0, 0): 40, (0, 1): 10, (0, 0, 0): 25, (2,): 5})
    flat = {1: 10.0, 64: 10.0}  # a GPU-like device: nodes are free
    steep = {1: 10.0, 2: 30.0, 64: 640.0}  # every extra node costs a lot
    big = choose_tree(counts, 100, flat, max_nodes=10)
    small = choose_tree(counts, 100, steep, max_nodes=10)
    assert len(big.paths) == 6 and abs(big.expected_tokens - 2.6) < 1e-9
    assert small.paths == []  # 1 token per 10 ms beats 1.6 per 30 ms
    compile_tree(big.paths)  # prefix-closed: a valid tree
    mid = choose_tree(counts, 100, {1: 10.0, 2: 12.0, 3: 13.0, 4: 30.0, 64: 600.0}, max_nodes=10)
    assert mid.paths == [(0,), (0, 0)]  # 2.0 tokens per 13 ms is the best rate here


def test_interpolate():
    cost = {1: 10.0, 4: 16.0}
    assert interpolate(cost, 1) == 10.0 and interpolate(cost, 2) == 12.0 and interpolate(cost, 8) == 32.0


def test_candidate_ranks_match_a_direct_computation():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    tokens = torch.randint(3, 96, (20,), generator=g)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=tokens[None]).last_hidden_state[0]
        ranks = candidate_ranks(heads, hidden, tokens, max_rank=5)
        # the same per-head products candidate_ranks computes, so near-ties round alike
        logits = torch.stack([heads.blocks[k](hidden[:16]) @ model.lm_head.weight.T for k in range(3)])  # [K, T, V]
    assert ranks.shape == (20 - 3 - 1, 3)
    for t in range(ranks.shape[0]):
        for k in range(3):
            order = logits[k, t].argsort(descending=True).tolist()
            r = order.index(int(tokens[t + k + 2]))
            assert ranks[t, k] == (r if r < 5 else -1)


def _tiny_target(tmp_path: Path, **config):
    """A tiny random target (folder, model) with the embedded model's tokenizer and chat template."""
    tok_dir = default_model_dir()
    target = tmp_path / "target"
    model = tiny_model("llama", vocab_size=49152, **config)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok_dir / name).is_file():
            (target / name).write_bytes((tok_dir / name).read_bytes())
    return target, model


def _conversations(tmp_path: Path) -> Path:
    data = tmp_path / "convs.jsonl"
    lines = [{"conversations": [{"from": "human", "value": f"Tell me about topic {i}."},
                                {"from": "gpt", "value": f"Topic {i} is interesting because of reason {i}."}]}
             for i in range(12)]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    return data


def _script():
    spec = importlib.util.spec_from_file_location("calibrate_tree", ROOT / "scripts" / "calibrate_tree.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.e2e
def test_calibrate_script_end_to_end(tmp_path):
    # float32 asked for: the automatic pick times the tiny target, and on a busy CPU its bfloat16
    # passes can time faster (a fresh-clone CI under load picked it and wrote "cpu-bfloat16")
    target, model = _tiny_target(tmp_path)
    heads_dir = save_heads(init_heads_for(model, num_heads=3), tmp_path / "heads")
    data = _conversations(tmp_path)
    script = _script()
    rc = script.main(["--heads", str(heads_dir), "--model", str(target), "--prompts", str(data), "--samples", "4",
                      "--max-new-tokens", "24", "--vocab-size", "500", "--reference-answers", "8", "--max-nodes", "8",
                      "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    record = json.loads((heads_dir / "calibration.json").read_text())
    assert set(record["trees"]) == {"cpu"} and len(record["draft_vocab"]) <= 500
    assert 2 in record["draft_vocab"]  # end of sequence is always proposable
    assert set(record["measured"]["cpu"]["cost_ms"]) >= {"1", "2", "8"}
    drawn = record["measured"]["cpu"]["drawn"]  # the heads' drawn chains at the default temperatures
    assert set(drawn) == {"0.7", "1"} and all(len(d["kept"]) == 3 and d["level_ms"] > 0 for d in drawn.values())
    eng = medusa.load(model=str(target), heads=str(heads_dir), device="cpu", dtype="float32")
    assert [t for t, _, _ in eng.plan.drawn] == [0.7, 1.0]  # sized from the calibration's own costs
    assert set(eng.tree_paths()) == {tuple(p) for p in record["trees"]["cpu"]}  # same tree, in layout order
    assert eng.heads.draft_vocab is not None
    prompt = eng.tokenizer("Hello there")["input_ids"]
    assert eng.generate(prompt, max_new_tokens=16).tokens == eng.generate(prompt, max_new_tokens=16, mode="baseline").tokens
    # A tree for another device from its measured (here: flat, GPU-like) cost curve; the CPU tree stays.
    common = ["--heads", str(heads_dir), "--model", str(target), "--prompts", str(data), "--samples", "4",
              "--max-new-tokens", "24", "--vocab-size", "500", "--reference-answers", "8", "--max-nodes", "8",
              "--dtype", "float32"]
    assert script.main(common + ["--for-device", "cuda"]) == 1  # no cost curve: refused
    assert script.main(common + ["--for-device", "cuda", "--cost", "1:40,9:40"]) == 0
    again = json.loads((heads_dir / "calibration.json").read_text())
    assert again["trees"]["cpu"] == record["trees"]["cpu"]
    assert again["measured"]["cuda"]["cost_ms"] == {"1": 40.0, "9": 40.0}
    assert again["measured"]["cuda"]["accuracy_measured_on"] == "cpu"


def test_eagle_calibration_keeps_a_tree_per_dtype(tmp_path):
    # Dynamic-tree sizes of EAGLE heads are kept per device and dtype, like Medusa trees: a
    # bfloat16 run must not overwrite the float32 entry, and each engine reads its own.
    from medusa.decoding.proposers.eagle import DynamicTree
    from medusa.models.eagle_heads import init_eagle_for

    target, model = _tiny_target(tmp_path)
    heads_dir = save_heads(init_eagle_for(model), tmp_path / "eagle")
    script = _script()
    common = ["--heads", str(heads_dir), "--model", str(target), "--prompts", str(_conversations(tmp_path)),
              "--samples", "3", "--max-new-tokens", "16", "--vocab-size", "500", "--reference-answers", "6",
              "--max-nodes", "8", "--device", "cpu"]
    path = heads_dir / "calibration.json"
    assert script.main(common + ["--dtype", "float32", "--cost", "1:10,9:80"]) == 0
    first = json.loads(path.read_text())
    from medusa.runtime.kernels import onednn_available

    kernels = "onednn" if onednn_available("cpu", torch.bfloat16) else "default"  # AVX2-only CPUs pack no bf16
    assert script.main(common + ["--dtype", "bfloat16", "--cost", "1:10,9:10", "--kernels", kernels]) == 0
    record = json.loads(path.read_text())
    assert record["measured"]["cpu-bfloat16"]["kernels"] == kernels  # what the cost was measured with
    assert set(record["dynamic"]) == set(record["measured"]) == {"cpu", "cpu-bfloat16"}
    assert record["dynamic"]["cpu"] == first["dynamic"]["cpu"]  # the float32 entry survived the bf16 run
    assert record["measured"]["cpu"]["cost_ms"] == {"1": 10.0, "9": 80.0}
    assert record["measured"]["cpu-bfloat16"]["cost_ms"] == {"1": 10.0, "9": 10.0}
    assert "--dtype float32" in record["measured"]["cpu"]["command"]
    assert "--dtype bfloat16" in record["measured"]["cpu-bfloat16"]["command"]
    drawn = record["measured"]["cpu"]["drawn"]  # drawn chains calibrated at the default temperatures
    assert set(drawn) == {"0.7", "1"} and all(len(d["kept"]) == 8 and d["level_ms"] > 0 for d in drawn.values())
    assert all(len(d.get("chain", [0] * 16)) == 16 for d in drawn.values())  # hybrid's chains of 1..--max-chain
    # --drawn-only adds a temperature's curve to the entry and keeps the rest
    assert script.main(common + ["--dtype", "float32", "--drawn-only", "--temperatures", "0.5"]) == 0
    again = json.loads(path.read_text())
    assert set(again["measured"]["cpu"]["drawn"]) == {"0.5"} and again["dynamic"] == record["dynamic"]
    assert again["draft_vocab"] == record["draft_vocab"]
    # random heads accept too little for either curve to pick a tree; give the dtypes other sizes
    fp32, bf16 = DynamicTree(nodes=2, depth=2, topk=1), DynamicTree(nodes=6, depth=3, topk=2)
    record["dynamic"] = {"cpu": fp32.as_dict(), "cpu-bfloat16": bf16.as_dict()}
    path.write_text(json.dumps(record))
    for dtype, size in (("float32", fp32), ("bfloat16", bf16)):
        eng = medusa.load(model=str(target), heads=str(heads_dir), device="cpu", dtype=dtype, kernels="default",
                          autotune=False)  # the calibrated sizes (not this machine's own: test_sizing.py)
        assert eng.proposer("eagle").size == size, dtype


def test_cost_curve_argument():
    script = _script()
    assert script.parse_cost("1:61,2:94.5,16:111") == {1: 61.0, 2: 94.5, 16: 111.0}
    for bad in ("1-61", "2:94", "x:1"):
        try:
            script.parse_cost(bad)
        except medusa.MedusaError as err:
            assert "--cost" in str(err)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_measure_cost_times_every_size_with_each_cache_kind():
    from medusa.autotune.timing import measure_cost

    model = tiny_model("llama")
    for kind in ({}, {"static_cache": True}, {"compile": "aot_eager"}):
        torch._dynamo.reset()
        cost = measure_cost(model, [1, 3, 8], prefix=20, reps=2, **kind)
        assert sorted(cost) == [1, 3, 8]
        assert all(0 < ms < 10_000 for ms in cost.values()), kind


def test_a_base_model_is_calibrated_with_the_template_its_heads_were_trained_with(tmp_path, capsys):
    """A tokenizer without a chat template (a base model such as Gemma 3 270M) is one line naming
    --chat-template; with the flag, the held-out prompts are the template's and the run writes
    its calibration."""
    target, model = _tiny_target(tmp_path)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    heads_dir = save_heads(init_heads_for(model, num_heads=2), tmp_path / "heads")
    script = _script()
    argv = ["--heads", str(heads_dir), "--model", str(target), "--prompts", str(_conversations(tmp_path)),
            "--samples", "3", "--max-new-tokens", "12", "--vocab-size", "500", "--reference-answers", "6",
            "--max-nodes", "4", "--device", "cpu", "--dtype", "float32", "--cost", "1:10,5:20"]
    assert script.main(argv) == 1
    assert "has no chat template: pass --chat-template FILE" in capsys.readouterr().err
    assert not (heads_dir / "calibration.json").exists()
    template = ROOT / "configs" / "chat_templates" / "question_answer.jinja"
    seen = []
    greedy = script.greedy_answers
    script.greedy_answers = lambda engine, prompts, n: seen.extend(prompts) or greedy(engine, prompts, n)
    assert script.main([*argv, "--chat-template", str(template)]) == 0
    tok = AutoTokenizer.from_pretrained(target)
    texts = [tok.decode(p) for p in seen]
    assert len(texts) == 3 and all("Question: Tell me about topic " in t and t.endswith("Answer:") for t in texts), texts
    assert "cpu" in json.loads((heads_dir / "calibration.json").read_text())["trees"]


def test_block_heads_are_calibrated_and_decode_with_the_calibrated_size(tmp_path):
    """Block heads go through the same calibration as EAGLE heads (acceptance curves per proposal
    shape, the pass-cost curve): calibration.json gets their sizes, and a loaded engine's block
    proposer takes them (the sizes the loader reads for EAGLE heads, now for block heads too)."""
    from medusa.decoding.proposers.eagle import DynamicTree
    from medusa.models.block_heads import init_block_for

    target, model = _tiny_target(tmp_path)
    heads_dir = save_heads(init_block_for(model, block_size=4), tmp_path / "block")
    args = ["--heads", str(heads_dir), "--model", str(target), "--prompts", str(_conversations(tmp_path)),
            "--samples", "3", "--max-new-tokens", "16", "--vocab-size", "500", "--reference-answers", "6",
            "--max-nodes", "8", "--device", "cpu", "--dtype", "float32", "--cost", "1:10,9:12"]
    assert _script().main(args) == 0
    path = heads_dir / "calibration.json"
    record = json.loads(path.read_text())
    assert set(record["dynamic"]) == set(record["measured"]) == {"cpu"}
    assert record["measured"]["cpu"]["cost_ms"] == {"1": 10.0, "9": 12.0}
    assert set(record["measured"]["cpu"]["curves"])  # one acceptance curve per proposal shape
    assert all(len(d["kept"]) == 4 for d in record["measured"]["cpu"]["drawn"].values())  # as deep as the block
    size = DynamicTree(nodes=3, depth=3, topk=1)  # random heads pick nothing worth testing: set one
    record["dynamic"] = {"cpu": size.as_dict()}
    path.write_text(json.dumps(record))
    eng = medusa.load(model=str(target), heads=str(heads_dir), device="cpu", dtype="float32", kernels="default",
                      autotune=False)
    assert eng.heads.dynamic["cpu"] == size.as_dict()
    proposer = eng.proposer("block")
    assert (proposer.size, proposer.depth, proposer.nodes) == (size, 3, 3)


def test_long_prompts_give_curves_per_context_length_and_the_plan_sizes_with_them(tmp_path):
    """--long-prompts measures the heads' acceptance on long prompts, grouped by the context length
    each stands for; --long-only adds them to an entry; a file without long prompts is refused."""
    from medusa.autotune.sizing import curves_by_context
    from medusa.models.eagle3_heads import init_eagle3_for

    target, model = _tiny_target(tmp_path, max_position_embeddings=1024)
    heads_dir = save_heads(init_eagle3_for(model, 3), tmp_path / "eagle3")
    long = tmp_path / "long.jsonl"
    words = " ".join(f"item {i} of the list," for i in range(55))  # 384-767 tokens: stands for 512
    long.write_text("".join(json.dumps({"question_id": q, "category": "rag-1k", "turns": [f"Read: {words} {q}"]}) + "\n"
                            for q in ("a", "b")) + json.dumps({"question_id": "c", "turns": ["Short."]}) + "\n")
    script = _script()
    common = ["--heads", str(heads_dir), "--model", str(target), "--prompts", str(_conversations(tmp_path)),
              "--samples", "3", "--max-new-tokens", "12", "--vocab-size", "500", "--reference-answers", "6",
              "--max-nodes", "8", "--device", "cpu", "--dtype", "float32", "--cost", "1:10,9:12",
              "--temperatures", "none"]
    assert script.main(common + ["--long-prompts", str(long)]) == 0
    path = heads_dir / "calibration.json"
    record = json.loads(path.read_text())
    entry = record["measured"]["cpu"]
    assert set(entry["curves_by_context"]) == {"512"}  # the short prompt stands for none
    assert set(entry["curves_by_context"]["512"]) == set(entry["curves"])  # every draft shape, measured there
    eng = medusa.load(model=str(target), heads=str(heads_dir), device="cpu", dtype="float32", autotune=False)
    assert set(curves_by_context(eng.heads, eng.device, eng.model.dtype)) == {512}
    # --long-only: only the long curves change
    entry["curves_by_context"] = {"4096": entry["curves_by_context"]["512"]}
    path.write_text(json.dumps(record))
    assert script.main(common + ["--long-only", "--long-prompts", str(long)]) == 0
    again = json.loads(path.read_text())
    assert set(again["measured"]["cpu"]["curves_by_context"]) == {"512"} and again["dynamic"] == record["dynamic"]
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"question_id": "s", "turns": ["Short."]}) + "\n")
    assert script.main(common + ["--long-only", "--long-prompts", str(short)]) == 1  # one line, no traceback
