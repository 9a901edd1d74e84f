"""Real `accelerate launch` runs of train/train_heads.py with 2 processes on CPU:
DDP over gloo, DeepSpeed ZeRO-2 from the repo's accelerate config, and ZeRO-3 (Medusa-1 and
Medusa-2 LoRA) with every parameter partitioned. Each trains a few steps on a tiny target and
must save heads that load; the ZeRO-3 outputs must score exactly as the trained model did.
train/train_draft.py runs the same loop under DDP."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import tiny_target, write_counting_data

import medusa
from medusa.models.heads_config import read_heads_config
from medusa.models.loader import load_heads
from medusa.models.target import load_target
from medusa.training.batches import collate
from medusa.training.data import build_datasets
from medusa.training.distributed import cpu_threads_warning, usable_cores
from medusa.training.heads_task import HeadsTrainer, summarise
from medusa.training.loop import TrainConfig

# compiles passes or launches processes: make test-all only (the fast tier skips it)
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    return {"model": str(tiny_target(root / "model")), "data": str(write_counting_data(root / "count.jsonl", 24))}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env() -> dict[str, str]:
    """The ranks' environment. DeepSpeed JIT-builds its CPU shared-memory collective op into
    TORCH_EXTENSIONS_DIR on first use; its build flags name this venv, so two checkouts
    sharing the default ~/.cache folder rebuild the .so under each other's running ranks.
    Each venv keeps its own build."""
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))}


def run_launch(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    # The rank that failed first is easy to lose in the launcher's tail: show its errors too,
    # Python's and native ones (a rank killed by a signal leaves no traceback).
    marks = ("Error", "terminate called", "what():", "Abort", "Assertion", "failed, errno", "Segmentation")
    errors = "\n".join(line for line in proc.stderr.splitlines() + proc.stdout.splitlines()
                       if any(m in line for m in marks))
    assert proc.returncode == 0, errors[-3000:] + "\n...\n" + proc.stderr[-2000:]
    return proc


def launch(setup, out, *launch_args, extra=()):
    cmd = [ACCELERATE, "launch", *launch_args, "--num_processes", "2", "--num_cpu_threads_per_process", "1",
           "--main_process_port", str(free_port()), str(ROOT / "train" / "train_heads.py"),
           "--model", setup["model"], "--data", setup["data"], "--max-length", "40", "--num-heads", "2",
           "--batch-size", "2", "--max-steps", "3", "--eval-fraction", "0.1", "--eval-every", "0",
           "--save-every", "2", "--output", str(out), "--wandb", "false", "--distill", "0.5", *extra]
    return run_launch(cmd)


def check_heads(setup, out):
    cfg = read_heads_config(out)
    assert cfg.num_heads == 2 and cfg.extra["steps"] == 3
    assert (out / "checkpoints" / "latest").read_text() == "step-0000002"
    engine = medusa.load(model=setup["model"], heads=str(out), device="cpu")
    assert engine.heads.num_heads == 2


@pytest.mark.peers
def test_ddp_two_processes_on_gloo(setup, tmp_path):
    out = tmp_path / "ddp"
    proc = launch(setup, out, "--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"))
    assert "2 process(es), MULTI_CPU" in proc.stderr
    check_heads(setup, out)


def test_deepspeed_zero2_two_processes(setup, tmp_path):
    out = tmp_path / "zero2"
    proc = launch(setup, out, "--config_file", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert "2 process(es), DEEPSPEED" in proc.stderr
    check_heads(setup, out)
    # DeepSpeed writes its own (sharded) checkpoint format next to our trainer record.
    assert any((out / "checkpoints" / "step-0000002").rglob("*optim_states*"))


def assert_resume_reaches_the_uninterrupted_result(setup, tmp_path, config, extra=()):
    """A run resumed from step 2's checkpoint (DeepSpeed's own, every rank writes its shards,
    plus the schedule and RNG states) ends with the folders the uninterrupted run saved."""
    full = tmp_path / "full"
    launch(setup, full, *config, extra=extra)
    ckpt = full / "checkpoints" / "step-0000002"
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    proc = launch(setup, resumed, *config, extra=(*extra, "--resume", "true"))
    assert "resumed from" in proc.stderr
    saved = sorted(p.relative_to(full) for p in full.rglob("model.safetensors") if "checkpoints" not in p.parts)
    assert saved and saved == sorted(p.relative_to(resumed) for p in resumed.rglob("model.safetensors")
                                     if "checkpoints" not in p.parts)
    for rel in saved:
        a, b = load_file(full / rel), load_file(resumed / rel)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), rel


@pytest.mark.peers
def test_deepspeed_zero2_resume_reaches_the_uninterrupted_result(setup, tmp_path):
    config = ("--config_file", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert_resume_reaches_the_uninterrupted_result(setup, tmp_path, config)


@pytest.mark.peers
def test_deepspeed_zero3_resume_reaches_the_uninterrupted_result(setup, tmp_path):
    """ZeRO-3 with every parameter partitioned, Medusa-2 (LoRA on the target): the resumed run
    saves the same heads and the same merged target."""
    config = ("--config_file", str(zero3_config(tmp_path)))
    lora = ("--lora", "true", "--lora-r", "4", "--lora-lr", "1e-2", "--lora-target-modules", "q_proj,v_proj")
    assert_resume_reaches_the_uninterrupted_result(setup, tmp_path, config, extra=lora)


def zero3_config(tmp_path: Path) -> Path:
    """The repo's ZeRO-3 setup with ``stage3_param_persistence_threshold: 0``, so that even
    the tiny model's parameters are partitioned (by default small ones stay whole)."""
    ds = json.loads((ROOT / "configs" / "deepspeed" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "zero3.json").write_text(json.dumps(ds))
    yaml = (ROOT / "configs" / "accelerate" / "deepspeed_zero3.yaml").read_text()
    (tmp_path / "zero3.yaml").write_text(yaml.replace("configs/deepspeed/zero3.json", str(tmp_path / "zero3.json")))
    return tmp_path / "zero3.yaml"


def rescore(setup, out: Path, target_dir: str) -> dict[str, float]:
    """Held-out head metrics of the saved target + heads, computed here on one CPU process
    the way the run's final evaluation computed them (same split, same single micro-batch)."""
    cfg = TrainConfig(model=target_dir, data=[setup["data"]], max_length=40, num_heads=2, eval_fraction=0.1,
                      distill=0.0, wandb=False)
    target, tokenizer = load_target(target_dir, device="cpu")
    splits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction,
                            cfg.data_seed, cfg.data_split, progress=False)
    assert len(splits.eval) <= cfg.batch_size  # one micro-batch, as in the run
    module = HeadsTrainer(load_heads(out, target, device="cpu", dtype=torch.float32), target, cfg).eval()
    with torch.no_grad():
        _, counts = module(collate(splits.eval, torch.device("cpu")))
    return summarise(counts)


