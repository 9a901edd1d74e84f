"""Data: salvaging cut-off files, counting bad records, chat-template loss masks."""

import gzip
import json
import random

import pytest
from train_fixtures import WORDS, counting_conversation, make_tokenizer

from medusa.errors import MedusaError
from medusa.training.data import build_datasets, resolve_num_proc, tokenise, tokenize_conversation
from medusa.training.sources import (
    DataStats,
    load_conversations,
    normalize,
    read_json_file,
    salvage_json_array,
    sharegpt_path,
)


def _sharegpt(i, turns=("human", "gpt")):
    return {"id": f"r{i}", "conversations": [{"from": r, "value": f"{r} says {i}"} for r in turns]}


def test_truncated_array_is_salvaged_and_counted(tmp_path):
    records = [_sharegpt(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"r4"') + 30]  # cut in the middle of the last record
    stats = DataStats()
    got = list(salvage_json_array(cut, stats))
    assert [r["id"] for r in got] == ["r0", "r1", "r2", "r3"]
    assert stats["recovered"] == 4 and stats["dropped"] == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)


def test_broken_record_in_the_middle_costs_only_itself(tmp_path):
    good = [json.dumps(_sharegpt(i)) for i in range(4)]
    text = "[" + ", ".join(good[:2]) + ', {"id": "bad", "conversations": [nope]}, ' + ", ".join(good[2:]) + "]"
    stats = DataStats()
    got = list(salvage_json_array(text, stats))
    assert [r["id"] for r in got] == ["r0", "r1", "r2", "r3"]
    assert stats["dropped"] == 1


def test_jsonl_with_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_sharegpt(0)) + "\n{not json\n\n" + json.dumps(_sharegpt(1)) + "\n")
    stats = DataStats()
    assert len(list(read_json_file(path, stats))) == 2
    assert stats["dropped"] == 1


def test_gzipped_jsonl_is_read_like_jsonl(tmp_path):
    # the shipped self-distillation answers are committed as .jsonl.gz
    path = tmp_path / "answers.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps(_sharegpt(0)) + "\n{cut off\n" + json.dumps(_sharegpt(1)) + "\n")
    stats = DataStats()
    convs = load_conversations(str(path), stats)
    assert sorted(rid for rid, _ in convs) == ["r0", "r1"]
    assert stats["dropped"] == 1 and stats["recovered"] == 2


def test_normalize_reasons():
    assert normalize(_sharegpt(0))[1] == "kept"
    assert normalize({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})[1] == "kept"
    assert normalize("a string")[1] == "malformed"
    assert normalize({"conversations": "x"})[1] == "malformed"
    assert normalize({"conversations": [{"from": "human"}]})[1] == "malformed"
    assert normalize({"conversations": []})[1] == "empty"
    assert normalize(_sharegpt(0, ("human",)))[1] == "empty"
    assert normalize(_sharegpt(0, ("human", "alien")))[1] == "wrong_role"
    assert normalize(_sharegpt(0, ("human", "human", "gpt")))[1] == "wrong_role"
    msgs, reason = normalize(_sharegpt(0, ("gpt", "human", "gpt", "human")))
    assert reason == "trimmed" and [m["role"] for m in msgs] == ["user", "assistant"]
    msgs, _ = normalize({"conversations": [{"from": "system", "value": "be nice"}, *_sharegpt(1)["conversations"]]})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    empty_answer = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}
    assert normalize(empty_answer)[1] == "empty"


def test_loss_mask_covers_exactly_the_assistant_turns():
    tok = make_tokenizer()
    conv = counting_conversation(2, 4)["messages"]
    conv = conv + [{"role": "user", "content": "ok please"}, {"role": "assistant", "content": "ten eleven"}]
    ex = tokenize_conversation(tok, conv, 200)
    masked = [t for t, m in zip(tok.convert_ids_to_tokens(ex.input_ids), ex.loss_mask) if m]
    assert masked == ["two", "three", "four", "five", "<|im_end|>", "ten", "eleven", "<|im_end|>"]
    assert ex.input_ids == tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    short = tokenize_conversation(tok, conv, 12)
    assert len(short) == 12 and sum(short.loss_mask) == 3  # truncated inside the first answer
    assert tokenize_conversation(tok, conv, 8) is None  # nothing to learn left


def test_embedded_tokenizer_masks_assistant_text():
    from transformers import AutoTokenizer

    from medusa.models.target import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is a colour."}]
    ex = tokenize_conversation(tok, conv, 512)
    text = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert text.startswith("Blue is a colour.") and "Name a colour" not in text


def test_packing_is_refused_with_the_reason(tmp_path):
    # packed rows let attention cross conversations: an old config asking for it gets one line
    from medusa.config import TrainConfig, from_dict

    with pytest.raises(MedusaError, match="pack was removed .*cross conversations.*delete it") as err:
        from_dict(TrainConfig, {"pack": True}, "old.yaml")
    assert "\n" not in str(err.value)

