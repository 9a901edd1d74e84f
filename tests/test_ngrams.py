"""The n-gram table of the target's answers: counts, backoff, pruning, files, and hybrid chains drafted from it."""

from __future__ import annotations

import collections
import gzip
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_eagle import PROMPT, noisy_eagle
from tiny import DRAFTING, hf_greedy, tiny_model

from medusa.autotune.trees import acceptance_by_size
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer
from medusa.decoding.proposers.factory import ProposerConfig, make_proposer
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.state import DecodeState
from medusa.errors import MedusaError
from medusa.models.eagle_heads import init_eagle_for
from medusa.models.heads_config import save_heads
from medusa.models.loader import load_heads
from medusa.runtime.ngrams import NGRAMS_NAME, NgramTable

REPO = Path(__file__).resolve().parent.parent


def counted(seqs: list[list[int]], max_n: int, min_n: int, min_count: int):
    """The table's meaning, by brute force: every context's next-token counts; the lookup takes the
    longest context whose most frequent next token was seen ``min_count`` times (smallest id on ties)."""
    counts = collections.defaultdict(collections.Counter)
    for s in seqs:
        for i in range(len(s)):
            for n in range(min_n, max_n + 1):
                if i >= n:
                    counts[tuple(s[i - n:i])][s[i]] += 1

    def next_token(ctx: list[int]) -> int | None:
        for n in range(max_n, min_n - 1, -1):
            c = counts.get(tuple(ctx[-n:])) if len(ctx) >= n else None
            if c and max(c.values()) >= min_count:
                top = max(c.values())
                return min(t for t, v in c.items() if v == top)
        return None

    full = sum(1 for c in counts.values() if max(c.values()) >= min_count)
    return next_token, full


def state_of(tokens: list[int], budget: int | None = None) -> DecodeState:
    """A decode state holding ``tokens`` (lookup reads only those and the budget)."""
    state = DecodeState(cache=None, tokens=list(tokens), length=len(tokens) - 1, root=torch.tensor(tokens[-1]),
                        hidden=None, logits=None)
    if budget is not None:
        state.budget = budget
    return state


def test_the_pruned_table_answers_every_context_as_the_full_counts_do():
    rng = random.Random(0)
    pruned_some = False
    for _ in range(40):
        vocab = rng.choice([3, 5, 20])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 20))]
        max_n = rng.choice([2, 3, 4])
        min_n = min(rng.choice([1, 2]), max_n)
        min_count = rng.choice([1, 2, 3])
        table = NgramTable.build(seqs, vocab, max_n=max_n, min_n=min_n, min_count=min_count)
        next_token, full = counted(seqs, max_n, min_n, min_count)
        for _ in range(200):
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
            assert table.next_token(ctx) == next_token(ctx), ctx
        assert len(table) <= full
        pruned_some |= len(table) < full
    assert pruned_some  # entries that repeat their suffix's prediction were dropped


def test_chains_follow_the_most_frequent_continuation_and_stop_where_nothing_is_known():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 2, 3, 7]]
    table = NgramTable.build(seqs, vocab_size=10, max_n=3, min_n=2, min_count=2)
    assert table.chain([8, 1, 2], 6) == [3, 4, 5]  # nothing ever followed 4 5
    assert table.chain([9, 2, 3], 3) == [4, 5]  # (9 2 3) -> 7 was seen once: backs off to (2 3) -> 4
    assert table.chain([2, 3], 1) == [4]  # k caps the chain
    assert table.chain([6, 6], 4) == [] and table.chain([], 4) == []
    once = NgramTable.build(seqs, vocab_size=10, max_n=3, min_n=2, min_count=1)
    assert once.chain([9, 2, 3], 3) == [7]
    assert table.sequences == 3 and table.corpus_tokens == 14


def test_tables_round_trip_through_safetensors_and_refuse_other_vocabularies(tmp_path):
    rng = random.Random(1)
    seqs = [[rng.randrange(30) for _ in range(50)] for _ in range(30)]
    table = NgramTable.build(seqs, vocab_size=30)
    path = tmp_path / NGRAMS_NAME
    table.save(path)
    assert not list(tmp_path.glob("*.tmp"))
    again = NgramTable.load(path, vocab_size=30)
    assert len(again) == len(table) and (again.vocab_size, again.min_count, again.sequences) == (30, 2, 30)
    for n in table.keys:
        assert np.array_equal(again.keys[n], table.keys[n]) and np.array_equal(again.tokens[n], table.tokens[n])
    with pytest.raises(MedusaError, match="vocabulary of 30 tokens.*build_ngrams"):
        NgramTable.load(path, vocab_size=31)
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, dtype=np.int64)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(MedusaError, match="not an n-gram table"):
        NgramTable.load(tmp_path / "other.safetensors")
    with pytest.raises(MedusaError, match="token 30, outside the vocabulary of 30"):
        NgramTable.build([[1, 30]], vocab_size=30)
    with pytest.raises(MedusaError, match="min_n <= max_n"):
        NgramTable.build(seqs, vocab_size=30, max_n=2, min_n=3)


