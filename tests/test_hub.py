"""Publishing heads (dry-run folder, model card, token handling) and loading them back from a
folder or a Hub id resolved through a real Hugging Face cache folder."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import scan_cache_dir
from safetensors.torch import load_file
from tiny import DRAFTING
from tiny_heads import PROMPT, REPO, random_heads, run_python, target_folder, write_json
from train_fixtures import tiny_target, write_counting_data

import medusa
from medusa.config import to_dict
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.hub.card import head_accuracy, model_card
from medusa.hub.hub import build_publish_folder, load_heads_from
from medusa.models.heads_config import HeadsConfig
from medusa.models.target import load_target
from medusa.training.loop import TrainConfig

# What train/train_heads.py records in the heads config (medusa/training/heads_task.py: finish).
TRAINING_ARGS = to_dict(TrainConfig(num_heads=3, max_steps=500, lr=0.002, data=["sharegpt", "tester/chats"],
                                    output="/home/someone/runs/heads"))
EXTRA = {"training_args": TRAINING_ARGS, "accuracy_reference": "target argmax", "steps": 500, "train_seconds": 5400.0,
         "eval_accuracy": {"head1": {"top1": 0.6123, "top5": 0.81}, "head2": {"top1": 0.4211, "top5": 0.66},
                           "head3": {"top1": 0.2502, "top5": float("nan")}}}
BENCH = {"meta": {"device": "cpu", "dtype": "torch.float32", "max_new_tokens": 64},
         "modes": {"hf": {"tokens_per_second": 10.0, "tau": None},
                   "medusa": {"tokens_per_second": 17.3, "speedup": 1.73, "tau": 2.41, "prompts": 8}}}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = target_folder(tmp_path_factory.mktemp("hub"))
    model, tokenizer = load_target(str(folder), device="cpu", dtype=torch.float32)
    return folder, model, tokenizer


def saved_heads(model, root: Path, projection: str = "shared"):
    heads = random_heads(model, projection=projection)
    heads.config.base_model = "tester/tiny-llama"
    heads.config.extra = dict(EXTRA)
    folder = heads.save(root / f"heads-{projection}")
    # What a training run leaves next to the heads must not be published.
    (folder / "optimizer.pt").write_bytes(b"not for upload")
    (folder / "train_log.json").write_text("{}")
    return heads, folder


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_dry_run_builds_card_config_and_weights_only(target, tmp_path, capsys, monkeypatch):
    _, model, _ = target
    heads, folder = saved_heads(model, tmp_path)
    calibration = {"trees": {"cpu": [[0], [1], [0, 0]]}, "measured": {"cpu": {"expected_tokens_per_pass": 1.87}},
                   "draft_vocab": [4, 5, 6], "draft_vocab_coverage": 0.962,
                   "command": "python scripts/calibrate_tree.py --heads /home/someone/runs/heads --max-nodes 8"}
    write_json(folder / "calibration.json", calibration)
    bench = write_json(tmp_path / "bench.json", BENCH)
    out = tmp_path / "publish"
    monkeypatch.delenv("HF_TOKEN", raising=False)  # a dry run needs no token
    rc = load_script("publish_heads").main([str(folder), "--repo-id", "tester/tiny-heads", "--dry-run",
                                            "--bench-json", str(bench), "--output", str(out), "--license", "apache-2.0"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "calibration.json", "config.json", "model.safetensors"]
    for name in ("README.md", "calibration.json", "config.json", "model.safetensors"):
        assert name in printed and "MiB" in printed
    assert "nothing uploaded" in printed and "optimizer.pt" not in printed

    config = json.loads((out / "config.json").read_text())
    original = heads.config.to_dict()
    assert {k: v for k, v in config.items() if k != "extra"} == {k: v for k, v in original.items() if k != "extra"}
    # The run record is published without local folders and with strict JSON (NaN -> null).
    assert config["extra"]["training_args"] == {**TRAINING_ARGS, "output": "heads"}
    assert config["extra"]["eval_accuracy"]["head3"] == {"top1": 0.2502, "top5": None}
    state = load_file(out / "model.safetensors")
    assert state.keys() == heads.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in heads.state_dict().items())

    published = json.loads((out / "calibration.json").read_text())
    assert published == {**calibration, "command": "python scripts/calibrate_tree.py --heads heads --max-nodes 8"}

    loaded = load_heads_from(str(out), model)  # medusa.load applies the published calibration
    assert loaded.trees == {"cpu": [(0,), (1,), (0, 0)]} and loaded.draft_vocab.tolist() == [4, 5, 6]

    card = (out / "README.md").read_text()
    assert "- cpu: 3 candidates, expected 1.87 tokens per pass" in card
    assert "draft vocabulary: 3 tokens, covering 96.2%" in card
    meta = front_matter(card)
    assert meta["base_model"] == "tester/tiny-llama" and meta["license"] == "apache-2.0"
    assert "medusa" in meta["tags"] and "speculative-decoding" in meta["tags"]
    assert "| 1 | token t+2 | 0.612 | 0.810 |" in card
    assert "| 3 | token t+4 | 0.250 | - |" in card  # head 3 predicts three tokens past the next one; NaN shows as -
    assert "against the target argmax" in card and "Optimizer steps: 500 (1.5 h)" in card
    assert "2.41" in card and "1.73x" in card and "17.3" in card
    command = next(line for line in card.splitlines() if line.startswith("accelerate launch train/train_heads.py"))
    assert set(command.split()[3:]) == {"--num-heads", "3", "--max-steps", "500", "--lr", "0.002", "--data",
                                        "sharegpt,tester/chats"}  # non-default fields only, no local folders
    assert meta["datasets"] == ["tester/chats"] and "/home/someone" not in card
    assert 'medusa.load(model="tester/tiny-llama", heads="tester/tiny-heads")' in card
    assert "vllm serve tester/tiny-llama --speculative-config" in card
    assert '"num_speculative_tokens": 3' in card and "--model tester/tiny-llama" in card


def test_card_without_measurements_says_so_and_hides_local_paths():
    config = HeadsConfig(hidden_size=8, vocab_size=16, num_heads=2, base_model="/home/someone/models/my-llama")
    card = model_card(config, "tester/x")
    assert "/home/someone" not in card and "my-llama" in card
    assert "base_model" not in front_matter(card)
    assert "not measured" in card and "not recorded" in card


@pytest.mark.parametrize("extra, expected", [
    ({"eval_accuracy": {"head2": {"top1": 0.25, "top5": 0.5}, "head10": {"top1": 0.1, "top5": None},
                        "head1": {"top1": 0.5, "top5": 0.75}}}, {"top1": [0.5, 0.25, 0.1], "top5": [0.75, 0.5, None]}),
    ({"per_head_accuracy": [0.5, 0.25]}, {"top1": [0.5, 0.25]}),
    ({"per_head_accuracy": [{"top1": 0.5, "top3": 0.7}, {"top1": 0.25, "top3": 0.4}]}, {"top1": [0.5, 0.25], "top3": [0.7, 0.4]}),
    ({}, {}),
])
def test_head_accuracy_shapes(extra, expected):
    assert head_accuracy(extra) == expected


@pytest.mark.parametrize("projection", ["shared", "per_head"])
def test_published_folder_loads_back_with_identical_outputs(target, tmp_path, projection):
    folder_target, model, tokenizer = target
    heads, folder = saved_heads(model, tmp_path, projection)
    out = build_publish_folder(folder, tmp_path / "publish", "tester/tiny-heads")

    hidden = torch.randn(5, model.config.hidden_size)
    loaded = load_heads_from(str(out), model)
    assert torch.equal(loaded(hidden), heads(hidden))

    reference = Engine(model, tokenizer, heads=heads, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=24)
    assert max(reference.stats.accepted) > 1  # the heads do propose accepted tokens
    engine = medusa.load(model=str(folder_target), heads=str(out), device="cpu", dtype="float32", proposers=DRAFTING)
    result = engine.generate(PROMPT, max_new_tokens=24)
    assert result.tokens == reference.tokens
    assert result.stats.accepted == reference.stats.accepted  # same proposals, same acceptance


def populate_hf_cache(cache: Path, repo_id: str, files: list[Path]) -> None:
    """The layout huggingface_hub writes: content-addressed blobs, a snapshot folder of
    relative symlinks per commit, and refs/main naming that commit."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    for src in files:
        data = src.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / src.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)


