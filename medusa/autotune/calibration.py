"""Offline tree calibration's measurements and record (``python scripts/calibrate_tree.py``):
held-out prompts and the target's greedy answers to them, the draft vocabulary, the heads'
ranks of the true tokens, EAGLE heads' acceptance per draft shape, the pass-cost curve, and
the heads folder's calibration.json, read and written whole. The choices from these are
medusa/autotune/trees.py's (``choose_tree``, ``choose_dynamic``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from medusa.autotune.sizing import LENGTHS, context_bucket
from medusa.autotune.timing import measure_cost
from medusa.autotune.trees import Acceptance, acceptance_by_size, candidate_ranks
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.errors import MedusaError
from medusa.runtime.files import atomic_file, read_json
from medusa.training.sources import DataStats, answered_prompts, load_conversations, prompt_key

# the pass sizes the cost curve T(n) is timed at (those up to the largest tree considered)
COST_SIZES = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64]
# (depth, topk) of the dynamic trees tried for eagle heads: narrow and shallow to wide and deep
EAGLE_GRID = [(3, 2), (5, 3), (6, 4), (7, 8)]


def split_pool(pool: list, samples: int, exclude: list[str], source: str) -> tuple[list, list]:
    """The first ``samples`` conversations whose prompt no ``exclude`` file answered (the held-out
    prompts the target answers: answers the heads trained on, or an n-gram table holds, would
    flatter them), and the others (reference answers for the draft vocabulary)."""
    ids, texts = answered_prompts(exclude)
    held_out, reference = [], []
    for cid, messages in pool:
        first = next(m["content"] for m in messages if m["role"] == "user")
        fresh = cid.split(":", 1)[-1] not in ids and prompt_key(first) not in texts
        (held_out if fresh and len(held_out) < samples else reference).append((cid, messages))
    if len(held_out) < samples:
        raise MedusaError(f"{source} gave only {len(held_out)} conversations outside the --exclude files; "
                          f"need {samples}")
    return held_out, reference


def held_out_prompts(tok, source: str, samples: int, exclude: list[str], seed: int, max_prompt_tokens: int,
                     reference_answers: int) -> tuple[list[list[int]], list]:
    """Prompt ids of ``samples`` held-out conversations of ``source`` (their first message in the
    chat template, its last ``max_prompt_tokens``), and up to ``reference_answers`` reference
    conversations for the vocabulary."""
    pool = load_conversations(source, DataStats(), seed=seed)
    held_out, reference = split_pool(pool, samples, exclude, source)
    prompts = []
    for _, messages in held_out:
        first = next(m for m in messages if m["role"] == "user")
        ids = tok.apply_chat_template([first], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompts.append(ids[-max_prompt_tokens:])
    return prompts, reference[:reference_answers]


def greedy_answers(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers (plain decoding through the engine: exactly what medusa
    mode reproduces)."""
    return [engine.generate(p, max_new_tokens=max_new_tokens, mode="baseline").tokens
            for p in tqdm(prompts, desc="target answers", file=sys.stderr)]


def draft_vocab(engine, answers: list[list[int]], reference, size: int) -> tuple[list[int] | None, float]:
    """Draft vocabulary of ``size`` tokens (0: none, the full vocabulary): frequent tokens of half
    the target's answers and of reference answers, and the share of the other half's tokens it
    covers (set on the heads)."""
    if not size:
        return None, 1.0
    counts: Counter = Counter()
    half = len(answers) // 2
    for a in answers[:half]:
        counts.update(a)
    for _, messages in tqdm(reference, desc="reference answers", file=sys.stderr):
        for m in messages:
            if m["role"] == "assistant":
                counts.update(engine.tokenizer(m["content"], add_special_tokens=False)["input_ids"])
    counts.update({t: 10**9 for t in engine.eos})  # end-of-turn must always be proposable
    vocab_ids = [t for t, _ in counts.most_common(size)]
    held = [t for a in answers[half:] for t in a]
    engine.heads.set_draft_vocab(vocab_ids)
    return vocab_ids, sum(t in set(vocab_ids) for t in held) / max(len(held), 1)


def head_ranks(engine, prompts, answers, max_rank: int) -> torch.Tensor:
    """Per-path acceptance on the target's own answers: each position's rank of the true token per head."""
    all_ranks = []
    with torch.inference_mode():
        for p, a in tqdm(list(zip(prompts, answers)), desc="head ranks", file=sys.stderr):
            seq = torch.tensor(p + a, device=engine.device)
            out = engine.model.get_decoder()(input_ids=seq[None])
            hidden = out.last_hidden_state[0, len(p) - 1:]  # the position that produced a[0] onwards
            all_ranks.append(candidate_ranks(engine.heads, hidden, seq[len(p) - 1:], max_rank))
    return torch.cat(all_ranks)