def assert_saved_equals_trained(setup, out: Path, target_dir: str) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "eval" and r["step"] == 3][-1]
    saved = rescore(setup, out, target_dir)
    for key, value in saved.items():
        assert abs(value - trained[key]) < 2e-4, (key, value, trained[key])
    # ... and decode: the engine on the saved folders gives the saved target's own greedy output.
    engine = medusa.load(model=target_dir, heads=str(out), device="cpu")
    prompt = [4, 12, 13, 16]
    expected = engine.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert engine.generate(prompt, max_new_tokens=8, mode="medusa").tokens == expected.tolist()


@pytest.mark.peers
def test_deepspeed_zero3_medusa1_partitioned(setup, tmp_path):
    out = tmp_path / "z3m1"
    proc = launch(setup, out, "--config_file", str(zero3_config(tmp_path)), extra=("--distill", "0"))
    assert "2 process(es), DEEPSPEED" in proc.stderr
    check_heads(setup, out)
    assert_saved_equals_trained(setup, out, setup["model"])


@pytest.mark.peers
def test_deepspeed_zero3_medusa2_lora_partitioned(setup, tmp_path):
    out = tmp_path / "z3m2"
    proc = launch(setup, out, "--config_file", str(zero3_config(tmp_path)),
                  extra=("--distill", "0", "--lora", "true", "--lora-r", "4", "--lora-lr", "1e-2",
                         "--lora-target-modules", "q_proj,v_proj"))
    assert "2 process(es), DEEPSPEED" in proc.stderr
    check_heads(setup, out)
    tuned, original = load_file(out / "target" / "model.safetensors"), load_file(setup["model"] + "/model.safetensors")
    assert any(not torch.equal(original[k], tuned[k]) for k in original if "q_proj" in k)  # LoRA merged in
    assert_saved_equals_trained(setup, out, str(out / "target"))


