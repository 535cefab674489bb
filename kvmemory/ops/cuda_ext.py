"""Build (once, with nvcc, into the user cache) and load kvmemory's CUDA kernels.

The kernels in cuda/ are plain CUDA C++ with `extern "C"` launchers over raw pointers, loaded
with ctypes: building them needs nvcc but not torch's CUDA headers, and `make cuda-check`
compiles them in CI on machines without a GPU. `load()` returns None when there is no CUDA
device, no nvcc, or the build failed; `why_not()` says which. Callers then use the torch
reference, which is held to the same tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = ("gather_blocks.cu", "window_attention.cu")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_state: dict = {}


def source_dir() -> Path:
    """cuda/ of the source tree, or the copy installed beside this package."""
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "cuda", here.parent / "cuda"):
        if (cand / SOURCES[0]).is_file():
            return cand
    raise FileNotFoundError("kvmemory's cuda/ sources are not available")


def why_not() -> str:
    load()
    return _state.get("why", "")


def load():
    """The loaded kernel library (a Kernels object), or None."""
    if "lib" in _state:
        return _state["lib"]
    _state["lib"] = None
    if not torch.cuda.is_available():
        _state["why"] = "no CUDA device"
        return None
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    try:
        src = source_dir()
        major, minor = torch.cuda.get_device_capability()
        lib = _build(src, nvcc, f"{major}{minor}")
        _state["lib"] = Kernels(ctypes.CDLL(str(lib)))
    except (OSError, FileNotFoundError, subprocess.CalledProcessError, TypeError) as e:
        _state["why"] = f"build failed: {e}"
    return _state["lib"]


def _build(src: Path, nvcc: str | None, arch: str) -> Path:
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    h = hashlib.sha256(arch.encode())
    for f in sorted(src.glob("*.cu*")):
        h.update(f.read_bytes())
    from kvmemory.config import RuntimeConfig, from_env
    out_dir = from_env(RuntimeConfig).resolved_cache_dir() / "cuda" / h.hexdigest()[:16]
    lib = out_dir / "libkvmemory_cuda.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir))
    cmd = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           *[str(src / s) for s in SOURCES], "-o", str(tmp / lib.name)]
    subprocess.run(cmd, check=True, capture_output=True)
    os.replace(tmp / lib.name, lib)
    shutil.rmtree(tmp, ignore_errors=True)
    return lib


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


class Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.kvm_gather_blocks.restype = ctypes.c_int
        lib.kvm_window_attention.restype = ctypes.c_int

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} kernel failed with CUDA error {err}")

    def gather_blocks(self, pool, idx, n, dst, shift, out, freqs) -> None:
        """pool [P, L, 2, H, C, D] and out [L, 2, H, T, D], both contiguous on the same device."""
        if not (pool.is_contiguous() and out.is_contiguous()):
            raise ValueError("gather_blocks kernel needs contiguous pool and out")
        P, L, _, H, C, D = pool.shape
        stream = ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)
        ints = [t.to(torch.int64).contiguous() for t in (idx, n, dst, shift)]
        self._check(self.lib.kvm_gather_blocks(
            ctypes.c_int(DTYPES[out.dtype]), _ptr(pool), *[_ptr(t) for t in ints], _ptr(out),
            _ptr(freqs.float().contiguous()), ctypes.c_int(len(idx)), ctypes.c_int(L), ctypes.c_int(H),
            ctypes.c_int(C), ctypes.c_int(D), ctypes.c_int64(out.shape[3]), stream), "gather_blocks")

    def window_attention(self, q, k, v, strides, table, page_size, seq_len, scale, out) -> None:
        nq, Hq, D = q.shape
        Hkv = strides[3]
        stream = ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream)
        self._check(self.lib.kvm_window_attention(
            ctypes.c_int(DTYPES[q.dtype]), _ptr(q), _ptr(k), _ptr(v), ctypes.c_int64(strides[0]),
            ctypes.c_int64(strides[1]), ctypes.c_int64(strides[2]), _ptr(table), ctypes.c_int(page_size),
            ctypes.c_int(seq_len), ctypes.c_int(nq), ctypes.c_int(Hq), ctypes.c_int(Hkv), ctypes.c_int(D),
            ctypes.c_float(scale), _ptr(out), stream), "window_attention")