HUB_CHILD = """
import json, sys
import medusa
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.errors import MedusaError
engine = medusa.load(model=sys.argv[1], heads="tester/tiny-heads", device="cpu", dtype="float32",
                     proposers=ProposerConfig(check_drafting=False, match_chains=False))
res = engine.generate(json.loads(sys.argv[2]), max_new_tokens=24)
out = {"tokens": res.tokens, "accepted": res.stats.accepted}
try:
    medusa.load(model=sys.argv[1], heads="tester/not-cached", device="cpu", dtype="float32")
except MedusaError as err:
    out["missing"] = str(err)
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_hub_id_resolves_through_the_hf_cache_offline(target, tmp_path):
    folder_target, model, tokenizer = target
    heads, folder = saved_heads(model, tmp_path)
    published = build_publish_folder(folder, tmp_path / "publish", "tester/tiny-heads")
    cache = tmp_path / "hf-cache"
    populate_hf_cache(cache, "tester/tiny-heads", sorted(published.iterdir()))
    # huggingface_hub itself recognises the folder as a cached repository.
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert repos["tester/tiny-heads"].nb_files == 3

    proc = run_python(["-c", HUB_CHILD, str(folder_target), json.dumps(PROMPT)],
                      env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = Engine(model, tokenizer, heads=heads, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=24)
    assert out["tokens"] == reference.tokens and out["accepted"] == reference.stats.accepted
    assert "HF_HUB_OFFLINE" in out["missing"] and "tester/not-cached" in out["missing"]
    assert "\n" not in out["missing"]


def test_unknown_heads_argument_is_a_one_line_error(target, tmp_path):
    _, model, _ = target
    with pytest.raises(MedusaError, match="neither a heads folder nor a Hub id"):
        load_heads_from(str(tmp_path / "no" / "such" / "heads"), model)


def test_heads_for_another_model_are_refused(target, tmp_path):
    _, model, _ = target
    _, folder = saved_heads(model, tmp_path)
    other = load_target(str(target_folder(tmp_path / "other")), device="cpu")[0]
    other.resize_token_embeddings(128)
    with pytest.raises(MedusaError, match="use heads trained for this model"):
        load_heads_from(str(folder), other)


def test_no_token_fails_before_any_work(tmp_path):
    out = tmp_path / "publish"
    proc = run_python([str(REPO / "scripts" / "publish_heads.py"), str(tmp_path / "heads"), "--repo-id", "tester/x",
                       "--output", str(out)],
                      env={"HF_TOKEN": None, "HUGGING_FACE_HUB_TOKEN": None, "HF_OIDC_RESOURCE": None,
                           "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN_PATH": str(tmp_path / "hf-home" / "token"),
                           "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Hugging Face token" in lines[0] and "HF_TOKEN" in lines[0]
    assert not out.exists()  # nothing was built: the heads folder does not even exist


class EchoAuth(BaseHTTPRequestHandler):
    """A Hub stand-in that rejects every request and echoes the credentials it was sent."""

    seen: list[str] = []
    paths: list[str] = []

    def _reject(self) -> None:
        auth = self.headers.get("Authorization", "")
        EchoAuth.seen.append(auth)
        EchoAuth.paths.append(self.path)
        body = json.dumps({"error": f"Invalid credentials in Authorization header: {auth}"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = _reject

    def log_message(self, *args) -> None:
        pass


@pytest.mark.e2e
def test_upload_errors_never_show_the_token(target, tmp_path):
    _, model, _ = target
    _, folder = saved_heads(model, tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoAuth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = "hf_" + secrets.token_hex(16)
    try:
        proc = run_python([str(REPO / "scripts" / "publish_heads.py"), str(folder), "--repo-id", "tester/tiny-heads"],
                          env={"HF_TOKEN": token, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
                               "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    finally:
        server.shutdown()
    assert any(token in auth for auth in EchoAuth.seen)  # the token was really sent, and echoed back
    assert proc.returncode == 1
    assert token not in proc.stdout and token not in proc.stderr
    assert "upload to tester/tiny-heads failed" in proc.stderr
    assert "Bearer ***" in proc.stderr  # the echoed credentials were shown, scrubbed


def test_push_to_hub_needs_a_repository_id():
    with pytest.raises(MedusaError, match="repo_id"):
        TrainConfig(push_to_hub=True)


def train_argv(tmp_path: Path, out: Path) -> list[str]:
    model = tiny_target(tmp_path / "model")
    data = write_counting_data(tmp_path / "count.jsonl", 24)
    return [str(REPO / "train" / "train_heads.py"), "--model", str(model), "--data", str(data), "--max-length", "48",
            "--num-heads", "3", "--batch-size", "4", "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "0",
            "--eval-batches", "1", "--eval-fraction", "0.1", "--save-every", "0", "--wandb", "false", "--distill", "0",
            "--output", str(out), "--push-to-hub", "true", "--repo-id", "tester/pushed"]


NO_TOKEN = {"HF_TOKEN": None, "HUGGING_FACE_HUB_TOKEN": None, "HF_OIDC_RESOURCE": None}


@pytest.mark.e2e
def test_training_with_push_to_hub_checks_the_token_before_training(tmp_path):
    out = tmp_path / "heads"
    proc = run_python(train_argv(tmp_path, out),
                      env={**NO_TOKEN, "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN_PATH": str(tmp_path / "none"),
                           "WANDB_MODE": "disabled"})
    assert proc.returncode == 2
    assert "no Hugging Face token" in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()  # training never started


@pytest.mark.e2e
def test_training_pushes_the_heads_at_the_end(tmp_path):
    out = tmp_path / "heads"
    EchoAuth.seen.clear()
    EchoAuth.paths.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoAuth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = "hf_" + secrets.token_hex(16)
    try:
        proc = run_python(train_argv(tmp_path, out),
                          env={"HF_TOKEN": token, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
                               "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
                               "WANDB_MODE": "disabled"})
    finally:
        server.shutdown()
    # Training ran to the end and wrote the heads; then the upload was attempted with the token.
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert "/api/repos/create" in EchoAuth.paths and f"Bearer {token}" in EchoAuth.seen
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "upload to tester/pushed failed" in last and f"the heads are saved in {out}" in last
    assert token not in proc.stdout and token not in proc.stderr


def test_a_heads_folder_publishes_its_ngram_table(target, tmp_path):
    from medusa.runtime.ngrams import NGRAMS_NAME, NgramTable

    _, model, _ = target
    _, folder = saved_heads(model, tmp_path)
    out = build_publish_folder(folder, tmp_path / "publish", "tester/tiny-heads")
    assert not (out / NGRAMS_NAME).exists()
    NgramTable.build([[3, 4, 5, 6]] * 2, model.config.vocab_size).save(folder / NGRAMS_NAME)
    out = build_publish_folder(folder, tmp_path / "publish", "tester/tiny-heads")
    loaded = load_heads_from(str(out), model)
    assert loaded.ngrams is not None and loaded.ngrams.chain([3, 4], 3) == [5, 6]
    (folder / NGRAMS_NAME).unlink()
    build_publish_folder(folder, tmp_path / "publish", "tester/tiny-heads")
    assert not (out / NGRAMS_NAME).exists()  # a table left from an earlier build is not published again
