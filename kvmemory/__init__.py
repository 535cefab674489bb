"""kvmemory: byte-exact, content-addressed KV-cache memory for frozen causal language models.

    import kvmemory
    with kvmemory.Memory("notes.kvm") as mem:   # opens or creates; embedded default model
        state = mem.save("a prompt")            # -> State; state.id is its content address
        again = mem.load(state.id)              # verified read
        cache = again.cache()                   # transformers Cache, ready for model(...)

Heavy dependencies (torch, transformers, zarr) load on first use of Memory.
"""

from kvmemory.errors import (CompactStoreError, DocumentNotFoundError, EmptyStoreError, InputError, KVMemoryError,
                             KeyDestroyedError, MissingDependencyError, ModelLoadError, ModelMismatchError,
                             StateNotFoundError, StoreCorruptError, StoreError, StoreExistsError, StoreKeyError,
                             StoreLockedError, StoreReadOnlyError, VerificationError, WindowExceededError,
                             WrongKeyError)

__version__ = "0.1.0"

__all__ = ["AskOptions", "CompactStoreError", "DocumentNotFoundError", "EmptyStoreError", "InputError", "KVMemoryError",
           "KeyDestroyedError", "Memory", "MissingDependencyError", "ModelLoadError", "ModelMismatchError", "State",
           "StateNotFoundError", "StoreCorruptError", "StoreError", "StoreExistsError", "StoreKeyError",
           "StoreLockedError", "StoreReadOnlyError", "VerificationError", "WindowExceededError", "WrongKeyError",
           "__version__"]


def __getattr__(name):  # lazy: `import kvmemory` stays light
    if name in ("Memory", "State", "StateInfo"):
        from kvmemory import memory

        return getattr(memory, name)
    if name == "AskOptions":
        from kvmemory.options import AskOptions
        return AskOptions
    raise AttributeError(f"module 'kvmemory' has no attribute {name!r}")
