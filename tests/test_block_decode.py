"""Decoding with block heads (``kind: block``): k tokens drafted in one drafter pass.

Exact greedy decoding in modes block and hybrid on four architectures (random heads, and
heads forced right so long chains are accepted), the context buffer's growth and contents,
sampling that keeps the target's law, folders round-tripping through the Hub cache, one-line
errors for the wrong kind, and a draft step that never reads a tensor back to the host."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_hub import populate_hf_cache
from tiny import DRAFTING, hf_greedy, tiny_model

import medusa
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.block import BlockProposer, block_paths, block_size_for
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.errors import MedusaError
from medusa.hub.hub import build_publish_folder, load_heads_from
from medusa.models.block_heads import BlockHeads, init_block_for
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.heads_config import read_heads_config, save_heads
from medusa.models.loader import init_heads_for, load_heads
from medusa.runtime import hf as kv

ARCHS = ("llama", "qwen2", "mistral", "gemma3")
SIBLINGS = DynamicTree(nodes=7, depth=4, topk=2)  # the chain of 4 and 3 runner-ups at its best places
CHAIN = DynamicTree(nodes=4, depth=4, topk=1)  # the top-1 chain alone (CUDA's default: no host read)


def prompt(seed: int, n: int = 12, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def started(engine: Engine, proposer, ids: list[int]):
    """A decode state after the prefill, ``proposer`` begun on it (as the engine's loop does)."""
    state = engine._prefill(ids, None, medusa.GenerationStats(), medusa.SamplingConfig(), 8)
    state.tokens.append(int(state.root))
    proposer.begin(state)
    return state


@pytest.mark.parametrize("arch", ARCHS)
def test_random_block_heads_decode_exactly(arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    heads = init_block_for(model, 4, vocab=torch.arange(0, 96, 3))  # a draft vocabulary of a third
    engine = Engine(model, heads=heads)
    for seed in range(2):
        ids = prompt(seed)
        ref = hf_greedy(model, ids, 24)
        for mode in ("block", "hybrid", BlockProposer(heads, engine.device, SIBLINGS),
                     BlockProposer(heads, engine.device, CHAIN)):
            assert engine.generate(ids, max_new_tokens=24, mode=mode).tokens == ref, (arch, mode)
    # one pass drafts a proposal of the block's rows, target ids of the draft vocabulary
    proposer = engine.proposer("block")
    drafted = proposer.propose(started(engine, proposer, prompt(3))).tokens[1:].tolist()
    assert len(drafted) == 4 and all(t % 3 == 0 for t in drafted), drafted


class Oracle(BlockHeads):
    """Heads forced right: block position ``i`` (absolute position ``root_position + i``)
    scores the greedy answer's token at ``root_position + i + 1`` highest, computed on the
    device from a lookup table (no host read, as the real drafter)."""

    def __init__(self, config, target, answer: list[int]):
        super().__init__(config, target)
        self.answer = torch.tensor(answer)

    def draft(self, root, root_position, ctx, ctx_valid=None):
        logits = super().draft(root, root_position, ctx, ctx_valid)  # [B, k, S], run for its cost
        at = (root_position[:, None] + 1 + torch.arange(self.block_size)).clamp(max=self.answer.numel() - 1)
        return torch.full_like(logits, -10.0).scatter_(-1, self.answer[at][..., None], 10.0)


def oracle(model, ids: list[int], n: int, block: int = 6) -> tuple[Oracle, list[int]]:
    ref = hf_greedy(model, ids, n)
    heads = init_block_for(model, block)  # the whole vocabulary: every answer token can be drafted
    forced = Oracle(heads.config, model, ids + ref)
    forced.load_state_dict(heads.state_dict())
    return forced, ref


@pytest.mark.parametrize("arch", ARCHS)
def test_block_heads_forced_right_are_accepted_in_full(arch):
    model = tiny_model(arch)
    ids = prompt(5)
    forced, ref = oracle(model, ids, 30)
    engine = Engine(model, heads=forced)
    for mode in ("block", "hybrid", BlockProposer(forced, engine.device, SIBLINGS),
                 BlockProposer(forced, engine.device, DynamicTree(nodes=6, depth=6, topk=1))):
        res = engine.generate(ids, max_new_tokens=30, mode=mode)
        assert res.tokens == ref, (arch, mode)
        # a block of 6 right (its chain outscores any sibling): up to 7 tokens a pass (SIBLINGS: 4 deep, 5)
        assert res.stats.tau > 3.5 and max(res.stats.accepted) >= 5, (arch, mode, res.stats.accepted)


def test_the_context_buffer_grows_and_holds_the_verified_positions():
    model = tiny_model("gemma3")
    ids = prompt(7, n=20)
    forced, ref = oracle(model, ids, 60)
    engine = Engine(model, heads=forced)
    proposer = BlockProposer(forced, engine.device, capacity=8)  # the prompt alone overflows it
    res = engine.generate(ids, max_new_tokens=60, mode=proposer)
    assert res.tokens == ref and res.stats.tau > 3.5
    capacity = proposer.kv[0][0].shape[2]
    assert capacity >= 64 and capacity & (capacity - 1) == 0  # doubled from 8
    n = len(ids) + len(ref) - 1  # every verified position: all but the last token (the last step may verify more)
    assert proposer.used >= n
    # the buffer holds the context keys/values of the verified sequence, slot p = position p,
    # though they were written from tree-masked verification passes in padded chunks
    seq = torch.tensor((ids + ref)[:n])
    with torch.no_grad():
        fused = forced.fuse(kv.features(model, seq, forced.feature_layers)[None])
        want = forced.context_kv(fused, torch.arange(seq.numel())[None])
    for (k, v), (wk, wv) in zip(proposer.kv, want):
        torch.testing.assert_close(k[:, :, :n], wk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[:, :, :n], wv, atol=1e-4, rtol=1e-4)


def test_siblings_are_ranked_by_cumulative_draft_score():
    model = tiny_model("llama")
    torch.manual_seed(2)
    heads = init_block_for(model, 4)
    engine = Engine(model, heads=heads)
    proposer = BlockProposer(heads, engine.device, SIBLINGS)
    state = started(engine, proposer, prompt(4))
    proposal = proposer.propose(state)
    assert len(proposer.ranked) == 7 and proposal.tokens.numel() == 8
    assert proposer.scores == sorted(proposer.scores, reverse=True)
    assert set(proposer.ranked) <= set(block_paths(4, 2))
    # a sibling's parent is on the chain, so it is kept too (prefix-closed)
    assert all(len(p) == 1 or p[:-1] in proposer.ranked for p in proposer.ranked)
    ids, scores = proposer.draft_step(state.root, torch.tensor([state.length]))
    assert ids.shape == scores.shape == (4, 2) and bool((scores[:, 0] >= scores[:, 1]).all())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("draw", [0, 1, 2])  # top-k point masses; drawn per depth; drawn siblings
@pytest.mark.parametrize("mode", ["block", "hybrid"])
def test_block_sampling_keeps_the_target_distribution(mode, draw):
    # The exact-law chi-square check of test_sampling.py, with block heads drafting.
    from test_sampling import ALPHA, DRAWN_SAMPLING, PROMPT, V, chi_square_pvalue, engine_samples, target_law

    model = tiny_model("llama", vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    sampling = DRAWN_SAMPLING[draw]
    forced, _ = oracle(model, PROMPT, 8, block=3)  # drafts the greedy answer: often what is sampled
    eng = Engine(model, heads=forced, proposer_config=medusa.ProposerConfig(draw=draw))
    samples, drafted_hits = engine_samples(eng, mode, sampling, 300)
    assert chi_square_pvalue(samples, target_law(model, sampling, eng.eos)) > ALPHA
    assert drafted_hits > 0  # some drafts were accepted: the check covers the tree path


def test_block_folder_round_trips_through_the_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    model = tiny_model("llama")
    torch.manual_seed(3)
    heads = init_block_for(model, 5, vocab=torch.arange(10, 80))
    save_heads(heads, tmp_path / "h")
    cfg = read_heads_config(tmp_path / "h")
    assert cfg.kind == "block" and cfg.num_heads == 5 and cfg.feature_layers == list(heads.feature_layers)
    published = build_publish_folder(tmp_path / "h", tmp_path / "publish", "tester/tiny-block")
    cache = tmp_path / "hf-cache"
    populate_hf_cache(cache, "tester/tiny-block", sorted(published.iterdir()))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ids = prompt(8)
    reference = Engine(model, heads=heads, proposer_config=DRAFTING).generate(ids, max_new_tokens=20, mode="block")
    for source in (tmp_path / "h", "tester/tiny-block"):
        back = load_heads(source, model) if source == tmp_path / "h" else load_heads_from(source, model)
        assert isinstance(back, BlockHeads) and back.block_size == 5
        assert torch.equal(back.draft_vocab, torch.arange(10, 80))
        for k, v in heads.state_dict().items():
            assert torch.equal(v, back.state_dict()[k]), k
        res = Engine(model, heads=back, proposer_config=DRAFTING).generate(ids, max_new_tokens=20, mode="block")
        assert res.tokens == reference.tokens and res.stats.accepted == reference.stats.accepted


def one_line_error(engine: Engine, match: str, **kwargs) -> None:
    with pytest.raises(MedusaError, match=match) as err:
        engine.generate(prompt(1), max_new_tokens=4, **kwargs)
    assert "\n" not in str(err.value)


def test_wrong_kinds_are_one_line_errors():
    model = tiny_model("llama")
    torch.manual_seed(0)
    block = Engine(model, heads=init_block_for(model, 4))
    one_line_error(block, "mode 'medusa' needs medusa heads, but the loaded heads are block heads: use mode='block'",
                   mode="medusa")
    one_line_error(block, "needs eagle3 heads.*block heads", mode="eagle3")
    one_line_error(block, "these are block heads, whose tree is drafted per step", mode="block", tree=[(0,), (1,)])
    one_line_error(Engine(model, heads=init_eagle3_for(model, 3)), "needs block heads, but the loaded heads are eagle3",
                   mode="block")
    one_line_error(Engine(model), "mode 'block' needs heads", mode="block")


def test_the_draft_step_never_reads_the_device():
    """A step's drafting (the buffer write, the drafter pass, the top-k) runs on the meta device, where any
    read of a value (``.item()``, ``.tolist()``, ``bool()``, data-dependent shapes) raises: so
    it is free of host syncs, the structure a CUDA graph can capture."""
    # the check itself can fail: every kind of read raises on meta
    with pytest.raises(RuntimeError, match="meta tensors"):
        torch.zeros(1, device="meta").item()
    with pytest.raises(NotImplementedError, match="meta tensor"):
        torch.zeros(2, device="meta").tolist()
    for size in (CHAIN, SIBLINGS):
        model = tiny_model("gemma3")
        torch.manual_seed(0)
        heads = init_block_for(model, 4, vocab=torch.arange(0, 96, 2))
        engine = Engine(model, heads=heads)
        proposer = BlockProposer(heads, engine.device, size)
        state = started(engine, proposer, prompt(2))
        want = proposer.draft_step(state.root, torch.tensor([state.length]))
        model.to("meta")
        heads.to("meta")  # the drafter reads the target's embedding: both on meta, nothing can be read
        meta = BlockProposer(heads, torch.device("meta"), size)
        meta.kv = [(k.to("meta"), v.to("meta")) for k, v in proposer.kv]
        meta.used = proposer.used
        meta.append(torch.zeros(3, 2 * model.config.hidden_size, device="meta"), proposer.used)  # a step's write
        ids, scores = meta.draft_step(torch.zeros((), dtype=torch.long, device="meta"),
                                      torch.zeros(1, dtype=torch.long, device="meta"))
        assert ids.device.type == "meta" and ids.shape == want[0].shape == scores.shape
        assert meta.used == proposer.used + 3


def test_block_sizes_default_to_the_whole_chain():
    model = tiny_model("llama")
    heads = init_block_for(model, 6)
    # the whole chain's rows: siblings where drafting may read back (more tokens per pass there),
    # the top-1 chain on CUDA (no host read while drafting)
    assert block_size_for(heads, torch.device("cpu")) == DynamicTree(nodes=6, depth=6, topk=4)
    assert block_size_for(heads, torch.device("cuda")) == DynamicTree(nodes=6, depth=6, topk=1)
    heads.dynamic = {"cpu": {"nodes": 3, "depth": 6, "topk": 1}}  # calibrated: it wins
    assert block_size_for(heads, torch.device("cpu")) == DynamicTree(nodes=3, depth=6, topk=1)
    proposer = BlockProposer(heads, torch.device("cpu"), DynamicTree(nodes=20, depth=9, topk=3))
    assert (proposer.depth, proposer.topk, proposer.nodes, proposer.max_rows) == (6, 3, 18, 19)


def test_bench_and_chat_run_block_heads(tmp_path, capsys):
    from train_fixtures import tiny_target
    from transformers import AutoModelForCausalLM

    from infer import bench, chat
    from medusa.bench.engines import load_bench
    from medusa.bench.prompts import encode

    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    block = save_heads(init_block_for(model, 4, vocab=list(range(0, model.config.vocab_size, 2))), tmp_path / "block")
    out = tmp_path / "bench.json"
    args = ["--model", str(folder), "--heads", "init", "--block-heads", str(block), "--limit", "2",
            "--max-new-tokens", "10", "--modes", "baseline,block,hybrid@block,medusa", "--json", str(out)]
    assert bench.main(args) == 0
    modes = json.loads(out.read_text())["modes"]
    ref = [p["tokens"] for p in modes["baseline"]["per_prompt"]]
    for name in ("block", "hybrid@block", "medusa"):
        assert [p["tokens"] for p in modes[name]["per_prompt"]] == ref, name
    # --chat-template formats the prompts (a base model's heads are trained on one, e.g. Gemma 3 270M's)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}w9 {{ m['content'] }} w8{% endfor %}")
    plain = load_bench(bench.parse_args(["--model", str(folder), "--autotune", "off"]))
    asked = load_bench(bench.parse_args(["--model", str(folder), "--autotune", "off", "--chat-template", str(template)]))
    assert asked.main.tokenizer.chat_template == template.read_text()
    assert encode(asked.main, "w1 w2") == asked.main.tokenizer("w9 w1 w2 w8")["input_ids"]
    assert encode(plain.main, "w1 w2") != encode(asked.main, "w1 w2")
    capsys.readouterr()
    # block modes without block heads, and a folder of another kind as block heads: one line each
    for extra, said in ((["--heads", "init"], "modes on block heads need a folder of them: pass --heads FOLDER or "
                                              "--block-heads FOLDER"),
                        (["--block-heads", str(folder)], None)):
        assert bench.main(["--model", str(folder), *extra, "--limit", "1", "--max-new-tokens", "4",
                           "--modes", "baseline,block"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and (said is None or said in err[-1]), err[-1]
    medusa_folder = save_heads(init_heads_for(model), tmp_path / "medusa")
    assert bench.main(["--model", str(folder), "--block-heads", str(medusa_folder), "--limit", "1",
                       "--max-new-tokens", "4", "--modes", "baseline,block"]) == 1
    err = capsys.readouterr().err
    assert "error: --block-heads" in err and "holds medusa heads" in err, err
    # the chat on block heads: mode hybrid by default, the block in the banner, the baseline's answer
    assert chat.main(["--model", str(folder), "--heads", str(block), "--prompt", "w1 w2 w3",
                      "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    said = capsys.readouterr()
    assert re.search(r"heads .* block of 4 tokens per drafter pass \(layers 0, 1, \d+-token draft vocabulary\) · "
                     r"proposal default: 4 nodes \(chain 4 deep, top-4 per depth\) \+ \d+-token lookup chain",
                     said.err), said.err
    assert "mode    hybrid" in said.err
    assert chat.main(["--model", str(folder), "--heads", str(block), "--prompt", "w1 w2 w3", "--mode", "medusa",
                      "--max-new-tokens", "12", "--dtype", "float32"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "needs medusa heads, but the loaded heads are block heads" in errors[0], errors


def test_block_proposals_are_sized_from_this_machines_pass_costs(tmp_path):
    from medusa.autotune.cache import PlanCache
    from medusa.autotune.planner import Planner
    from medusa.autotune.trees import acceptance_by_size
    from medusa.decoding.plan import Plan
    from medusa.decoding.proposers.hybrid import Hybrid

    model = tiny_model("llama")
    ids = prompt(9)
    forced, ref = oracle(model, ids, 24, block=4)
    # teacher-forced along the answer (the calibration's measurement), the oracle's chain is right
    chain = acceptance_by_size(forced, model, [(ids, ref)], DynamicTree(nodes=4, depth=4, topk=1), chain=3)
    assert chain.accepted == sorted(chain.accepted) and chain.accepted[-1] > 3.0, chain.accepted
    siblings = acceptance_by_size(forced, model, [(ids, ref)], DynamicTree(nodes=8, depth=4, topk=2), chain=3)
    forced.measured = {"cpu": {"curves": {"4x1": chain.as_record(), "4x2": siblings.as_record()}}}
    cache = PlanCache(tmp_path)
    plan = Planner(True, cache).trees(model, forced, Plan.default(model), False)
    trees = plan.decision("trees")
    (key, entry), = cache.entries().items()
    assert "sized here" in trees.reason and trees.seconds > 0 and set(entry["draft_ms"]) == {"4x1", "4x2"}, trees
    assert "block h64 v96 k4 l1" in key  # the block's size and layers are part of the timings' key
    # the pick follows the timings (written here: flat passes, free drafting, whatever the machine's load)
    cache.put(key, {**{k: v for k, v in entry.items() if k != "busy_share"},
                    "cost_ms": {"1": 10.0, "32": 10.0}, "draft_ms": {"4x1": 0.0, "4x2": 0.0}})
    plan = Planner(True, cache, retime=False).trees(model, forced, Plan.default(model), False)
    assert (plan.eagle.nodes, plan.eagle.depth, plan.eagle.topk) == (4, 4, 1), plan.eagle  # the whole chain pays
    engine = Engine(model, heads=forced, plan=plan)
    block, hybrid = engine.proposer("block"), engine.proposer("hybrid")
    assert isinstance(block, BlockProposer) and block.size == plan.eagle
    assert (hybrid.heads if isinstance(hybrid, Hybrid) else hybrid).size == plan.hybrid
    for mode in ("block", "hybrid"):
        assert engine.generate(ids, max_new_tokens=24, mode=mode).tokens == ref, mode


def test_head_acceptance_reports_block_heads_per_depth(tmp_path, capsys):
    from test_hub import load_script
    from train_fixtures import tiny_target
    from transformers import AutoModelForCausalLM

    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    block = save_heads(init_block_for(model, 4), tmp_path / "block")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"count from w{i} please"]}) + "\n" for i in range(2)))
    out = tmp_path / "acceptance.json"
    script = load_script("head_acceptance")
    assert script.main(["--model", str(folder), "--heads", str(block), "--heads", "init", "--prompts", str(prompts),
                        "--limit", "2", "--max-new-tokens", "16", "--depth", "6", "--json", str(out)]) == 0
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    per_depth = rows["block"]["per_depth"]
    assert len(per_depth) == 4  # a block of 4 drafts no deeper, asked for 6
    assert all(0 <= b <= a <= 1 for a, b in zip(per_depth, per_depth[1:])) and rows["block"]["draft_ms"] > 0
    assert rows["medusa"]["per_depth"]  # the fresh Medusa heads beside it, as before
    assert "| " + str(block) + " | block |" in capsys.readouterr().out


@pytest.mark.peers
def test_compiled_passes_return_the_fused_layers_block_heads_read(tmp_path, monkeypatch):
    # The compiled verification pass hands block heads the features they read, as for eagle3
    # heads: decoding through saved CPU graphs stays exact and keeps long chains.
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = tiny_model("llama")
    ids = prompt(6)
    forced, ref = oracle(model, ids, 20, block=4)
    engine = Engine(model, heads=forced, compile=True)
    assert engine.precompile("block") and engine.passes.features == forced.feature_layers
    res = engine.generate(ids, max_new_tokens=20, mode="block")
    assert res.tokens == ref and res.stats.tau > 3.0
    assert engine.passes.saved.fallback is None and engine.passes.saved.traced
