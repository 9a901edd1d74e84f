"""What generate accepts as a prompt: token lists, tensors, and a tokenizer's own output."""

import runpy
import sys
from pathlib import Path

import pytest
import torch
from tiny import hf_greedy, tiny_model
from tiny_heads import word_tokenizer

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError


def test_a_tokenizer_output_is_a_prompt():
    model = tiny_model("llama")
    eng = Engine(model, word_tokenizer())
    text = "w5 w17 w33 w9 w41"
    ids = eng.tokenizer(text)["input_ids"]
    ref = hf_greedy(model, ids, 12)
    assert eng.generate(eng.tokenizer(text), max_new_tokens=12, mode="baseline").tokens == ref
    assert eng.generate(eng.tokenizer(text, return_tensors="pt"), max_new_tokens=12, mode="baseline").tokens == ref
    assert eng.generate(torch.tensor([ids]), max_new_tokens=12, mode="baseline").tokens == ref
    with pytest.raises(MedusaError, match="batch size 2"):
        eng.generate(eng.tokenizer([text, text]), max_new_tokens=4)
    with pytest.raises(MedusaError, match="without an 'input_ids'"):
        eng.generate({"ids": ids}, max_new_tokens=4)


def test_text_or_non_integer_prompts_get_a_one_line_error():
    eng = Engine(tiny_model("llama"), word_tokenizer())
    with pytest.raises(MedusaError, match="token ids, not text: encode it first"):
        eng.generate("w5 w17 w33", max_new_tokens=4)
    with pytest.raises(MedusaError, match="got list holding str"):
        eng.generate(["w5", "w17"], max_new_tokens=4)


@pytest.mark.parametrize("flag", ["--limit", "--per-category", "--max-new-tokens", "--draft-tokens", "--lookup-tokens",
                                  "--lookup-ngram"])
def test_bench_counts_below_one_are_a_one_line_error(flag, capsys):
    # --limit 0 used to run every prompt, and --max-new-tokens -5 ended in a transformers traceback
    from infer import bench

    with pytest.raises(SystemExit) as exit_:
        bench.parse_args([flag, "0"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err
    assert getattr(bench.parse_args([flag, "3"]), flag[2:].replace("-", "_")) == 3


@pytest.mark.parametrize("script, flag", [("scripts/calibrate_tree.py", "--max-nodes"),  # computed 30 min, then failed
                                          ("scripts/calibrate_tree.py", "--samples"),
                                          ("scripts/heldout_prompts.py", "--samples"),
                                          ("scripts/vllm_check.py", "--max-new-tokens"),
                                          ("infer/chat.py", "--max-new-tokens"),
                                          ("infer/chat.py", "--max-context")])
def test_cli_counts_below_one_are_usage_errors(script, flag, monkeypatch, capsys):
    extra = ["--heads", "unused"] if "calibrate" in script else ["--output", "unused.json"] if "heldout" in script else []
    assert run_script(script, [*extra, flag, "0"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be at least 1, got 0" in err, err[-500:]
    assert "Traceback" not in err


def run_script(script: str, args: list[str], monkeypatch) -> int:
    """``python SCRIPT ARGS`` in this process (as its ``__main__``): its exit status. The command
    lines themselves run as processes in tests/test_cli.py; here only what they answer matters."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "argv", [str(root / script), *args])
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str((root / script).parent))
    try:
        runpy.run_path(str(root / script), run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
        return 1
    return 0


@pytest.mark.parametrize("device, message", [("gpu0", "unknown device 'gpu0'"),
                                             ("cuda:99", "device 'cuda:99' is not available")])
def test_a_device_torch_cannot_use_is_a_one_line_error(device, message):
    # --device cuda on a CPU-only torch used to end in torch's AssertionError from its CUDA init
    from medusa.models.target import load_target, resolve_device

    with pytest.raises(MedusaError, match=message):
        resolve_device(device)
    with pytest.raises(MedusaError, match=message):
        load_target("unused: the device is checked first", device=device)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("flag", ["--json", "--output"])
def test_bench_output_that_cannot_be_written_fails_before_the_run(flag, tmp_path, capsys):
    # it used to end in a FileNotFoundError traceback after the whole run, its results lost
    from infer import bench

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "sub" / ("bench.json" if flag == "--json" else "report")
    assert bench.main(["--model", str(tmp_path / "never-loaded"), "--modes", "baseline", flag, str(target)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: cannot create") and "writable path" in err[0]


@pytest.mark.parametrize("script", ["scripts/export_heads.py", "scripts/heldout_prompts.py"])
def test_script_output_that_cannot_be_written_is_a_one_line_error(script, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["medusa/assets/heads/smollm2-135m-instruct", "--to", "vllm"] if "export" in script else []
    assert run_script(script, [*args, "--output", str(blocker / "sub" / "out")], monkeypatch) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-800:]
    assert err.strip().splitlines()[-1] == (f"error: --output: cannot create {blocker / 'sub'}: Not a directory; "
                                            "pass a writable path")
