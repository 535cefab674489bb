"""Keys of encrypted stores, held outside them.

An encrypted store (kvmemory/store/seal.py) encrypts with data keys: one for its shared documents,
one per owner (a chat user). A data key is 32 random bytes, never written anywhere in plain: a
KeyProvider keeps it wrapped (AES-256-GCM) by a master key. Destroying an owner's data key is how
kvmemory forgets a user for good: from then on no copy of the store (a backup, an S3 object
version, a copied disk) can decrypt what that user's key sealed.

    KeyProvider        the interface (get, create, destroy, rotate): a cloud KMS fits behind it
    LocalKeyProvider   the built-in one: a keyring directory held apart from the store, one file
                       per wrapped data key, the master key from KVMEMORY_MASTER_KEY (64 hex
                       digits) or the file KVMEMORY_MASTER_KEY_FILE names

A keyring directory holds:
    master.json          the id of the master key that wraps its keys (a wrong master key is refused
                         before anything is read or written)
    <name>.key           one wrapped data key: {"master": id, "nonce": hex, "key": hex}
    <name>.destroyed     a destroyed key's tombstone: forgetting finishes from it after a crash

Rotating the master key re-wraps every data key (each file replaced atomically, master.json
last); the data is not touched. An interrupted rotation is finished by running it again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from abc import ABC, abstractmethod
from pathlib import Path

from kvmemory.errors import InputError, StoreKeyError, WrongKeyError
from kvmemory.store.durable import fsync_dir, replace_file, unlink
from kvmemory.store.seal import key_fingerprint

MASTER_ENV = "KVMEMORY_MASTER_KEY"            # the master key: 64 hex digits
MASTER_FILE_ENV = "KVMEMORY_MASTER_KEY_FILE"  # or a file holding them
KEYRING_ENV = "KVMEMORY_KEYRING"              # the keyring directory (apart from every store)
KEY_BYTES = 32
NAME = re.compile(r"^[0-9a-z][0-9a-z-]{0,127}$")


def new_master_key() -> str:
    """A fresh master key, as the 64 hex digits KVMEMORY_MASTER_KEY takes."""
    return secrets.token_hex(KEY_BYTES)


def parse_master_key(text: str, where: str) -> bytes:
    """32 bytes from 64 hex digits (surrounding whitespace ignored); StoreKeyError otherwise."""
    raw = text.strip()
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise StoreKeyError(f"{where} is not a master key: it must be {2 * KEY_BYTES} hex digits "
                            "(`kvmemory keys new` prints one)")
    return key


def key_id(key: bytes) -> str:
    """A key's public id (hex): says which key wrapped or sealed something, reveals nothing of it
    (the id a sealed block records, kvmemory/store/seal.py)."""
    return key_fingerprint(key).hex()


class KeyProvider(ABC):
    """Data keys by name. get and create return the 32-byte key; destroy makes it unrecoverable
    from this provider (the commit point of forgetting); destroyed(name) says whether it was.
    Names are lowercase hex and dashes (kvmemory/store/seal.py makes them)."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """The data key called `name`, None if there is none (never created, or destroyed)."""

    @abstractmethod
    def create(self, name: str) -> bytes:
        """A new random data key called `name` (an existing one is returned as it is)."""

    @abstractmethod
    def destroy(self, name: str) -> bool:
        """Destroy the data key `name`, durably, before returning. Returns whether one existed."""

    @abstractmethod
    def destroyed(self, name: str) -> bool:
        """Whether a key called `name` was destroyed (and not created again since)."""

    def describe(self) -> str:
        return type(self).__name__

    def contains(self, path: Path) -> bool:
        """Whether this provider keeps its keys under `path` (a store must not hold its own keys)."""
        return False


class LocalKeyProvider(KeyProvider):
    """Data keys wrapped by a master key, one file each in a keyring directory held apart from the
    store (a copy of the store alone holds no key)."""

    def __init__(self, keyring, master: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if not isinstance(master, bytes) or len(master) != KEY_BYTES:
            raise StoreKeyError(f"a master key is {KEY_BYTES} bytes")
        self.root = Path(keyring)
        self._aes = AESGCM(master)
        self.master_id = key_id(master)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreKeyError(f"cannot use the keyring {self.root}: {e.strerror or e}") from None
        head = self.root / "master.json"
        try:
            have = json.loads(head.read_text())["master"]
        except FileNotFoundError:
            have = None
        except (ValueError, KeyError, TypeError) as e:
            raise StoreKeyError(f"the keyring {self.root} is damaged ({head}: {e})") from None
        if have is None:
            replace_file(head, json.dumps({"master": self.master_id}).encode())
        elif have != self.master_id:
            raise WrongKeyError(f"the keyring {self.root} is wrapped by master key {have}, not by the one given "
                                f"({self.master_id}): give its master key (KVMEMORY_MASTER_KEY / "
                                f"KVMEMORY_MASTER_KEY_FILE); nothing was read or changed")

    @classmethod
    def from_env(cls, env=None) -> "LocalKeyProvider":
        """The provider the environment names: KVMEMORY_KEYRING and KVMEMORY_MASTER_KEY(_FILE)."""
        env = os.environ if env is None else env
        ring = env.get(KEYRING_ENV)
        if not ring:
            raise StoreKeyError(f"an encrypted store needs its keys: set {KEYRING_ENV} (a directory apart from the "
                                f"store) and {MASTER_ENV} or {MASTER_FILE_ENV}, or pass keys= (a KeyProvider)")
        if env.get(MASTER_ENV):
            master = parse_master_key(env[MASTER_ENV], MASTER_ENV)
        elif env.get(MASTER_FILE_ENV):
            try:
                text = Path(env[MASTER_FILE_ENV]).read_text()
            except OSError as e:
                raise StoreKeyError(f"cannot read the master key file {env[MASTER_FILE_ENV]}: "
                                    f"{e.strerror or e}") from None
            master = parse_master_key(text, env[MASTER_FILE_ENV])
        else:
            raise StoreKeyError(f"the keyring {ring} needs its master key: set {MASTER_ENV} (64 hex digits) or "
                                f"{MASTER_FILE_ENV} (a file holding them)")
        return cls(ring, master)

    def describe(self) -> str:
        return f"keyring {self.root}"

    def contains(self, path: Path) -> bool:
        try:
            Path(path).resolve().relative_to(self.root.resolve())
            return True
        except ValueError:
            pass
        try:
            self.root.resolve().relative_to(Path(path).resolve())
            return True
        except ValueError:
            return False

    def _path(self, name: str, ext: str = ".key") -> Path:
        if not isinstance(name, str) or not NAME.match(name):
            raise InputError(f"a key name is lowercase hex digits and dashes, got {name!r}")
        return self.root / (name + ext)

    def _unwrap(self, name: str, raw: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag
        try:
            rec = json.loads(raw)
            nonce, wrapped, master = bytes.fromhex(rec["nonce"]), bytes.fromhex(rec["key"]), rec["master"]
        except (ValueError, KeyError, TypeError) as e:
            raise StoreKeyError(f"the key file {self._path(name)} is damaged: {e}") from None
        if master != self.master_id:
            raise WrongKeyError(f"the key {name} in {self.root} is wrapped by master key {master}, not {self.master_id} "
                                "(a rotation that did not finish? run it again)")
        try:
            return self._aes.decrypt(nonce, wrapped, name.encode())
        except InvalidTag:
            raise WrongKeyError(f"the key file {self._path(name)} does not open with master key {self.master_id} "
                                "(damaged, or made by another keyring)") from None

    def _wrap(self, name: str, key: bytes) -> bytes:
        return _wrap(self._aes, self.master_id, name, key)

    def get(self, name: str) -> bytes | None:
        try:
            raw = self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreKeyError(f"cannot read the key {self._path(name)}: {e.strerror or e}") from None
        return self._unwrap(name, raw)

    def create(self, name: str) -> bytes:
        have = self.get(name)
        if have is not None:
            return have
        key = os.urandom(KEY_BYTES)
        path = self._path(name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(self._wrap(name, key))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)                # create-only: of two creators one key wins
            except FileExistsError:
                return self.get(name) or key
            finally:
                unlink(tmp)
            unlink(self._path(name, ".destroyed"))
            fsync_dir(self.root)
        except OSError as e:
            raise StoreKeyError(f"cannot write the key {path}: {e.strerror or e}") from None
        return self.get(name) or key

    def destroy(self, name: str) -> bool:
        path = self._path(name)
        try:
            replace_file(self._path(name, ".destroyed"), b"{}")   # the tombstone first: a crash finishes from it
            existed = path.exists()
            unlink(path)
            fsync_dir(self.root)
        except OSError as e:
            raise StoreKeyError(f"cannot destroy the key {path}: {e.strerror or e}") from None
        return existed

    def destroyed(self, name: str) -> bool:
        return self._path(name, ".destroyed").exists() and not self._path(name).exists()

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.key"))

    def rotate(self, new_master: bytes) -> int:
        """Re-wrap every data key with `new_master`; master.json names it last. Keys already wrapped
        by it (an earlier rotation cut short) are skipped. Returns the keys re-wrapped."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        aes, master_id = AESGCM(new_master), key_id(new_master)
        done = 0
        for name in self.names():
            raw = self._path(name).read_bytes()
            if json.loads(raw).get("master") == master_id:
                continue
            replace_file(self._path(name), _wrap(aes, master_id, name, self._unwrap(name, raw)))
            done += 1
        replace_file(self.root / "master.json", json.dumps({"master": master_id}).encode())
        self._aes, self.master_id = aes, master_id
        return done


def _wrap(aes, master_id: str, name: str, key: bytes) -> bytes:
    """A key file's bytes: `key` wrapped by the master key (`aes`, an AESGCM of it), its name as AAD."""
    nonce = os.urandom(12)
    return json.dumps({"master": master_id, "nonce": nonce.hex(),
                       "key": aes.encrypt(nonce, key, name.encode()).hex()}).encode()
