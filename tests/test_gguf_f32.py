"""The target as an F32 GGUF for llama.cpp: the same weights transformers computes with."""

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from medusa.errors import MedusaError
from medusa.peers.gguf_f32 import f32_gguf


def quantised_gguf(path):
    """A small GGUF file like the embedded one: Q4_1 and Q8_0 matrices, an F32 vector, metadata
    of several kinds (a string array among them)."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 100000.0)
    writer.add_uint32("general.file_type", 3)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"])
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    for name, qtype, shape in (("blk.0.attn_q.weight", GGMLQuantizationType.Q4_1, (64, 96)),
                               ("token_embd.weight", GGMLQuantizationType.Q8_0, (40, 64))):
        writer.add_tensor(name, quantize(rng.standard_normal(shape, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_tensor_is_dequantised_with_its_name_and_shape_and_every_field_copied(tmp_path):
    src = quantised_gguf(tmp_path / "tiny.Q4_1.gguf")
    out = f32_gguf(str(src), cache_dir=tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "models" / "gguf-f32" and out.name.endswith(".f32.gguf")
    before, after = GGUFReader(src), GGUFReader(out)
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for a, b in zip(before.tensors, after.tensors, strict=True):
        assert b.tensor_type == GGMLQuantizationType.F32 and list(b.shape) == list(a.shape)
        assert np.array_equal(b.data, dequantize(a.data, a.tensor_type))  # bitwise: the same function
    fields = {k: f.contents() for k, f in after.fields.items() if not k.startswith("GGUF.")}
    assert fields == {**{k: f.contents() for k, f in before.fields.items() if not k.startswith("GGUF.")},
                      "general.file_type": 0}  # 0: llama.cpp's "all F32"
    assert after.fields["tokenizer.ggml.tokens"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert f32_gguf(str(src), cache_dir=tmp_path / "cache") == out  # cached


def test_a_damaged_cached_file_is_rebuilt_with_one_warning(tmp_path, caplog):
    src = quantised_gguf(tmp_path / "tiny.Q4_1.gguf")
    out = f32_gguf(str(src), cache_dir=tmp_path / "cache")
    whole = out.read_bytes()
    for damage in (whole[: len(whole) - 100], b"garbage", b""):
        out.write_bytes(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medusa.cache"):
            assert f32_gguf(str(src), cache_dir=tmp_path / "cache") == out
        assert out.read_bytes() == whole
        warnings = [r.getMessage() for r in caplog.records if r.name == "medusa.cache"]
        assert len(warnings) == 1 and str(out) in warnings[0] and "rebuilding" in warnings[0]
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left behind


def test_a_target_that_is_not_a_gguf_file_names_the_conversion(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for model in (str(folder), "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(MedusaError, match="convert_hf_to_gguf.py.*--model FILE.gguf") as err:
            f32_gguf(model, cache_dir=tmp_path / "cache")
        assert "\n" not in str(err.value)
    with pytest.raises(MedusaError, match="GGUF file not found"):
        f32_gguf(str(tmp_path / "missing.gguf"), cache_dir=tmp_path / "cache")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(MedusaError, match="cannot read the GGUF file .*bad.gguf"):
        f32_gguf(str(tmp_path / "bad.gguf"), cache_dir=tmp_path / "cache")


@pytest.mark.e2e
def test_transformers_reads_the_embedded_model_s_f32_copy_as_the_embedded_model_bitwise():
    from transformers import AutoModelForCausalLM

    from medusa.models.target import default_model_dir

    out = f32_gguf()  # the user's cache: written once (~1 minute), then reused
    copy = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32)
    embedded = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    a, b = copy.state_dict(), embedded.state_dict()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in b)
    ids = torch.tensor([[1, 9690, 198, 2683, 346, 253, 5356, 11173, 2]])
    with torch.inference_mode():
        assert torch.equal(copy(ids).logits, embedded(ids).logits)
