"""Real `accelerate launch` runs of train/train_heads.py with 2 processes on CPU:
DDP over gloo, and DeepSpeed ZeRO-2 from the repo's accelerate config. Each trains a few
steps on a tiny target and must save heads that load."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from train_fixtures import tiny_target, write_counting_data

import medusa
from medusa.heads import read_heads_config

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


def launch(setup, out, *launch_args, extra=()):
    cmd = [ACCELERATE, "launch", *launch_args, "--num_processes", "2", "--num_cpu_threads_per_process", "1",
           "--main_process_port", str(free_port()), str(ROOT / "train" / "train_heads.py"),
           "--model", setup["model"], "--data", setup["data"], "--max_length", "40", "--num_heads", "2",
           "--batch_size", "2", "--max_steps", "3", "--eval_fraction", "0.1", "--eval_every", "0",
           "--save_every", "2", "--output_dir", str(out), "--wandb", "false", "--distill", "0.5", *extra]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_heads(setup, out):
    cfg = read_heads_config(out)
    assert cfg.num_heads == 2 and cfg.extra["steps"] == 3
    assert (out / "checkpoints" / "latest").read_text() == "step-0000002"
    engine = medusa.load(model=setup["model"], heads=str(out), device="cpu")
    assert engine.heads.num_heads == 2


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
