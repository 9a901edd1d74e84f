"""The target's weights as an F32 GGUF file, for llama.cpp to compute with the same values.

transformers loads a GGUF target by dequantising every tensor with ``gguf.quants.dequantize``
(the embedded default is a Q4_1 file). :func:`f32_gguf` writes the same tensors, dequantised by
the same function, into a GGUF file of its own: every metadata field copied (``general.file_type``
then says F32), every tensor under its name and shape, in float32. llama.cpp reading that file
and transformers reading the original (or this one) start from bitwise the same weights.

The file is cached under ``cache_root()/models/gguf-f32/``, keyed like the dequantised folders
(the sha256 of the whole source file), written atomically; a damaged one is dropped with one
warning line and written again.
"""

from __future__ import annotations

from pathlib import Path

from medusa.errors import MedusaError
from medusa.models.target import embedded_gguf_path
from medusa.runtime.files import atomic_file, cache_root, content_digest, drop_cache_entry

# llama.cpp's LLAMA_FTYPE_ALL_F32: what general.file_type says of a file whose tensors are all F32.
_FILE_TYPE_F32 = 0
_WRITER_OWNS = ("GGUF.", "general.architecture")  # written by GGUFWriter itself


def source_gguf(model: str | None) -> Path:
    """The GGUF file behind ``model`` (None: the embedded default); another target is a
    one-line error naming the conversion."""
    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if path.suffix == ".gguf":
        raise MedusaError(f"GGUF file not found: {path}")
    raise MedusaError(f"llama.cpp reads GGUF files and {model} is not one: convert it with llama.cpp's "
                      "convert_hf_to_gguf.py (--outtype f32) and pass --model FILE.gguf")


def f32_gguf(model: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The F32 GGUF copy of ``model``'s GGUF file, written on first use and cached."""
    src = source_gguf(model)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out = root / "models" / "gguf-f32" / f"{src.stem}-{content_digest(src, root)[:20]}.f32.gguf"
    if out.is_file():
        problem = f32_problem(out)
        if problem is None:
            return out
        drop_cache_entry(out, f"damaged ({problem})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        write_f32(src, tmp)
    return out


def f32_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole F32 GGUF file (cut off, garbage, a quantised tensor), else None."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path)
        for t in reader.tensors:
            if t.tensor_type != GGMLQuantizationType.F32 or t.data.size != t.n_elements:
                return f"tensor {t.name} is {t.tensor_type.name} with {t.data.size} of {t.n_elements} values"
    except Exception as err:  # noqa: BLE001 - the reader's many errors for a cut-off or garbage file
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
    return None if reader.tensors else "no tensors"


def write_f32(src: Path, out: Path) -> None:
    """Write ``src`` with every tensor dequantised to float32 (name and shape kept) into ``out``."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(src)
        arch = reader.fields["general.architecture"].contents()
    except Exception as err:  # noqa: BLE001 - as in f32_problem
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise MedusaError(f"cannot read the GGUF file {src} ({first}): it is damaged or not a model; "
                          "download it again or pass another file") from None
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith(_WRITER_OWNS):
            continue
        kind = field.types[0]
        value = _FILE_TYPE_F32 if key == "general.file_type" else field.contents()
        if key == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        # dequantize returns numpy order (GGUF's shape reversed), which add_tensor reverses back
        weights = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        writer.add_tensor(t.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
