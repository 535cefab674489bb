"""Typed errors. Every error kvmemory raises on purpose subclasses KVMemoryError."""

from __future__ import annotations


class KVMemoryError(Exception):
    """Base class of every error kvmemory raises on purpose."""


class InputError(KVMemoryError, ValueError):
    """The caller passed something kvmemory cannot use (empty text, bad bytes, bad ids)."""


class WindowExceededError(InputError):
    """A sequence is longer than the model's positional window."""


class ModelMismatchError(KVMemoryError):
    """The store was written by a model whose fingerprint differs from the one in use."""

    def __init__(self, store_fingerprint: str, model_fingerprint: str, path: str = "", hint: str = "") -> None:
        self.store_fingerprint = store_fingerprint
        self.model_fingerprint = model_fingerprint
        where = f" {path}" if path else ""
        super().__init__(
            f"store{where} belongs to model fingerprint {store_fingerprint}, but the model in use "
            f"has fingerprint {model_fingerprint}; " + (hint or "open it with the model that wrote it")
        )


class StoreError(KVMemoryError):
    """The store cannot be opened or written (not a store, not a directory, ...)."""


class StoreCorruptError(StoreError):
    """Bytes read back do not match their digest, or a chunk/manifest cannot be decoded."""


class StoreExistsError(StoreError, FileExistsError):
    """A write-once name (a commit record, a claim, a library entry) is already taken: another
    writer got there first. Nothing was overwritten."""


class StoreReadOnlyError(StoreError):
    """A write was attempted on a store opened read-only."""


class StoreLockedError(StoreError):
    """Another writer holds the store's lock and did not release it in time."""


class StoreKeyError(StoreError):
    """An encrypted store's key is missing, destroyed or not the right one: nothing was decrypted."""


class WrongKeyError(StoreKeyError):
    """A master key or data key is not the one that wrapped or sealed what is read."""


class KeyDestroyedError(StoreKeyError):
    """What is read was sealed by a data key that was destroyed (its owner was forgotten)."""


class CompactStoreError(StoreError):
    """What a compact (lossy-encoded) store cannot do: take new blocks (they are encoded from an
    exact store by `kvmemory compact`), or prove E3 (its blocks are not the exact KV)."""


class StateNotFoundError(KVMemoryError, KeyError):
    """No committed state has the given id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "state not found"


class DocumentNotFoundError(KVMemoryError, KeyError):
    """No deposited document has the given id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "document not found"


class EmptyStoreError(KVMemoryError):
    """ask() on a store that holds no documents."""


class ModelLoadError(KVMemoryError):
    """The model could not be loaded (missing package, bad directory, unsupported model)."""


class MissingDependencyError(KVMemoryError, ImportError):
    """An optional part of kvmemory was used without the extra that installs what it needs."""


class VerificationError(KVMemoryError):
    """A solution failed its verifier (Memory.learn); nothing was stored."""
