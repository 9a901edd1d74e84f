"""``compile="auto"``: saved compiled passes where this machine has them, eager passes elsewhere,
never a compilation inside the process; ``python -m infer.precompile`` saves the missing ones,
and the chat starts it in the background."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import hf_greedy, tiny_model
from train_fixtures import tiny_target

from medusa.decoding.engine import Engine
from medusa.decoding.passes import saved as compiled
from medusa.decoding.plan import Plan
from medusa.models.target import load_target
from medusa.runtime import hf as kv

# compiles passes or launches processes: make test-all only (the fast tier skips it)
pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 33, 9, 41, 12]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "medusa-cache"
    monkeypatch.setenv("MEDUSA_CACHE", str(folder))
    return folder


def precompile_cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infer.precompile", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_auto_runs_saved_sizes_compiled_the_others_eagerly_and_picks_up_what_a_build_saves(tmp_path, cache, monkeypatch):
    folder = tiny_target(tmp_path / "target")
    model = load_target(str(folder), device="cpu", dtype="float32")[0]
    threads = torch.get_num_threads()
    n = 16
    prompt = [t % model.config.vocab_size for t in PROMPT]
    ref = hf_greedy(model, prompt, n)

    eng = Engine(model, compile="auto")
    assert eng.passes.name == "auto"
    assert eng.unsaved_passes("baseline") == [1]
    assert eng.precompile("baseline") == [1]  # nothing saved: nothing loaded, nothing compiled
    res = eng.generate(prompt, max_new_tokens=n, mode="baseline")
    assert res.tokens == ref and not kv.is_static(res.state.cache)  # the eager engine, dynamic cache and all
    saved = eng.passes.saved
    assert saved.traced == [] and saved.loaded == [] and saved.fallback is None
    assert not saved.path(1).exists()

    # the builder, as the chat starts it: same kernels and thread count, so the same file
    built = precompile_cli(["--model", str(folder), "--sizes", "1", "--kernels", eng.kernels, "--threads", str(threads)])
    assert built.returncode == 0, built.stderr[-2000:]
    assert re.search(r"saved 1 pass size in [\d.]+ s", built.stdout), built.stdout
    assert saved.path(1).is_file() and not saved.lock_path().exists()

    # the running engine picks the file up once it looks again (every RECHECK_S seconds)
    monkeypatch.setattr(compiled, "RECHECK_S", 0.0)
    turn = prompt + ref + [3]  # a chat's next turn, its cache from the eager generation before
    cont = eng.generate(turn, max_new_tokens=n, mode="baseline", state=res.state)
    assert cont.tokens == Engine(model).generate(turn, max_new_tokens=n, mode="baseline").tokens
    assert kv.is_static(cont.state.cache) and cont.stats.prefill_tokens == len(turn)  # the dynamic cache is not reused
    res = eng.generate(prompt, max_new_tokens=n, mode="baseline")
    assert res.tokens == ref and kv.is_static(res.state.cache)
    assert saved.loaded == [1] and saved.traced == []
    assert eng.unsaved_passes("baseline") == []
    later = Engine(load_target(str(folder), device="cpu", dtype="float32")[0], compile="auto")
    assert later.unsaved_passes("baseline") == []
    later.precompile("baseline")
    assert later.passes.saved.loaded == [1] and later.passes.saved.traced == []
    assert later.generate(prompt, max_new_tokens=n, mode="baseline").tokens == ref

    again = precompile_cli(["--model", str(folder), "--sizes", "1", "--kernels", eng.kernels, "--threads", str(threads)])
    assert again.returncode == 0 and "is saved already" in again.stdout


def test_a_second_build_leaves_the_passes_to_the_live_one_holding_the_lock(tmp_path, cache):
    folder = tiny_target(tmp_path / "target")
    eng = Engine(load_target(str(folder), device="cpu", dtype="float32")[0], compile="auto")
    lock = eng.passes.saved.lock_path()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(str(holder.pid))
        assert compiled.build_lock(lock) == holder.pid
        out = precompile_cli(["--model", str(folder), "--sizes", "1", "--kernels", eng.kernels,
                              "--threads", str(torch.get_num_threads())], timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"another process (pid {holder.pid}) is compiling" in out.stdout
        assert not eng.passes.saved.path(1).exists()  # it compiled nothing
    finally:
        holder.kill()
        holder.wait()
    assert compiled.build_lock(lock) is None  # a dead holder's lock is taken over
    assert lock.read_text() == str(os.getpid())


def test_auto_compiles_on_the_cpu_in_either_dtype_and_exact_where_half(cache):
    half = Engine(tiny_model("llama").to(torch.bfloat16), compile="auto")
    assert half.passes.name == "auto" and half.exact and half.passes.saved is not None
    assert half.unsaved_passes("baseline") == [1]  # nothing saved in this cache: eager until precompiled
    exact = Engine(tiny_model("llama"), compile="auto", plan=Plan(exact=True))
    assert exact.passes.name == "auto" and exact.exact
    assert Engine(tiny_model("llama"), compile=False).passes.name == "eager"


@pytest.mark.parametrize("sizes", ["0", "x", "1,,-2"])
def test_precompile_sizes_are_checked_before_anything_loads(sizes):
    out = precompile_cli(["--sizes", sizes], timeout=60)
    assert out.returncode == 2 and "--sizes" in out.stderr and "Traceback" not in out.stderr


def test_the_chat_compiles_in_the_background_and_a_later_start_loads_the_passes(tmp_path, cache):
    import pexpect
    from test_chat import PROMPT as CHAT_PROMPT
    from test_chat import ask, chat_env

    folder = tiny_target(tmp_path / "target")
    env = {**chat_env(tmp_path), "MEDUSA_COMPILE": "auto"}  # the chat's own default (conftest turns it off)
    args = ["--model", str(folder), "--mode", "baseline", "--max-new-tokens", "12", "--dtype", "float32"]

    def chat() -> pexpect.spawn:
        return pexpect.spawn(sys.executable, ["-m", "infer.chat", *args], cwd=str(REPO), env=env, encoding="utf-8",
                             timeout=300, dimensions=(50, 250))

    first = chat()
    first.expect(r"compiled passes: size 1 not saved on this machine yet, so eager for now; compiling them in the "
                 r"background at low priority \(pid (\d+), log ([^)]+)\)")
    log = Path(first.match.group(2))
    first.expect_exact(CHAT_PROMPT)
    eager_answer, _ = ask(first, "count from three please")
    first.sendline("/exit")
    first.expect(pexpect.EOF)

    deadline = time.monotonic() + 300  # the build outlives the chat that started it
    while time.monotonic() < deadline and not re.search(r"saved 1 pass size|error", log.read_text()):
        time.sleep(1)
    text = log.read_text()
    assert "saved 1 pass size" in text, text[-2000:]
    assert not list(cache.glob("compiled/build-*.lock"))  # the build let go of its lock

    second = chat()
    second.expect(r"compiled passes: size 1 loaded in [\d.]+ s")
    second.expect_exact(CHAT_PROMPT)
    assert "not saved" not in second.before
    compiled_answer, _ = ask(second, "count from three please")
    second.sendline("/exit")
    second.expect(pexpect.EOF)
    assert compiled_answer == eager_answer and compiled_answer

    one_shot = subprocess.run([sys.executable, "-m", "infer.chat", *args, "--prompt", "count from three please"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one_shot.returncode == 0, one_shot.stderr
    assert "compiled passes" not in one_shot.stderr  # one answer stays eager
