"""The device policy on a real GPU: save, load, generate, add, ask (both selectors) and verify with the
model on CUDA. Skipped without CUDA; run by benchmarks/gpu/run.sh."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
for mod in ("zarr", "faiss", "bm25s", "transformers"):
    pytest.importorskip(mod)

import kvmemory  # noqa: E402


@pytest.fixture
def tokenizer(cache_dir):
    from kvmemory.errors import KVMemoryError
    from kvmemory.model import default_model_dir, load_model
    try:
        return load_model(default_model_dir(cache_dir), cache_dir=cache_dir)[1]
    except (KVMemoryError, OSError) as e:
        pytest.skip(f"the default model's tokenizer is not available here: {e}")


def test_every_operation_runs_with_the_model_on_cuda(store_path, tokenizer, rng):
    from tests.conftest import make_tiny
    tok = tokenizer
    model = make_tiny(tok, seed=3).to("cuda")
    words = ["river", "lantern", "copper", "meadow", "falcon", "harbor"]
    with kvmemory.Memory(store_path, model=(model, tok), segment_blocks=2) as mem:
        ids = [rng.randrange(49152) for _ in range(600)]
        st = mem.save(ids)
        again = mem.load(st.id)
        assert torch.equal(again.kv, st.kv) and again.cache().layers[0].keys.device.type == "cuda"
        assert isinstance(mem.generate(st.id, "and then", max_new_tokens=3), str)
        mem.add(" ".join(rng.choice(words) for _ in range(900)) + " The vault code is 4417.", doc_id="d")
        for selector in ("text", "keys"):
            ans = mem.ask("What is the vault code?", selector=selector, max_new_tokens=3)
            assert ans.sources and ans.sources[0][0] == "d"
        assert mem.verify(recompute=True) == []
