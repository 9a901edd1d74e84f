"""The "gemv" linear kernels: float32 products of a few rows at the memory bandwidth.

Why: a decoding pass multiplies one row (plain decoding) or a few dozen (a tree) by every
weight of the model, so it is bound by how fast the weights stream from memory. torch's
float32 kernels (MKL, and oneDNN's packed ones) can read them at well under the machine's memory
bandwidth in a one-token pass (docs/performance.md#where-a-pass-goes). This kernel
(``gemv.c`` beside this file) packs each weight once into blocks of output rows laid out
k-major, so one vector load serves a whole block of outputs, and streams the weights at about
the memory bandwidth for one row (docs/performance.md#gemv-kernels).

Exactness: every output sums its products in one fixed order (chunks of 64 inputs left to
right, the chunk sums left to right) whatever the number of rows, so row ``r`` of an
``n``-row product is bitwise the one-row product of that row: a tree pass computes each row
as plain decoding would. Like oneDNN's kernels it rounds differently from MKL's (within ~1e-6
of them where measured); identity to ``generate`` is measured by the bench.

Build: the C source is compiled on first use with the system's C compiler (``CC``, else
``cc``; about a second) for this CPU (``-march=native``), into the cache
(``~/.cache/medusa/kernels/gemv-<key>.so``, keyed by the source, the flags, the compiler and
the CPU's feature flags), written atomically. A damaged library is rebuilt once, with a
warning; no compiler (or a failed build) makes the kernel unavailable with a reason, and the
machine plan keeps the other kernels (medusa/autotune/device.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from medusa.runtime import pages
from medusa.runtime.files import atomic_file, cache_root

log = logging.getLogger("medusa.kernels")

SOURCE = Path(__file__).with_name("gemv.c")
# one library, its own threads; HEADERS are part of the build's key
SOURCES = (SOURCE, *(Path(__file__).with_name(f) for f in ("attention.c", "decoder.c", "pool.c")))
HEADERS = (Path(__file__).with_name("vec.h"),)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-pthread", "-shared", "-fPIC", "-std=gnu11")
BUILD_TIMEOUT_S = 120
PROFILER_NAME = "medusa::gemv"
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)


class GemvUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def compiler() -> str | None:
    """The C compiler: ``CC`` if set, else ``cc`` or ``gcc`` on the PATH, else None."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise GemvUnavailable(f"no usable C compiler ({cc}: {err}): install gcc, or use kernels='onednn'") from None
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""


def library_path(cc: str) -> Path:
    """Where the library built by ``cc`` for this CPU lives in the cache."""
    key = hashlib.sha256(b"\0".join(x.encode() for x in (*(s.read_text() for s in (*SOURCES, *HEADERS)), " ".join(FLAGS), _version(cc),
                                                         _cpu_flags()))).hexdigest()[:16]
    return cache_root() / "kernels" / f"gemv-{key}.so"


