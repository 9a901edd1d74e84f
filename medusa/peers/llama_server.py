"""llama.cpp's own ``llama-server`` (continuous batching over ``--parallel`` slots), the peer the
serving benchmark runs beside this project's server.

The llama.cpp sources ship inside llama-cpp-python's source distribution (``vendor/llama.cpp``),
so the server is built here from PyPI with cmake, once, into ``~/.cache/medusa/llama-server``
(``$MEDUSA_CACHE``), and reused; a stamp written last names the version it was built from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from medusa.errors import MedusaError
from medusa.runtime.files import cache_root

VERSION = "0.3.36"  # llama-cpp-python's sdist; the llama.cpp peer's worker pins the same


def build_dir() -> Path:
    return cache_root() / "llama-server"


def binary(folder: Path | None = None) -> Path:
    return (folder or build_dir()) / "bin" / "llama-server"


def ensure_llama_server(folder: Path | None = None, log=print) -> Path:
    """The ``llama-server`` binary, built first if missing (minutes on 2 cores)."""
    folder = folder or build_dir()
    stamp = folder / ".built-from"
    if binary(folder).is_file() and stamp.is_file() and stamp.read_text().strip() == VERSION:
        return binary(folder)
    for tool in ("cmake", "c++"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise MedusaError(f"building llama-server needs {tool}: install it (apt-get install cmake g++)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        log(f"medusa: building llama-server from llama-cpp-python {VERSION}'s sources (minutes, once)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"], check=True, capture_output=True)
        done = subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise MedusaError(f"building llama-server failed: {done.stderr.strip().splitlines()[-1:]}")
        (folder / "bin").mkdir(exist_ok=True)
        built = next(build.rglob("llama-server"))
        tmp_bin = binary(folder).with_suffix(".tmp")
        tmp_bin.write_bytes(built.read_bytes())
        tmp_bin.chmod(0o755)
        tmp_bin.replace(binary(folder))
    stamp.write_text(VERSION)
    return binary(folder)


def server_command(gguf: Path, port: int, parallel: int, threads: int, ctx_per_slot: int = 2048) -> list[str]:
    """``llama-server`` on 127.0.0.1 with ``parallel`` slots of ``ctx_per_slot`` tokens each
    (continuous batching is on by default in llama-server)."""
    return [str(binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "-c", str(ctx_per_slot * parallel), "-t", str(threads), "-ngl", "0"]