def launch_draft(setup, out, *extra):
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"), "--num_processes",
           "2", "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
           str(ROOT / "train" / "train_draft.py"), "--model", setup["model"], "--data", setup["data"],
           "--max-length", "40", "--draft-layers", "1", "--batch-size", "2", "--max-steps", "3", "--eval-fraction", "0.2",
           "--eval-every", "0", "--save-every", "2", "--lr", "0.01", "--output", str(out), "--wandb", "false", *extra]
    return run_launch(cmd)


@pytest.mark.peers
def test_draft_ddp_two_processes_checkpoints_resumes_and_loads(setup, tmp_path):
    """The draft runs the same loop: 2 processes, a checkpoint, evaluation split over both,
    and a resumed run (state loaded, batches skipped on both processes) ends where the
    uninterrupted one did."""
    out = tmp_path / "draft"
    proc = launch_draft(setup, out)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    record = json.loads((out / "draft_training.json").read_text())
    assert record["steps"] == 3 and record["eval_before"]["positions"] == record["eval_after"]["positions"] > 0
    assert (out / "checkpoints" / "latest").read_text() == "step-0000002"
    ckpt = out / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in ckpt.glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]  # every process's RNG state, written before the rename
    engine = medusa.load(model=setup["model"], draft=str(out), device="cpu", draft_tokens=2)
    assert engine.draft.config.num_hidden_layers == 1
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    launch_draft(setup, resumed, "--resume", "true")
    a, b = load_file(out / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_one_process_cpu_launch_left_on_one_thread_says_how_to_use_every_core(setup, tmp_path):
    """`accelerate launch` with the repo's single-process config sets OMP_NUM_THREADS=1 when the
    variable is unset (the config serves CPUs and GPUs, so it has no use_cpu): a CPU run then
    trains on one core of many. The run says so and names the flag; told the thread count, it
    is quiet. Which branch applies depends on the cores this process may use."""
    env = {k: v for k, v in launch_env().items() if k != "OMP_NUM_THREADS"}

    def run(*threads):
        cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "configs" / "accelerate" / "single.yaml"), *threads,
               str(ROOT / "train" / "train_heads.py"), "--model", setup["model"], "--data", setup["data"],
               "--max-length", "40", "--num-heads", "1", "--batch-size", "2", "--max-steps", "1", "--eval-fraction",
               "0.1", "--eval-every", "0", "--save-every", "0", "--output", str(tmp_path / f"out{len(threads)}"),
               "--wandb", "false"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    cores = usable_cores()
    if cores >= 2:
        assert f"--num_cpu_threads_per_process {cores}" in run()
    else:
        assert "training on 1 CPU thread" not in run()
    assert "training on 1 CPU thread" not in run("--num_cpu_threads_per_process", str(max(cores, 2)))


def test_cpu_threads_warning_only_for_a_cpu_run_on_one_thread_of_several():
    warn = cpu_threads_warning("cpu", 1, "1", 8, 1)
    assert "of 8 usable" in warn and "--num_cpu_threads_per_process 8" in warn and "OMP_NUM_THREADS=8" in warn
    assert "--num_cpu_threads_per_process 4" in cpu_threads_warning("cpu", 1, "1", 8, 2)  # two ranks share 8 cores
    assert cpu_threads_warning("cuda", 1, "1", 8, 1) is None
    assert cpu_threads_warning("cpu", 4, "4", 8, 1) is None  # told the count
    assert cpu_threads_warning("cpu", 1, None, 8, 1) is None  # torch.set_num_threads by the user, not the launcher
    assert cpu_threads_warning("cpu", 1, "1", 2, 2) is None  # one core per rank: nothing to gain