def _build(cc: str, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # an unwritable cache root: the kernel pick leaves gemv out, the load goes on
        raise GemvUnavailable(f"cannot write the gemv kernels to {path.parent} ({err.strerror}): set MEDUSA_CACHE "
                              "to a writable folder, or use kernels='onednn'") from None
    with atomic_file(path) as tmp:
        try:
            out = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise GemvUnavailable(f"cannot build the gemv kernels ({cc}: {err}): use kernels='onednn'") from None
        if out.returncode != 0:
            first = next((line for line in out.stderr.splitlines() if "error" in line), out.stderr.strip()[:200])
            raise GemvUnavailable(f"cannot build the gemv kernels with {cc}: {first.strip()}")


def build_at(rev: str, files: tuple[str, ...], folder: Path, root: Path) -> ctypes.CDLL:
    """The C sources ``files`` (paths in the repository at ``root``) as git revision ``rev`` has
    them, built into ``folder`` with this build's flags: the kernel of an earlier commit, for the
    timing scripts' ``--against`` (scripts/time_attention.py, scripts/time_gemv.py). A header the
    revision lacks is skipped; a missing source or a failed build raises ``SystemExit`` in one line."""
    src = folder / rev.replace("/", "_")
    src.mkdir(parents=True)
    for path in files:
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
        if shown.returncode != 0 and not path.endswith(".h"):
            raise SystemExit(f"error: cannot read {path} at {rev}: {shown.stderr.strip()[:200]}")
        (src / Path(path).name).write_text(shown.stdout)
    out = src / "kernel.so"
    cc = compiler()
    if cc is None:
        raise SystemExit("error: no C compiler (cc or gcc) on the PATH: install gcc")
    sources = [str(src / Path(path).name) for path in files if path.endswith(".c")]
    made = subprocess.run([cc, *FLAGS, *sources, "-o", str(out), "-lm"], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"error: cannot build {', '.join(files)} at {rev}: {made.stderr.strip()[:200]}")
    return ctypes.CDLL(str(out))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.medusa_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_int]
    lib.medusa_gemv.restype = None
    lib.medusa_gemv_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_gemv_pack.restype = None
    lib.medusa_gemv_bf16.argtypes = lib.medusa_gemv.argtypes
    lib.medusa_gemv_bf16.restype = None
    lib.medusa_gemv_pick.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_void_p]
    lib.medusa_gemv_pick.restype = None
    lib.medusa_screen.argtypes = [*[ctypes.c_void_p] * 3, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_screen.restype = ctypes.c_int
    lib.medusa_screen_dot.restype = ctypes.c_int
    lib.medusa_screen_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_screen_pack.restype = None
    lib.medusa_screen_product.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_void_p, ctypes.c_int]
    lib.medusa_screen_product.restype = ctypes.c_int
    lib.medusa_gemv_pack_bf16.argtypes = lib.medusa_gemv_pack.argtypes
    lib.medusa_gemv_pack_bf16.restype = None
    lib.medusa_gemv_lanes.restype = ctypes.c_int
    lib.medusa_attention_lanes.restype = ctypes.c_int
    lib.medusa_attention_max_dim.restype = ctypes.c_int
    lib.medusa_rows_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_int] * 4,
                                          ctypes.c_float, *[ctypes.c_void_p] * 9, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_rows_attention.restype = ctypes.c_int
    lib.medusa_write_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 7]
    lib.medusa_write_rows.restype = None
    lib.medusa_decoder.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 3, *[ctypes.c_void_p] * 3, ctypes.c_float,
                                   ctypes.c_float, *[ctypes.c_void_p] * 10, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int]
    lib.medusa_decoder.restype = ctypes.c_int
    lib.medusa_decoder_fields.restype = ctypes.c_int
    lib.medusa_draft_layer.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                       *[ctypes.c_void_p] * 12, ctypes.c_int]
    lib.medusa_draft_layer.restype = ctypes.c_int
    _check(lib)
    return lib


def _check(lib: ctypes.CDLL) -> None:
    """A small product against torch's: a library that loads but computes garbage is damaged."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(37, 70, generator=gen), torch.randn(3, 70, generator=gen)
    got = _product(lib, x, _pack(lib, weight), 37)
    if not torch.allclose(got, x @ weight.T, atol=1e-4, rtol=1e-4):
        raise OSError("its products differ from torch's")


def library() -> ctypes.CDLL:
    """The built and loaded kernel library (built on first use; :class:`GemvUnavailable` if it
    cannot be). Both outcomes are kept for the process: a failing build is not retried at every
    call (``library.cache_clear()`` forgets them)."""
    got = _loaded()
    if isinstance(got, GemvUnavailable):
        raise GemvUnavailable(str(got))
    return got


@functools.cache
def _loaded() -> ctypes.CDLL | GemvUnavailable:
    try:
        return _library()
    except GemvUnavailable as err:
        return err


library.cache_clear = _loaded.cache_clear


def _library() -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise GemvUnavailable("no C compiler (cc or gcc) on the PATH to build the gemv kernels: "
                              "install gcc or set CC, or use kernels='onednn'")
    try:
        path = library_path(cc)
    except OSError as err:  # an install without the C source (package data left out)
        raise GemvUnavailable(f"the gemv kernels' source {err.filename} cannot be read ({err.strerror}): "
                              "reinstall medusa, or use kernels='onednn'") from None
    if path.exists():
        try:
            return _load(path)
        except OSError as err:
            log.warning("medusa: the cached gemv kernel library %s is damaged (%s); building it again",
                        path, str(err).splitlines()[0][:120])
            path.unlink(missing_ok=True)
    _build(cc, path)
    try:
        return _load(path)
    except OSError as err:
        path.unlink(missing_ok=True)
        raise GemvUnavailable(f"the gemv kernels built by {cc} do not load or compute wrongly "
                              f"({str(err).splitlines()[0][:120]}): use kernels='onednn'") from None


def unavailable_reason() -> str | None:
    """None if the kernels build and load here, else why not (one line)."""
    try:
        library()
    except GemvUnavailable as err:
        return str(err)
    return None


def available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``dtype`` layers on ``device`` can run these kernels (float32 on a CPU, built here)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and unavailable_reason() is None


def _pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    lanes = lib.medusa_gemv_lanes()
    weight = weight.detach().contiguous()
    packed = pages.empty(-(-out_features // lanes) * lanes * in_features, weight.dtype)  # read every pass: huge pages
    pack_fn = lib.medusa_gemv_pack_bf16 if weight.dtype == torch.bfloat16 else lib.medusa_gemv_pack
    pack_fn(weight.data_ptr(), out_features, in_features, packed.data_ptr(), torch.get_num_threads())
    return packed


def _product(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` times the packed weight, in float32 (a bfloat16 weight, ``packed.dtype``, is read as such)."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features).to(torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    if rows.shape[0]:
        fn = lib.medusa_gemv_bf16 if packed.dtype == torch.bfloat16 else lib.medusa_gemv
        args = (rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(), out_features, out.data_ptr(),
                torch.get_num_threads())
        if _profiling():  # a named op in torch.profiler's tables (scripts/profile_pass.py)
            with torch.profiler.record_function(f"{PROFILER_NAME} {rows.shape[0]}x{in_features}->{out_features}"):
                fn(*args)
        else:
            fn(*args)
    return out


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in], float32 or bfloat16, CPU) in the kernel's blocked layout, once."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"the gemv kernels take a 2-D float32 or bfloat16 CPU weight, not {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    return _pack(library(), weight)


def product(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack(weight)``: float32 ``x`` on the CPU; a
    bfloat16 weight takes bfloat16 (or float32) ``x``, multiplies in float32 and returns ``x``'s
    dtype (the bias added in float32 first)."""
    blocks, left = divmod(packed.numel(), max(x.shape[-1], 1))
    if left or not out_features <= blocks < out_features + 16:  # the kernel would read past the weight
        raise ValueError(f"an input of {x.shape[-1]} features does not fit a packed weight of {packed.numel()} "
                         f"values for {out_features} outputs")
    out = _product(library(), x, packed, out_features)
    if bias is not None:
        out.add_(bias)
    return out if packed.dtype == torch.float32 else out.to(x.dtype)


