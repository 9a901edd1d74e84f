"""Data: salvaging cut-off files, counting bad records, chat-template loss masks."""

import gzip
import json

import pytest
from train_fixtures import counting_conversation, make_tokenizer

from medusa.errors import MedusaError
from medusa.training.data import (
    DataStats,
    build_datasets,
    load_conversations,
    normalize,
    read_json_file,
    salvage_json_array,
    sharegpt_path,
    tokenize_conversation,
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
