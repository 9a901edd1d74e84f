"""Let the target answer a dataset's prompts, to train heads on the target's own outputs.

Medusa-2's recipe: heads (and a LoRA-tuned target) learn best from text the target itself
writes, because decoding verifies the heads against exactly that. This script takes the
first user turn of each conversation (``--turn``: a later one, the turns before it and the
dataset's answers to them as context, so the heads also see long contexts), generates the
target's answer in batches and appends one JSON line per answer (OpenAI ``messages`` form,
readable by train/train_heads.py). Interrupted runs resume: prompts already answered in the
output file are skipped.

    python train/generate_selfdistill.py --data sharegpt --max-samples 2000 \\
        --output data/selfdistill/smollm2.jsonl --max-new-tokens 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medusa import config
from medusa.config import arg, parse_config, run_main
from medusa.errors import MedusaError, require_extra
from medusa.models.target import eos_token_ids, load_target, set_chat_template
from medusa.runtime.kernels import KERNELS, PackedLinears
from medusa.training.sources import DataStats, load_conversations


@dataclass
class SelfDistillConfig:
    """Generate the target's own answers to a dataset's prompts (JSONL, resumable)."""

    output: str = arg("out/selfdistill.jsonl", "JSONL file answers are appended to (resumes if it exists)")
    model: str | None = arg(None, "target: Hub id, local folder or .gguf file (empty: the embedded SmolLM2-135M-Instruct)")
    data: list[str] = arg(["sharegpt"], "prompt sources: 'sharegpt', .json/.jsonl files or Hub ids (comma separated)")
    split: str = arg("train", "split of Hub datasets")
    max_samples: int | None = arg(None, "prompts taken from each source (shuffled with seed)", bounds=(1, None))
    skip_samples: int = arg(0, "skip this many prompts of each source first (e.g. to keep them out of training data)",
                            bounds=(0, None))
    max_prompt_tokens: int = arg(512, "prompts longer than this (in tokens, with the chat template) are skipped",
                                 bounds=(1, None))
    max_new_tokens: int = arg(256, "answer length limit in tokens", bounds=(1, None))
    turn: int = arg(1, "the user turn answered: 1 the first; k the k-th, after the turns before it and the dataset's "
                       "answers to them (conversations with fewer turns are skipped); 0 each conversation's last",
                    bounds=(0, None))
    batch_size: int = arg(8, "prompts generated together (left padded)", bounds=(1, None))
    temperature: float = arg(0.0, "0: greedy (the decoding that Medusa heads are verified against); >0: sampling",
                             bounds=(0, None))
    seed: int = arg(0, "shuffle and sampling seed")
    device: str | None = arg(None, "device (default: cuda if available, else cpu)")
    dtype: str | None = arg(None, "float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    trust_remote_code: bool = arg(False, "allow model code from the Hub")
    chat_template: str | None = arg(None, "Jinja chat template (file or text) for tokenizers that have none")
    kernels: str = arg("default", "linear kernels: default (torch's), onednn (packed oneDNN weights on a CPU) or gemv "
                                  "(this package's float32 CPU kernels), medusa/runtime/kernels.py: faster on some "
                                  "CPUs; they round the last bits differently",
                       choices=KERNELS)


def probe_output(out: Path) -> None:
    """Before the model loads: a path that cannot be written fails in a second, not after."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        existed = out.exists()
        out.open("a").close()
        if not existed:  # probed only: a run that fails before its first answer leaves no empty file
            out.unlink()
    except OSError as err:
        raise MedusaError(f"cannot write the answers to {out}: {err.strerror}; pass --output with a writable path") from None


def cut_partial_line(out: Path) -> None:
    """Make ``out`` end at a line end before answers are appended to it: a run killed while
    writing left its last record cut off, and the next record would be glued to it (both
    lost). A last line that is a whole record only lacks its newline, which is added; a cut
    one is removed (its prompt is answered again)."""
    if not out.is_file() or out.stat().st_size == 0:
        return
    with out.open("rb+") as fh:
        size = fh.seek(0, 2)
        tail, start = b"", size
        while start > 0 and b"\n" not in tail:  # read back block by block to the last line end
            step = min(start, 1 << 16)
            start -= step
            fh.seek(start)
            tail = fh.read(step) + tail
        if tail.endswith(b"\n"):
            return
        start += tail.rfind(b"\n") + 1
        fh.seek(start)
        last = fh.read()
        try:
            json.loads(last)["id"]
            fh.write(b"\n")
        except (ValueError, KeyError, TypeError):
            fh.truncate(start)
            print(f"resume: dropped the cut-off last line of {out} ({len(last)} bytes); its prompt is "
                  "answered again", file=sys.stderr)


