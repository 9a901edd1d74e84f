"""scripts/probe_compiled.py: with the norm's reduction and attention behind opaque ops and
emulated casts, a compiled bfloat16 Llama rounds exactly as eager does
(docs/performance.md#where-a-decode-steps-time-goes); the probe restores the model it patched."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from tiny import tiny_model

spec = importlib.util.spec_from_file_location("probe_compiled", Path(__file__).parents[1] / "scripts" / "probe_compiled.py")
probe = importlib.util.module_from_spec(spec)
sys.modules["probe_compiled"] = probe  # dynamo resolves the traced functions' module
spec.loader.exec_module(probe)


@pytest.mark.peers
@inductor_config.patch(emulate_precision_casts=True)  # torch's own patch: restored after (monkeypatch deletes it)
def test_compiled_bfloat16_passes_match_eager_with_opaque_norm_reduction_and_attention():
    model = tiny_model("llama").to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    norm = type(model.get_decoder().norm)
    stock = norm.forward
    with probe.opaque(model):
        assert model.config._attn_implementation == "medusa_probe_sdpa" and norm.forward is not stock
        assert probe.prompt_pass(model, 9) == 0
        differing, eager_ms, compiled_ms = probe.decode_steps(model, prefix=12, steps=4)
        assert differing == 0 and eager_ms > 0 and compiled_ms > 0
    assert model.config._attn_implementation == "sdpa" and norm.forward is stock


def test_the_probe_leaves_inductor_settings_as_they_were():
    assert inductor_config.emulate_precision_casts is False
