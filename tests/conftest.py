"""Shared fixtures: the real default model (loaded once), tiny random models of the same
architecture for fast plumbing tests, and a fresh random seed per run (printed, and
reproducible with KVMEMORY_TEST_SEED)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from kvmemory.config import RuntimeConfig, from_env  # noqa: E402
from kvmemory.model import default_model_dir, load_model  # noqa: E402

SEED = int(os.environ.get("KVMEMORY_TEST_SEED") or random.SystemRandom().randrange(2**31))


def pytest_report_header(config):
    from tests.bounds import FULL
    size = "full sizes (KVMEMORY_FULL_TESTS=1)" if FULL else "bounded (KVMEMORY_FULL_TESTS=1 for the full sizes)"
    return f"kvmemory test seed: {SEED} (reproduce with KVMEMORY_TEST_SEED={SEED}); long tests {size}"


def pytest_terminal_summary(terminalreporter):
    # the header is not shown under -q (make test, CI): the seed a failure needs is given here too
    terminalreporter.write_line(f"kvmemory test seed: {SEED} (reproduce with KVMEMORY_TEST_SEED={SEED})")


@pytest.fixture
def rng():
    return random.Random(SEED)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return from_env(RuntimeConfig).resolved_cache_dir()


@pytest.fixture(scope="session")
def default_dir(cache_dir) -> Path:
    """The converted default model (converted once per machine, then cached)."""
    return default_model_dir(cache_dir)


@pytest.fixture(scope="session")
def real_model(default_dir, cache_dir):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct in fp32."""
    model, tok, _ = load_model(default_dir, cache_dir=cache_dir)
    return model, tok


def make_tiny(tokenizer, seed: int, layers: int = 2):
    """A random-weight Llama with the default model's vocabulary and RoPE, in miniature."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                      rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tokenizer(request):
    """The default model's tokenizer, from its files alone (the weights are not loaded); from the folder
    KVMEMORY_TEST_TOKENIZER names where it is set (the GPU machine: .gpu/tokenizer, not the model)."""
    from transformers import AutoTokenizer
    where = os.environ.get("KVMEMORY_TEST_TOKENIZER")
    return AutoTokenizer.from_pretrained(where or request.getfixturevalue("default_dir"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A local transformers directory with a tiny random model and the real tokenizer."""
    tok = tokenizer
    d = tmp_path_factory.mktemp("tiny-model")
    make_tiny(tok, seed=1).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny(tiny_dir, cache_dir):
    model, tok, _ = load_model(tiny_dir, cache_dir=cache_dir)
    return model, tok


@pytest.fixture
def store_path(tmp_path) -> Path:
    return tmp_path / "s.kvm"


@pytest.fixture
def make_memory(tmp_path, tiny):
    """A factory of Memory objects: make_memory(name="s.kvm", model=tiny, **kwargs) opens (or creates)
    tmp_path/name with the tiny model unless another is given; every one is closed at the end."""
    import kvmemory
    made = []

    def make(name: str = "s.kvm", model=None, **kwargs):
        m = kvmemory.Memory(tmp_path / name, model=tiny if model is None else model, **kwargs)
        made.append(m)
        return m
    yield make
    for m in made:
        m.close()