def answered(out: Path) -> set[str]:
    """Ids already answered in ``out`` (a run resumes)."""
    done: set[str] = set()
    if out.is_file():
        with out.open() as fh:
            for line in fh:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut off by an interruption: that prompt is redone
    return done


def pending_prompts(cfg, tok, done: set[str]) -> list[tuple[str, list[dict], list[int]]]:
    """``(id, head messages, prompt ids)`` of every prompt still to answer."""
    stats = DataStats()
    prompts: list[tuple[str, list[dict], list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for source in cfg.data:
        convs = load_conversations(source, stats, cfg.split, None, cfg.seed)[cfg.skip_samples:]
        if cfg.max_samples:
            convs = convs[: cfg.max_samples]
        for rid, messages in convs:
            head, turn = context(messages, cfg.turn)
            if head is None:
                stats.add("fewer_turns")
                continue
            rid = f"{source}:{rid}" if turn == 1 else f"{source}:{rid}#turn{turn}"  # (first turns: ids as before)
            ids = tok.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            if rid in done:
                seen.add(tuple(ids))
                continue
            if len(ids) > cfg.max_prompt_tokens:
                stats.add("prompt_too_long")
                continue
            key = tuple(ids)
            if cfg.temperature == 0 and key in seen:
                stats.add("duplicate_prompt")  # greedy: the same prompt, the same answer
                continue
            seen.add(key)
            prompts.append((rid, head, list(ids)))
    print(f"data: {stats.summary()}; {len(done)} already answered, {len(prompts)} to go", file=sys.stderr)
    return prompts


def context(messages: list[dict], turn: int) -> tuple[list[dict] | None, int]:
    """The messages up to the ``turn``-th user message (0: the last) and that turn's number;
    ``(None, 0)`` where there are fewer user turns."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users or turn > len(users):
        return None, 0
    k = len(users) if turn == 0 else turn
    return messages[: users[k - 1] + 1], k


def answer_batch(model, tok, batch, gen_kwargs: dict, eos: set[int]) -> list[dict]:
    """One left-padded batch through ``generate``: the records of its non-empty answers."""
    width = max(len(p[2]) for p in batch)
    input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, _, ids) in enumerate(batch):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attn[i, width - len(ids):] = 1
    device = model.get_output_embeddings().weight.device
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), **gen_kwargs)
    records = []
    for (rid, head, _), row in zip(batch, gen[:, width:].tolist()):
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        answer = tok.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
        if answer.strip():
            records.append({"id": rid, "messages": head + [{"role": "assistant", "content": answer}],
                            "finished": cut is not None})
    return records


def build_parser() -> argparse.ArgumentParser:
    return config.build_parser(SelfDistillConfig, prog="train/generate_selfdistill.py", epilog=(
        "The answers train Medusa or EAGLE heads with train/train_heads.py (--data FILE, --kind medusa or "
        "eagle). Recipes: docs/training.md."))


def main(argv: list[str] | None = None) -> int:
    require_extra("train")  # first, so that even --help names the extra to install
    cfg = parse_config(SelfDistillConfig, argv, build_parser())
    out = Path(cfg.output)
    probe_output(out)
    torch.manual_seed(cfg.seed)
    model, tok = load_target(cfg.model, device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    set_chat_template(tok, cfg.chat_template)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    cut_partial_line(out)
    prompts = pending_prompts(cfg, tok, answered(out))
    # Similar lengths together (less padding per batch), batches in random order: a run
    # stopped early has answered a fair sample of the prompts, not just the shortest.
    prompts.sort(key=lambda p: len(p[2]))
    batches = [prompts[b: b + cfg.batch_size] for b in range(0, len(prompts), cfg.batch_size)]
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    batches = [batches[i] for i in order]
    gen_kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id)
    if cfg.temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=0)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    eos = set(eos_token_ids(model, tok)) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    bar = tqdm(total=len(prompts), desc="answers", unit="prompt")
    kernels = PackedLinears(model, kernels=cfg.kernels) if cfg.kernels != "default" else contextlib.nullcontext()
    with out.open("a") as fh, kernels:
        for batch in batches:
            for rec in answer_batch(model, tok, batch, gen_kwargs, eos):
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            bar.update(len(batch))
    bar.close()
    return 0


if __name__ == "__main__":
    run_main(main)
