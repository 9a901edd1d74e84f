"""The llama.cpp peer's failures, each one line, without llama.cpp installed (fast)."""

from __future__ import annotations

import logging
import sys

import pytest

from infer import bench
from medusa.errors import MedusaError
from medusa.peers import llamacpp_client
from medusa.peers.llamacpp_client import LlamaCppWorker, llamacpp_python


def test_a_missing_llamacpp_python_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDUSA_LLAMACPP_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(MedusaError, match="MEDUSA_LLAMACPP_PYTHON") as err:
        llamacpp_python()
    assert "\n" not in str(err.value)


def test_a_python_without_llama_cpp_fails_with_the_worker_s_reason(tmp_path):
    # This project's own venv has no llama_cpp: the worker starts, fails to import it, and the
    # client reports why in one line instead of waiting for a reply.
    with pytest.raises(MedusaError, match="No module named 'llama_cpp'") as err:
        LlamaCppWorker(tmp_path / "model.gguf", 1, python=sys.executable, startup_timeout=120)
    assert "\n" not in str(err.value) and "worker exited" in str(err.value)


def test_a_stamp_for_another_version_means_the_venv_is_built_again(tmp_path, caplog):
    venv = tmp_path / "venv"
    venv.mkdir()
    assert not llamacpp_client._stamped(venv)  # no stamp: an unfinished build
    (venv / llamacpp_client._STAMP).write_text("llama-cpp-python==0.1.0\n")
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        assert not llamacpp_client._stamped(venv)
    assert "rebuilding" in caplog.text and not (venv / llamacpp_client._STAMP).exists()
    (venv / llamacpp_client._STAMP).write_text(llamacpp_client.LLAMACPP_PACKAGE + "\n")
    assert llamacpp_client._stamped(venv)


@pytest.mark.parametrize(("extra", "expected"), [
    (["--dtype", "bfloat16"], "the llamacpp modes decode in float32 (an F32 GGUF); drop --dtype bfloat16"),
    ([], "llama.cpp reads GGUF files and"),
])
def test_the_bench_refuses_what_llama_cpp_cannot_run_in_one_line(tmp_path, capsys, extra, expected):
    from train_fixtures import tiny_target

    folder = tiny_target(tmp_path / "model")  # a safetensors folder, not a GGUF file
    argv = ["--model", str(folder), "--limit", "1", "--max-new-tokens", "4", "--modes", "hf,llamacpp",
            "--autotune", "off", *extra]
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    assert expected in line and (extra or "convert_hf_to_gguf.py" in line)
