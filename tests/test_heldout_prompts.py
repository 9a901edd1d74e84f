"""scripts/heldout_prompts.py: prompts outside the training answers, read back by the bench."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from medusa.bench.prompts import read_prompts
from medusa.errors import MedusaError

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("heldout_prompts", ROOT / "scripts" / "heldout_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _conversation(cid: str, question: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "an answer"}]}


@pytest.fixture
def files(tmp_path):
    source = tmp_path / "sharegpt.json"
    questions = [f"question number {i} about something" for i in range(12)]
    records = [_conversation(f"c{i}_0", q) for i, q in enumerate(questions)]
    records.append(_conversation("dup_0", "question   number 3 about\nsomething"))  # id unseen, text trained on
    records.append(_conversation("short_0", "hi"))
    source.write_text(json.dumps(records))
    train = tmp_path / "train.jsonl.gz"
    with gzip.open(train, "wt") as f:
        for i in (0, 1, 2):  # by id
            f.write(json.dumps({"id": f"sharegpt:c{i}_0", "messages": [
                {"role": "user", "content": "renamed"}, {"role": "assistant", "content": "a"}]}) + "\n")
        f.write(json.dumps({"id": "sharegpt:other_9", "messages": [  # by text
            {"role": "user", "content": questions[3]}, {"role": "assistant", "content": "a"}]}) + "\n")
    return source, train, questions


def test_picks_only_prompts_outside_the_training_files(files, tmp_path):
    source, train, questions = files
    out = tmp_path / "out" / "heldout.json"
    _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "8", "--output", str(out)])
    prompts = read_prompts(out)
    texts = [p.text for p in prompts]
    assert len(texts) == 8 and len(set(texts)) == 8
    assert set(texts) <= set(questions[4:])  # 0-2 excluded by id, 3 by text (and its respaced copy), "hi" too short
    again = tmp_path / "again.json"
    _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "8", "--output", str(again)])
    assert again.read_text() == out.read_text()  # the seed fixes the pick
    other = tmp_path / "other.json"
    _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "8", "--seed", "7", "--output", str(other)])
    assert [p.text for p in read_prompts(other)] != texts


def test_too_few_prompts_is_one_clear_error(files, tmp_path):
    source, train, _ = files
    with pytest.raises(MedusaError, match="only 8 prompts.*lower --samples"):
        _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "20", "--output", str(tmp_path / "x.json")])
    with pytest.raises(MedusaError, match="--exclude file not found"):
        _script().main(["--prompts", str(source), "--exclude", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "x.json")])


def test_wrap_writes_the_same_picks_inside_a_text_template(files, tmp_path, capsys):
    source, train, _ = files
    plain, wrapped = tmp_path / "plain.json", tmp_path / "qa.json"
    _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "5", "--output", str(plain)])
    _script().main(["--prompts", str(source), "--exclude", str(train), "--samples", "5", "--output", str(wrapped),
                    "--wrap", "Question: {prompt}\\nAnswer:"])
    assert [p.text for p in read_prompts(wrapped)] == [f"Question: {p.text}\nAnswer:" for p in read_prompts(plain)]
    with pytest.raises(SystemExit):
        _script().main(["--prompts", str(source), "--output", str(tmp_path / "x.json"), "--wrap", "Question:"])
    assert "must hold {prompt} once" in capsys.readouterr().err
