import pytest

from kvmemory.config import RuntimeConfig, StoreConfig, from_env
from kvmemory.errors import InputError


def test_defaults_and_env_override():
    assert StoreConfig().block_tokens == 256
    c = from_env(StoreConfig, env={"KVMEMORY_BLOCK_TOKENS": "64", "KVMEMORY_CODEC": "zstd"})
    assert (c.block_tokens, c.codec) == (64, "zstd")
    assert from_env(StoreConfig, env={"KVMEMORY_BLOCK_TOKENS": "64"}, block_tokens=32).block_tokens == 32
    assert from_env(RuntimeConfig, env={"KVMEMORY_LOCK_TIMEOUT": "2.5"}).lock_timeout_s == 2.5


@pytest.mark.parametrize("kw", [{"block_tokens": 0}, {"shard_blocks": 0}, {"codec": "lzma"}])
def test_invalid_store_config(kw):
    with pytest.raises(InputError):
        StoreConfig(**kw)


def test_invalid_env_value_names_variable():
    with pytest.raises(InputError, match="KVMEMORY_BLOCK_TOKENS"):
        from_env(StoreConfig, env={"KVMEMORY_BLOCK_TOKENS": "many"})


def test_invariant_mode_from_the_environment():
    assert from_env(RuntimeConfig, env={}).invariant is False
    assert from_env(RuntimeConfig, env={"KVMEMORY_INVARIANT": "1"}).invariant is True
    assert from_env(RuntimeConfig, env={"KVMEMORY_INVARIANT": "off"}).invariant is False
    assert from_env(RuntimeConfig, env={"KVMEMORY_INVARIANT": "1"}, invariant=False).invariant is False
    with pytest.raises(InputError, match="KVMEMORY_INVARIANT"):
        from_env(RuntimeConfig, env={"KVMEMORY_INVARIANT": "maybe"})
