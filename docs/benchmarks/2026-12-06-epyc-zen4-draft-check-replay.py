"""Replays bench runs that drafted every step through the lone sequence's check
(medusa/decoding/payoff.py) at each of a grid of its settings, and prints each setting's speed
over plain decoding per mode and prompt set beside drafting every step (in brackets).

A replayed sequence drafting at answer position i keeps what the run's step from i kept (a step
starting inside a run's accepted chunk keeps the rest of that chunk); a drafting step costs the
run's mean step (its step profile; a lookup chain's extra rows only where it found a match, taken
as every step that kept a token and 40% of the others), a plain step the baseline's, each times
uniform 0.9-1.1 noise; in brackets the same replay drafting every step. The check sees what it sees in the engine: the step's time, its drafting
and update, and the rows' share (70% of what the profiles say they cost: the plan's curve prices
them a little under).

    python scripts/long_prompts.py --output long-tune.jsonl --per-length 2 --seed 23
    python -m infer.bench --prompts long-tune.jsonl --limit 12 --modes baseline,medusa,eagle,eagle3,hybrid \
        --max-new-tokens 128 --every-step-drafts --json draft-check-tune-long.json
    python -m infer.bench --prompts medusa/assets/mt_bench.jsonl --limit 16 --modes baseline,medusa,eagle,eagle3,hybrid \
        --max-new-tokens 128 --every-step-drafts --json draft-check-tune-short.json
    python docs/benchmarks/2026-12-06-epyc-zen4-draft-check-replay.py draft-check-tune-short.json draft-check-tune-long.json
"""
import bisect
import itertools
import json
import random
import sys
from types import SimpleNamespace

from medusa.decoding import payoff
from medusa.decoding.generation import GenerationStats

GRID = {"DECAY": [0.9, 0.95], "LEAVE": [0.95, 0.9, 0.85], "WARMUP": [8, 16], "EXPLORE": [8, 4], "GRACE": [4, 8]}


def replay(accepted, cost, base, rng):
    """Seconds to decode the answer ``accepted`` stands for, with the check."""
    chunks, pos = {}, 0
    for a in accepted:
        chunks[pos] = a
        pos += a
    starts, n = sorted(chunks), pos

    def kept_at(i):
        s = starts[bisect.bisect_right(starts, i) - 1]
        return max(1, s + chunks[s] - i)

    run, check = SimpleNamespace(stats=GenerationStats(), lean=False), payoff.DraftCheck(None)
    plain_ms = base["verify"] + base["other"]
    lookup = cost["draft"] < 0.5
    rows_ms = (cost["verify"] - base["verify"]) / (0.6 if lookup else 1.0)
    pos, seconds = 0, 0.0
    while pos < n:
        noise = rng.uniform(0.9, 1.1) / 1000
        if check.cap(run) == 1:
            step, tokens = plain_ms * noise, 1
        else:
            tokens = min(kept_at(pos), n - pos)
            rows = rows_ms if not lookup or tokens > 1 or rng.random() < 0.4 else 0.0
            step = (plain_ms + cost["draft"] + cost["update"] + (cost["other"] - base["other"]) + rows) * noise
            run.stats.draft_seconds += cost["draft"] * noise
            run.stats.update_seconds += (cost["update"] + 0.7 * rows) * noise
        check.observe(run, 4, tokens - 1, step, 0)
        pos, seconds = pos + tokens, seconds + step
    return seconds, n * plain_ms / 1000


def speeds(runs, settings):
    """Each (run, mode): plain decoding's time over the replay's with ``settings``."""
    for name, value in settings.items():
        setattr(payoff, name, value)
    rng, out = random.Random(0), {}
    for i, modes in enumerate(runs):
        base = modes["baseline"]["step_ms"]
        for mode in ("medusa", "eagle", "eagle3", "hybrid"):
            checked, plain = 0.0, 0.0
            for p in modes[mode]["per_prompt"]:
                t, b = replay(p["accepted"], modes[mode]["step_ms"], base, rng)
                checked, plain = checked + t, plain + b
            out[(i, mode)] = plain / checked
    return out


def main(paths):
    runs = [json.load(open(path))["modes"] for path in paths]
    every = speeds(runs, {**dict(zip(GRID, (v[0] for v in GRID.values()))), "LEAVE": 0.0})  # never plain
    for values in itertools.product(*GRID.values()):
        settings = dict(zip(GRID, values))
        out = speeds(runs, settings)
        print(settings, "  ".join(f"{mode}@{i} {x:.3f} ({every[(i, mode)]:.3f})" for (i, mode), x in out.items()),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