def pick(x: torch.Tensor, packed: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Outputs ``cols[i]`` of rows ``rows[i]`` of ``product(x, packed, ...)`` (float32 ``x``
    ``[n, K]``, a float32 packed weight), each the same bits the whole product gives it: a few
    outputs of a product without reading the rest of the weight (medusa/runtime/screen.py)."""
    if packed.dtype != torch.float32 or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"pick takes float32 rows [n, K] and a float32 packed weight, not {x.dtype} "
                         f"{tuple(x.shape)} and {packed.dtype}")
    x = x.contiguous()
    rows, cols = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    if rows.shape[0]:
        library().medusa_gemv_pick(x.data_ptr(), x.shape[1], packed.data_ptr(), rows.data_ptr(), cols.data_ptr(),
                                   rows.shape[0], out.data_ptr())
    return out


def screen(scores: torch.Tensor, norms: torch.Tensor, scale: torch.Tensor, pad: float,
           cap: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The candidates ``(rows, cols)`` of a vocabulary screen (medusa/runtime/screen.py): in each
    row ``r`` of ``scores`` ``[n, V]``, with the bound ``e_j = norms[j] * scale[r] + pad``, every
    ``j`` with ``scores[r, j] + e_j`` at least the row's largest ``scores[r, k] - e_k``. None when
    there are more than ``cap`` or a row is not finite."""
    scores, norms, scale = scores.contiguous(), norms.contiguous(), scale.to(torch.float32).contiguous()
    rows, cols = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
    n = library().medusa_screen(scores.data_ptr(), norms.data_ptr(), scale.data_ptr(), pad, scores.shape[0],
                                scores.shape[1], rows.data_ptr(), cols.data_ptr(), cap)
    return None if n < 0 else (rows[:n], cols[:n])


def dot_available() -> bool:
    """Whether these kernels were built with the CPU's bfloat16 dot products (AVX512-BF16)."""
    return bool(library().medusa_screen_dot())


def pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) in bfloat16, packed for :func:`dot_product` (where :func:`dot_available`)."""
    out_features, in_features = weight.shape
    half = weight.detach().to(torch.bfloat16).contiguous()
    packed = pages.empty(-(-out_features // 16) * 16 * (-(-in_features // 2)) * 2, torch.bfloat16)
    library().medusa_screen_pack(half.data_ptr(), out_features, in_features, packed.data_ptr(), torch.get_num_threads())
    return packed


def dot_product(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """About ``x @ weight.T`` (``packed = pack_dot(weight)``): ``x`` rounded to bfloat16 and
    the products summed in float32 by the CPU's bfloat16 dot products; ``[n, out]`` float32."""
    half = x.to(torch.bfloat16)
    if half.shape[-1] % 2:
        half = torch.nn.functional.pad(half, (0, 1))
    half = half.contiguous()
    out = torch.empty(half.shape[0], out_features, dtype=torch.float32)
    if not library().medusa_screen_product(half.data_ptr(), half.shape[0], half.shape[1] // 2, packed.data_ptr(),
                                           out_features, out.data_ptr(), torch.get_num_threads()):
        raise GemvUnavailable("these kernels were built without bfloat16 dot products")
    return out
