"""train/generate_selfdistill.py: batched answers appended to JSONL, resumable, and readable
as training data."""

import json

import pytest
from train_fixtures import tiny_target, write_counting_data

from medusa.errors import MedusaError
from medusa.training.sources import DataStats, load_conversations
from train.generate_selfdistill import main


def test_generates_resumes_and_feeds_training(tmp_path):
    model = tiny_target(tmp_path / "model")
    data = write_counting_data(tmp_path / "count.jsonl", 5)
    out = tmp_path / "sd.jsonl"
    args = ["--model", str(model), "--data", str(data), "--output", str(out), "--max-new-tokens", "6",
            "--batch-size", "2", "--device", "cpu"]
    assert main(args + ["--max-samples", "3"]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(first) <= 3
    for rec in first:
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
        assert rec["messages"][0]["content"].startswith("count from")
    # A second run over more prompts answers only the new ones.
    assert main(args) == 0
    second = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in second]
    assert ids[: len(first)] == [r["id"] for r in first] and len(ids) == len(set(ids))
    stats = DataStats()
    assert len(load_conversations(str(out), stats)) == len(second)


def test_greedy_answers_each_distinct_prompt_once(tmp_path, capsys):
    model = tiny_target(tmp_path / "model")
    data = tmp_path / "dup.jsonl"
    prompts = [f"count from {w} please" for w in ("one", "two", "one", "three", "two")]
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": p},
                                                                  {"role": "assistant", "content": "1 2"}]}) + "\n"
                            for i, p in enumerate(prompts)))
    out = tmp_path / "sd.jsonl"
    args = ["--model", str(model), "--data", str(data), "--output", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--device", "cpu"]
    assert main(args) == 0
    assert "duplicate_prompt=2" in capsys.readouterr().err
    assert main(args) == 0  # resumed: duplicates of answered prompts stay skipped too
    answered = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert answered and len(answered) == len(set(answered))


def test_a_later_turn_is_answered_after_the_conversation_before_it(tmp_path, capsys):
    model = tiny_target(tmp_path / "model")
    data = tmp_path / "turns.jsonl"
    convs = [[("user", "count from one"), ("assistant", "1 2 3"), ("user", "now from two"), ("assistant", "2 3"),
              ("user", "and from five"), ("assistant", "5 6")],
             [("system", "you count"), ("user", "count from six"), ("assistant", "6 7"), ("user", "from nine"),
              ("assistant", "9 10")],
             [("user", "count from ten"), ("assistant", "10 11")]]  # one turn: no second one to answer
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": r, "content": t} for r, t in conv]})
                            + "\n" for i, conv in enumerate(convs)))
    out = tmp_path / "sd.jsonl"
    args = ["--model", str(model), "--data", str(data), "--output", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--device", "cpu"]
    assert main(args + ["--turn", "2"]) == 0
    err = capsys.readouterr().err
    assert "fewer_turns=1" in err and "2 to go" in err
    second = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    assert set(second) <= {f"{data}:c0#turn2", f"{data}:c1#turn2"}  # (an empty answer is not kept)
    for messages in second.values():  # the dataset's turns before it, then the target's answer
        assert messages[-2]["content"] in ("now from two", "from nine") and messages[-1]["role"] == "assistant"
    if f"{data}:c0#turn2" in second:
        assert [m["content"] for m in second[f"{data}:c0#turn2"][:3]] == ["count from one", "1 2 3", "now from two"]
    assert main(args + ["--turn", "0"]) == 0  # each conversation's last turn: c0's third, c1's second, c2's first
    pending = 3 - (f"{data}:c1#turn2" in second)  # c1's second was answered above unless its answer was empty
    assert f"{pending} to go" in capsys.readouterr().err
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids))
    assert set(ids) <= {f"{data}:c0#turn2", f"{data}:c1#turn2", f"{data}:c0#turn3", f"{data}:c2"}


@pytest.mark.parametrize("flag, value, match", [
    ("--max-samples", "0", "max_samples=0 must be at least 1"),  # ran every prompt
    ("--batch-size", "0", "batch_size=0 must be at least 1"),  # a ValueError from range()
    ("--max-new-tokens", "0", "max_new_tokens=0 must be at least 1"),  # a transformers traceback per batch
    ("--temperature", "-1", "temperature=-1.0 must be at least 0"),  # generated greedily, silently
    ("--kernels", "mkl", "kernels='mkl' is not one of default, onednn, gemv"),
])
def test_bad_settings_are_one_line_errors_before_the_model_loads(flag, value, match, tmp_path):
    out = tmp_path / "sd.jsonl"
    with pytest.raises(MedusaError, match=match):
        main(["--model", str(tmp_path / "not-loaded"), "--output", str(out), flag, value])
    assert not out.exists()


def test_an_output_path_that_cannot_be_written_fails_before_the_model_loads(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MedusaError, match=r"cannot write the answers to .*a-file/sd.jsonl: .*pass --output"):
        main(["--model", str(tmp_path / "not-loaded"), "--output", str(blocker / "sd.jsonl")])


def test_a_run_that_fails_before_its_first_answer_leaves_no_empty_output(tmp_path):
    # the writability probe creates the file; a model that cannot load must not leave it behind
    # (an empty file would look like a started run to the next one and to the data tools)
    out = tmp_path / "new" / "sd.jsonl"
    with pytest.raises(MedusaError, match="model not found"):
        main(["--model", str(tmp_path / "no-such-model"), "--output", str(out)])
    assert not out.exists()
    kept = tmp_path / "kept.jsonl"
    kept.write_text('{"id": "a"}\n')  # an earlier run's answers stay as they are
    with pytest.raises(MedusaError, match="model not found"):
        main(["--model", str(tmp_path / "no-such-model"), "--output", str(kept)])
    assert kept.read_text() == '{"id": "a"}\n'