def test_build_datasets_splits_and_counts(tmp_path):
    path = tmp_path / "mix.jsonl"
    rows = [counting_conversation(i % 12, 5) for i in range(20)] + [{"messages": []}, {"oops": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{truncated")
    splits = build_datasets(make_tokenizer(), [str(path)], 64, eval_fraction=0.1, seed=1)
    assert len(splits.train) == 18 and len(splits.eval) == 2
    assert splits.stats["kept"] == 20 and splits.stats["empty"] == 1 and splits.stats["malformed"] == 1
    assert splits.stats["dropped"] == 1
    with pytest.raises(MedusaError, match="neither"):
        build_datasets(make_tokenizer(), ["not-a-source"], 64)


def test_real_sharegpt_file_is_truncated_and_salvaged():
    path = sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    stats = DataStats()
    convs = load_conversations("sharegpt", stats)
    assert stats["recovered"] > 17000 and stats["dropped"] >= 1
    assert len(convs) == stats["kept"] + stats["trimmed"] > 15000
    assert stats["recovered"] == sum(stats[k] for k in ("kept", "trimmed", "empty", "malformed", "wrong_role"))


# -- tokenising through datasets.map, cached -------------------------------------------------

def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _varied_records(n: int, seed: int = 0) -> list:
    """Multi-turn, system prompts, answers cut by max_length, questions so long that no answer
    token is left, trimmed ShareGPT parts, and records that are dropped."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        kind = i % 6
        turns = [{"role": "user", "content": _words(rng, 3)}, {"role": "assistant", "content": _words(rng, 5)}]
        if kind == 1:
            turns = [{"role": "system", "content": _words(rng, 4)}] + turns * 2
        elif kind == 2:
            turns[1]["content"] = _words(rng, 120)  # truncated inside the answer
        elif kind == 3:
            turns[0]["content"] = _words(rng, 200)  # nothing of the answer left
        elif kind == 4:
            turns = [{"role": "assistant", "content": "nine"}] + turns + [{"role": "user", "content": "ok"}]
        elif kind == 5:
            turns = turns * 3
        records.append({"id": f"c{i}", "messages": turns})
    return records + [{"oops": 1}, {"messages": []}, {"messages": [{"role": "alien", "content": "x"}]}]


def _old_build_datasets(tokenizer, source, max_length, eval_fraction, seed):
    """build_datasets as it was before datasets.map: one tokenize_conversation call per conversation."""
    stats = DataStats()
    convs = load_conversations(source, stats, seed=seed)
    n_eval = max(1, round(len(convs) * eval_fraction))
    tokenised = []
    for _, messages in convs:
        ex = tokenize_conversation(tokenizer, messages, max_length)
        if ex is None:
            stats.add("no_assistant_tokens")
            continue
        tokenised.append(ex)
    return tokenised[n_eval:], tokenised[:n_eval], stats


def _embedded_tokenizer():
    from transformers import AutoTokenizer

    from medusa.models.target import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.mark.parametrize("which", ["word_level", "smollm2"])
def test_mapped_rows_equal_the_per_conversation_function(tmp_path, which):
    tok = make_tokenizer() if which == "word_level" else _embedded_tokenizer()
    path = tmp_path / "varied.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _varied_records(60)) + "\n{cut off")
    train, evals, stats = _old_build_datasets(tok, str(path), 64, 0.1, seed=5)
    assert stats["no_assistant_tokens"] > 0 and stats["trimmed"] > 0 and stats["malformed"] == 1
    assert any(len(ex) == 64 for ex in train) and any(len(ex) < 64 for ex in train)
    for num_proc in (1, 2):
        splits = build_datasets(tok, [str(path)], 64, eval_fraction=0.1, seed=5, num_proc=num_proc,
                                cache_dir=tmp_path / f"rows{num_proc}")
        assert splits.train == train and splits.eval == evals
        assert splits.stats.counts == stats.counts


def test_rows_are_cached_and_keyed_on_tokenizer_template_and_max_length(tmp_path, monkeypatch):
    import medusa.training.data as data

    tok = make_tokenizer()
    convs = [normalize(r)[0] for r in _varied_records(12)[:12]]
    cache = tmp_path / "rows"
    first = tokenise(tok, convs, 40, num_proc=2, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 2  # one Arrow file per worker

    def no_tokenising(*args):
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(data, "tokenize_conversation", no_tokenising)
    assert tokenise(tok, convs, 40, num_proc=1, cache_dir=cache) == first  # read back, any num_proc
    assert sorted(p.name for p in cache.iterdir()) == files
    monkeypatch.undo()

    shorter = tokenise(tok, convs, 24, num_proc=1, cache_dir=cache)
    assert shorter != first and max(len(ex) for ex in shorter if ex) == 24
    tok.chat_template = tok.chat_template.replace("m['content']", "'ok ' + m['content']")
    other_template = tokenise(tok, convs, 40, num_proc=1, cache_dir=cache)
    assert other_template != first
    tok.add_tokens(["twelve"])  # another vocabulary: another tokenizer
    tokenise(tok, convs, 40, num_proc=1, cache_dir=cache)
    assert len(list(cache.iterdir())) == len(files) + 3


def test_template_errors_in_workers_are_one_line_medusa_errors(tmp_path):
    tok = make_tokenizer()
    convs = [counting_conversation(i, 3)["messages"] for i in range(4)]
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %} end{% endif %}{% endfor %}"
    with pytest.raises(MedusaError, match="prefix by prefix") as err:
        tokenise(tok, convs, 40, num_proc=2, cache_dir=tmp_path)
    assert "\n" not in str(err.value)
    tok.chat_template = None
    with pytest.raises(MedusaError, match="no chat template"):
        tokenise(tok, convs, 40, num_proc=2, cache_dir=tmp_path)


def test_num_proc_is_automatic_for_large_data_only():
    assert resolve_num_proc(None, 100) == 1
    assert 1 <= resolve_num_proc(None, 10**6) <= 8
    assert resolve_num_proc(3, 100) == 3
    with pytest.raises(MedusaError, match="num_proc must be at least 1"):
        resolve_num_proc(0, 100)
