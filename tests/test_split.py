"""The step split (medusa/bench/split.py, medusa/runtime/clock.py) on a real tiny engine."""

from __future__ import annotations

import torch

from medusa.bench.split import split_lines, step_split
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.runtime import clock
from medusa.runtime.kernels import PackedLinears
from tests.tiny import tiny_model


def test_the_split_adds_up_and_counts_kernels_only_while_asked():
    engine = Engine(tiny_model("llama"), plan=Plan(kernels="gemv"))
    splits = step_split(engine, [[5, 17, 33, 9], [9, 8, 7]], batches=(1, 3), steps=4, warmup=1)
    assert [s.batch for s in splits] == [1, 3]
    for s in splits:
        # the decoder ran as one-call passes (medusa/runtime/native.py), the vocabulary projection on gemv
        assert s.native_ms > 0 and s.linears_ms > 0 and s.attention_ms == 0
        assert s.linears_ms + s.attention_ms + s.native_ms <= s.step_ms
        assert abs(s.linears_ms + s.attention_ms + s.native_ms + s.other_ms - s.step_ms) < 1e-9
    lines = split_lines(splits)
    assert "3 sequences' step" in lines[-1]
    model = tiny_model("llama")
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        model(input_ids=torch.tensor([[5, 6, 7]]))  # outside counting: nothing is kept
        with clock.counting() as totals:
            model(input_ids=torch.tensor([[5, 6, 7]]))
    assert totals["linears"] > 0 and totals["attention"] == 0  # the model's own SDPA is not the engine's
