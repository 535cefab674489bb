"""ObjectFiles: a store's files under a prefix of an S3-compatible bucket, with obstore (Rust
object_store). A create is a PUT with `If-None-Match: *`, which S3 (since 2024), MinIO, Ceph RGW,
R2 and moto refuse with 412 when the name exists: of two committers racing for the same record,
exactly one wins; the other gets `StoreExistsError`. No lock spans machines (`exclusive` is
False): committers claim shards of their own (kvmemory/store/commit.py).

Why obstore and not s3fs: one native client for the commit log, the Zarr arrays and the range
reads of the cache tier; conditional PUT (`mode="create"`) is a first-class argument (fsspec has
no portable create-only write); no asyncio event loop of its own to collide with zarr's; and it
reads the standard AWS_* environment variables.
"""

from __future__ import annotations

import os
from datetime import timedelta
from urllib.parse import urlparse

from kvmemory.errors import InputError, MissingDependencyError, StoreError, StoreExistsError

_SCHEMES = ("s3",)
CLAIMS_DIR = "claims"            # claims/<shard> names the committer that owns a shard


class ObjectFiles:
    """A store's files under a prefix of an S3-compatible bucket (obstore).

    Credentials, region and endpoint come from the usual environment variables
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL,
    AWS_ALLOW_HTTP=true for a plain-HTTP server) or from `storage_options` (obstore S3 config
    keys, e.g. {"endpoint": ..., "access_key_id": ..., "allow_http": True}), which win."""

    remote = True
    exclusive = False              # machines commit without a common lock

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        try:
            import obstore
            import obstore.store as ost
        except ImportError:
            raise MissingDependencyError("an s3:// store needs obstore: pip install 'kvmemory[s3]'") from None
        u = urlparse(url)
        if u.scheme not in _SCHEMES or not u.netloc:
            raise InputError(f"{url!r}: an object-store location is s3://bucket/prefix")
        self.url = f"{u.scheme}://{u.netloc}/{u.path.strip('/')}".rstrip("/")
        self.bucket, self.prefix = u.netloc, u.path.strip("/")
        opts = {k.lower(): v for k, v in (storage_options or {}).items()}
        client = {}
        for k in ("allow_http", "timeout", "connect_timeout"):
            if k in opts:
                client[k] = opts.pop(k)
        env_http = os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
        if env_http and "allow_http" not in client:
            client["allow_http"] = True
        if "endpoint" not in opts and os.environ.get("AWS_ENDPOINT_URL"):
            opts["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
        if "region" not in opts and not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
            opts["region"] = "us-east-1"
        # fail in seconds, not minutes, when the service is unreachable (object_store's default
        # retries for 3 minutes); transient errors are still retried
        retry = {"max_retries": int(opts.pop("max_retries", 3)),
                 "retry_timeout": timedelta(seconds=float(opts.pop("retry_timeout", 30)))}
        self._ob = obstore
        self._config, self._client, self._retry = opts or None, client or None, retry
        try:
            self.store = ost.S3Store(self.bucket, prefix=self.prefix or None, config=opts or None,
                                     client_options=client or None, retry_config=retry)
        except Exception as e:  # obstore raises its own config errors
            raise StoreError(f"cannot configure object store {self.url}: {e}") from None

    def describe(self) -> str:
        return self.url

    def _err(self, what: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"object store {self.url}: cannot {what} {key}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300]}")

    def read(self, key: str) -> bytes:
        try:
            return self._ob.get(self.store, key).bytes().to_bytes()
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._err("read", key, e) from None

    def create(self, key: str, data: bytes) -> None:
        """PUT with If-None-Match: *; StoreExistsError if the name exists."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            self._ob.put(self.store, key, data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            raise StoreExistsError(f"cannot write {self.url}/{key}: it already exists") from None
        except Exception as e:
            raise self._err("write", key, e) from None

    def exists(self, key: str) -> bool:
        try:
            self._ob.head(self.store, key)
            return True
        except FileNotFoundError:
            return False
        except Exception as e:
            raise self._err("look up", key, e) from None

    def list(self, prefix: str, after: str | None = None) -> list[str]:
        """Names directly under `prefix`/ (objects, not deeper levels); with `after` (a key), only the
        names after it (S3 start-after: the listing starts there instead of at the first name)."""
        p = prefix.rstrip("/") + "/"
        try:
            if after is None:
                res = self._ob.list_with_delimiter(self.store, p)["objects"]
            else:
                res = [o for batch in self._ob.list(self.store, p, offset=after) for o in batch]
        except Exception as e:
            raise self._err("list", prefix, e) from None
        names = (o["path"] for o in res)                 # relative to the store's prefix
        return sorted(n[len(p):] for n in names if n.startswith(p) and "/" not in n[len(p):])

    def walk(self, prefix: str = "") -> list[tuple[str, int]]:
        """(key, size) of every object under prefix."""
        try:
            out = []
            for batch in self._ob.list(self.store, prefix or None):
                out += [(o["path"], int(o["size"])) for o in batch]
            return out
        except Exception as e:
            raise self._err("list", prefix, e) from None

    def delete(self, key: str) -> None:
        try:
            self._ob.delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._err("delete", key, e) from None

    def remove(self, key: str) -> int:
        """Best-effort removal of a data object no commit names (rows no record names are never read)."""
        try:
            self.delete(key)
        except StoreError:
            return 0
        return 1

    def sync(self, keys: list[str], top: str) -> None:
        """Nothing to do: a PUT is durable when it returns."""

    def clean_leftovers(self, first_shard: int, arrays, dirs) -> int:
        """Nothing: with no lock, a shard past the last commit may be another committer's work in
        progress (rows a failed commit claimed stay unnamed, never read)."""
        return 0

    def total_bytes(self) -> int:
        return sum(n for k, n in self.walk() if not k.startswith(CLAIMS_DIR + "/"))

    def zarr_store(self, sub: str, read_only: bool):
        import obstore.store as ost
        from zarr.storage import ObjectStore

        prefix = "/".join(p for p in (self.prefix, sub) if p)
        inner = ost.S3Store(self.bucket, prefix=prefix or None, config=self._config, client_options=self._client,
                            retry_config=self._retry)
        return ObjectStore(inner, read_only=read_only)