def test_lookup_copies_the_text_first_and_drafts_from_the_table_where_the_text_has_no_match():
    table = NgramTable.build([[40, 41, 42, 43, 44, 45]] * 2, vocab_size=50, max_n=2)
    lookup = PromptLookup(torch.device("cpu"), num_tokens=3, max_ngram=2, table=table)
    state = state_of([7, 8, 9, 40, 41])  # 41 never occurred before in the text: the table drafts
    lookup.begin(state)
    assert lookup.propose(state).tokens.tolist() == [41, 42, 43, 44]
    state = state_of([40, 41, 5, 6, 40, 41])  # the text repeats (40 41 -> 5): the copy wins
    lookup.begin(state)
    assert lookup.propose(state).tokens.tolist() == [41, 5, 6, 40]
    state = state_of([7, 8, 9, 40, 41], budget=3)  # two tokens left after the root: no deeper draft
    lookup.begin(state)
    assert lookup.propose(state).tokens.tolist() == [41, 42, 43]
    plain = PromptLookup(torch.device("cpu"), num_tokens=3, max_ngram=2)
    state = state_of([7, 8, 9, 40, 41])
    plain.begin(state)
    assert plain.propose(state).tokens.tolist() == [41]


def test_hybrid_chains_from_a_table_keep_the_target_greedy_output_and_save_steps():
    model = tiny_model("llama")
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    heads = noisy_eagle(model)
    device = torch.device("cpu")
    vocab = model.config.vocab_size
    right = NgramTable.build([PROMPT + ref], vocab, min_count=1)  # the target's own answer
    junk = NgramTable.build([[random.Random(s).randrange(vocab) for _ in range(60)] for s in range(20)], vocab,
                            min_count=1)
    eng = Engine(model, heads=heads, proposer_config=DRAFTING)
    steps = {}
    for name, table in (("none", None), ("right", right), ("junk", junk)):
        size = DynamicTree(nodes=3, depth=2, topk=2)
        proposer = Hybrid(EagleProposer(heads, device, size=size),
                          PromptLookup(device, num_tokens=6, max_ngram=3, min_ngram=3, table=table), device)
        res = eng.generate(PROMPT, max_new_tokens=n, mode=proposer)
        assert res.tokens == ref, name
        steps[name] = len(res.stats.accepted)
    assert steps["right"] < steps["none"], steps


def test_a_heads_folder_carries_its_table_to_mode_hybrid_only(tmp_path):
    model = tiny_model("llama")
    heads = init_eagle_for(model)
    save_heads(heads, tmp_path)
    vocab = model.config.vocab_size
    NgramTable.build([[1, 2, 3, 4]] * 2, vocab).save(tmp_path / NGRAMS_NAME)
    loaded = load_heads(tmp_path, model)
    assert loaded.ngrams is not None and loaded.ngrams.chain([1, 2], 2) == [3, 4]
    device = torch.device("cpu")
    hybrid = make_proposer("hybrid", device, ProposerConfig(), heads=loaded)
    assert hybrid.lookup.table is loaded.ngrams
    assert make_proposer("hybrid", device, ProposerConfig(answer_ngrams=False), heads=loaded).lookup.table is None
    assert make_proposer("lookup", device, ProposerConfig(), heads=loaded).table is None  # lookup stays training-free
    NgramTable.build([[1, 2, 3]] * 2, vocab + 1).save(tmp_path / NGRAMS_NAME)
    with pytest.raises(MedusaError, match=f"built for a vocabulary of {vocab + 1} tokens"):
        load_heads(tmp_path, model)


def test_calibration_replays_hybrid_chains_with_the_heads_table():
    """Tree sizes for mode hybrid come from replayed decoding: with a table the chain joins the
    steps where the text has no match, and its right tokens are counted."""
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    ref = hf_greedy(model, PROMPT, 24)
    size = DynamicTree(nodes=2, depth=2, topk=2)
    plain = acceptance_by_size(heads, model, [(PROMPT, ref)], size, chain=4)
    heads.ngrams = NgramTable.build([PROMPT + ref], model.config.vocab_size, min_count=1)
    tabled = acceptance_by_size(heads, model, [(PROMPT, ref)], size, chain=4)
    assert tabled.accepted == plain.accepted  # the eagle tree alone is unchanged
    assert tabled.chain_share[4][2] > plain.chain_share[4][2]
    assert tabled.hybrid[4][0] > plain.hybrid[4][0]  # the chain alone: it copies the answer itself


def _answers_file(path: Path, answers: list[tuple[str, str]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, (q, a) in enumerate(answers):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": q},
                                                              {"role": "assistant", "content": a}]}) + "\n")
    return path