def head_accuracy(ranks: torch.Tensor, num_heads: int) -> dict[str, dict[str, float]]:
    """Each head's top-1 and top-5 accuracy from :func:`head_ranks`."""
    return {f"head{k}": {f"top{r}": float(((ranks[:, k] >= 0) & (ranks[:, k] < r)).float().mean())
                         for r in (1, 5)} for k in range(num_heads)}


def eagle_curves(engine, pairs: list[tuple[list[int], list[int]]], max_nodes: int,
                 max_chain: int) -> dict[tuple[int, int], Acceptance]:
    """Eagle heads' acceptance of the N best nodes of each :data:`EAGLE_GRID` dynamic tree,
    teacher-forced on the target's ``(prompt, answer)`` pairs, drafting as the engine drafts
    (timed, within its draft window)."""
    curves = {}
    for depth, topk in tqdm(EAGLE_GRID, desc="tree sizes", file=sys.stderr):
        size = DynamicTree(nodes=min(max_nodes, depth * topk * topk), depth=depth, topk=topk)
        with engine.kernel_scope():
            curves[(depth, topk)] = acceptance_by_size(engine.heads, engine.model, pairs, size, chain=max_chain,
                                                       lookup_ngram=engine.proposer_config.lookup_ngram,
                                                       window=engine.proposer_config.draft_window)
    return curves


def parse_cost(text: str) -> dict[int, float]:
    """A pass-cost curve given as ``'n:ms,n:ms,...'`` (n=1 included)."""
    try:
        cost = {int(n): float(ms) for n, ms in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise MedusaError(f"--cost {text!r} is not of the form 'n:ms,n:ms,...' (e.g. '1:61,2:94,16:111')") from None
    if 1 not in cost:
        raise MedusaError("--cost must include n=1 (the cost of plain decoding)")
    return cost


def pass_cost(engine, prompts: list[list[int]], max_n: int, max_new_tokens: int,
              compile: bool = False) -> dict[int, float]:
    """The target's pass cost T(n) in ms for the :data:`COST_SIZES` up to ``max_n``, after about
    a prompt and half an answer of cached tokens."""
    with engine.kernel_scope():  # the pass as the engine runs it (its linear kernels: medusa/runtime/kernels.py)
        return measure_cost(engine.model, [s for s in COST_SIZES if s <= max_n],
                            prefix=int(sum(map(len, prompts)) / len(prompts) + max_new_tokens // 2),
                            compile=compile)


def read_calibration(path: Path) -> dict:
    """The heads folder's calibration record (other devices' trees are kept), or {} when there
    is none; a damaged one is replaced (one line), not allowed to discard the measurement just made."""
    if not path.exists():
        return {}
    try:
        return read_json(path, "it is replaced by this calibration")
    except MedusaError as err:
        print(f"warning: {err}", file=sys.stderr)
        return {}


def write_calibration(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` through a temporary file renamed over it: a kill or a full
    disk mid-write leaves the previous record whole (an in-place rewrite left it cut off, and
    the heads folder then failed to load)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record) + "\n")


def curves_by_length(engine, prompts: list[list[int]], max_new_tokens: int, max_nodes: int,
                     max_chain: int) -> dict[str, dict]:
    """:func:`eagle_curves` on long prompts, grouped by the context length each stands for
    (:func:`medusa.autotune.sizing.context_bucket`; shorter prompts are left out), as
    calibration.json's ``curves_by_context``; each length's summary printed."""
    groups: dict[int, list[list[int]]] = {}
    for ids in prompts:
        length = context_bucket(len(ids))
        if length is not None:
            groups.setdefault(length, []).append(ids)
    if not groups:
        raise MedusaError(f"none of the {len(prompts)} long prompts has {LENGTHS[0] * 3 // 4} tokens or more: pass "
                          "long prompts, e.g. written by python scripts/long_prompts.py --seed 7 --output FILE")
    out = {}
    for length, group in sorted(groups.items()):
        answers = greedy_answers(engine, group, max_new_tokens)
        curves = eagle_curves(engine, [(p, a) for p, a in zip(group, answers) if a], max_nodes, max_chain)
        print(f"after ~{length} tokens ({len(group)} prompts), drafted tokens accepted with 8 nodes: " + ", ".join(
            f"{d}x{k} {acc.accepted[min(8, len(acc.accepted)) - 1]:.2f}" for (d, k), acc in sorted(curves.items())))
        out[str(length)] = {f"{d}x{k}": acc.as_record() for (d, k), acc in curves.items()}
    return out