def test_build_ngrams_script_tables_the_answers_of_a_heads_folder(tmp_path, embedded):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_ngrams
    finally:
        sys.path.remove(str(REPO / "scripts"))
    model, tokenizer = embedded.model, embedded.tokenizer
    save_heads(init_eagle_for(model), tmp_path / "heads")
    answer = "Sure! Here is a short list of fruits: apples, pears and plums."
    data = _answers_file(tmp_path / "answers.jsonl.gz", [("Name fruits.", answer), ("List fruits.", answer)])
    assert build_ngrams.main(["--heads", str(tmp_path / "heads"), "--data", str(data)]) == 0
    table = NgramTable.load(tmp_path / "heads" / NGRAMS_NAME, model.config.vocab_size)
    assert table.sequences == 2
    # a fresh question's answer header is followed by the answer both examples began with
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Fruits?"}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    expected = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert table.chain(prompt, 6) == expected[:6]
    with pytest.raises(MedusaError, match="no assistant answers"):
        build_ngrams.main(["--heads", str(tmp_path / "heads"), "--data",
                           str(_answers_file(tmp_path / "empty.jsonl.gz", []))])
    with pytest.raises(MedusaError, match="not a heads folder"):
        build_ngrams.main(["--heads", str(tmp_path), "--data", str(data)])


def test_calibration_holds_out_only_prompts_outside_the_answer_files(tmp_path):
    from medusa.autotune.calibration import split_pool

    answered = _answers_file(tmp_path / "train.jsonl.gz", [("first  question", "a"), ("other", "b")])
    pool = [(f"sharegpt:{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}])
            for i, q in enumerate(["first question", "new one", "p1 text", "new two", "new three"])]
    pool[2] = ("sharegpt:p1", [{"role": "user", "content": "p1 text"}, {"role": "assistant", "content": "x"}])
    held_out, reference = split_pool(pool, 2, [str(answered)], "pool")
    assert [m[0]["content"] for _, m in held_out] == ["new one", "new two"]  # by text and by id
    assert [m[0]["content"] for _, m in reference] == ["first question", "p1 text", "new three"]
    with pytest.raises(MedusaError, match="only 3 conversations outside the --exclude files; need 4"):
        split_pool(pool, 4, [str(answered)], "pool")


def test_the_shipped_eagle_heads_carry_a_table_of_the_embedded_models_answers(embedded):
    heads = load_heads(REPO / "medusa/assets/heads/smollm2-135m-instruct-eagle", embedded.model)
    table = heads.ngrams
    assert table is not None and table.vocab_size == embedded.model.config.vocab_size
    assert table.sequences > 5000 and len(table) > 10000
    prompt = embedded.tokenizer.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}],
                                                    add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert len(table.chain(prompt, 8)) >= 1  # answers begin in ways the table has seen


def test_build_ngrams_defaults_to_the_embedded_models_answers_only(capsys):
    """data/selfdistill holds another target's answers too (Gemma 3 270M): the default data is the
    embedded model's own, and another target must name its answers."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_ngrams
    finally:
        sys.path.remove(str(REPO / "scripts"))
    default = build_ngrams.parse_args(["--heads", "h"]).data
    assert default and all(Path(p).name.startswith("smollm2-135m-instruct") for p in default)
    assert any(p.name.startswith("gemma3") for p in (REPO / "data" / "selfdistill").glob("*.jsonl.gz"))
    with pytest.raises(SystemExit):
        build_ngrams.parse_args(["--heads", "h", "--model", "other.gguf"])
    assert "--model needs --data" in capsys.readouterr().err


def test_build_ngrams_reads_answers_of_a_base_model_through_a_template_file(tmp_path):
    """A tokenizer without a chat template (a base model, as Gemma 3 270M) needs the template its
    answers were generated with: without it one line says so, with it the table learns them."""
    from train_fixtures import tiny_target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_ngrams
    finally:
        sys.path.remove(str(REPO / "scripts"))
    folder = tiny_target(tmp_path / "model")
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # a base model's tokenizer: no template
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(folder)
    assert not tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder)
    save_heads(init_eagle_for(model), tmp_path / "heads")
    answer = " one two three four five six"
    data = _answers_file(tmp_path / "answers.jsonl.gz", [("count", answer), ("please count", answer)])
    argv = ["--heads", str(tmp_path / "heads"), "--data", str(data), "--model", str(folder)]
    with pytest.raises(MedusaError, match="no chat template"):
        build_ngrams.main(argv)
    template = REPO / "configs" / "chat_templates" / "question_answer.jinja"
    assert build_ngrams.main([*argv, "--chat-template", str(template)]) == 0
    table = NgramTable.load(tmp_path / "heads" / NGRAMS_NAME, model.config.vocab_size)
    assert table.sequences == 2
    tok.chat_template = template.read_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": "count"}], add_generation_prompt=True, tokenize=False)
    expected = tok(answer, add_special_tokens=False)["input_ids"]
    assert table.chain(tok(prompt, add_special_tokens=False)["input_ids"], 4) == expected[:4]
