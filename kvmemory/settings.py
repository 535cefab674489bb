"""One typed configuration: every `kvmemory serve` flag and every KVMEMORY_* setting in one schema.

Each setting has a field here, an environment variable (its ENV name; most are KVMEMORY_ + the
field's name in capitals) and, for `serve`, a flag (--field-name). Precedence, highest first:

    1. a flag on the command line (or an argument in Python)
    2. the environment variable
    3. the configuration file (`kvmemory serve --config kvmemory.toml`: `name = value` lines at the
       top level or under a [kvmemory] table; a name that is not a setting is an error)
    4. the default

`kvmemory serve --print-config` prints every setting in force and where it came from. A value that
does not validate is an InputError naming the setting and its source. The API key itself is read
from KVMEMORY_API_KEY or the --api-key-file, never from a configuration file, and never printed.

StoreConfig and RuntimeConfig (kvmemory/config.py) are built from these values (config.from_env).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvmemory.errors import InputError

# field -> its environment variable where it is not KVMEMORY_ + the name in capitals
_ENV_NAMES = {"lock_timeout_s": "KVMEMORY_LOCK_TIMEOUT"}


class Settings(BaseSettings):
    """Every setting, typed. None: the default of the place it is used (a store being created for
    chat memory takes 64-token blocks, a document store 256, ...)."""

    model_config = SettingsConfigDict(env_prefix="KVMEMORY_", extra="forbid", frozen=True,
                                      populate_by_name=True)

    # ---- a store being created (StoreConfig)
    block_tokens: int | None = Field(None, ge=1, le=65536, description="tokens per block (default 256)")
    prefill_tokens: int | None = Field(None, ge=0, description="tokens per forward of the canonical prefill")
    shard_blocks: int | None = Field(None, ge=1, le=4096, description="blocks per Zarr shard file")
    codec: Literal["none", "zstd", "lz4"] | None = Field(None, description="the blocks' lossless codec")
    encrypt: bool | None = Field(None, description="encrypt a store being created at rest (AES-256-GCM)")
    # ---- the process (RuntimeConfig)
    lock_timeout_s: float | None = Field(None, ge=0, description="seconds a writer waits for another's lock")
    cache_dir: Path | None = Field(None, description="where converted model weights are cached")
    host_cache_bytes: int | None = Field(None, ge=0, description="the pager's host-RAM budget")
    gpu_cache_bytes: int | None = Field(None, ge=0, description="the pager's GPU block pool budget")
    store_cache_bytes: int | None = Field(None, ge=0, description="local disk tier of an s3:// store")
    invariant: bool | None = Field(None, description="compute with the invariant kernels")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="what the model computes in")
    device: str | None = Field(None, pattern=r"^(cpu|cuda|auto|cuda:\d+)$", description="cpu, cuda, cuda:N or auto")
    model: str | None = Field(None, description="a model directory, a .gguf file or a Hub id in the local cache")
    # ---- the server (kvmemory serve)
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="the port to listen on")
    api_key_file: Path | None = Field(None, description="a file holding the bearer token clients must send")
    queue: int = Field(32, ge=1, description="requests that may wait for the model; more get 429")
    batch: int = Field(8, ge=1, description="requests in flight at once, their decoding batched")
    ask_rerank: int | None = Field(None, ge=0, le=64, description="the re-rank of an ask that does not set it")
    invariant_rows: bool | None = Field(None, description="batched rows reduced as each alone")
    max_body_mb: int = Field(16, ge=1, description="request size limit in MiB (413)")
    ray: str | None = Field(None, description="serve with Ray Serve: a cluster's address or 'local'")
    replicas: int = Field(2, ge=1, description="Ray Serve replicas")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the log level")
    log_format: Literal["text", "json"] = Field("text", description="text or json lines")
    metrics: bool = Field(True, description="record and serve /metrics (Prometheus)")


FIELDS = tuple(Settings.model_fields)
SERVE_ONLY = ("host", "port", "api_key_file", "queue", "batch", "ask_rerank", "invariant_rows", "max_body_mb", "ray",
              "replicas", "log_level", "log_format", "metrics")


def env_name(field: str) -> str:
    """The environment variable of a setting."""
    return _ENV_NAMES.get(field, "KVMEMORY_" + field.upper())


ENV = {env_name(f): f for f in FIELDS}        # variable -> field


def read_file(path) -> dict[str, Any]:
    """A configuration file's settings: `name = value` at the top level or under [kvmemory]."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"cannot read the configuration file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"the configuration file {path} is not valid TOML: {e}") from None
    table = data.pop("kvmemory", {})
    if not isinstance(table, dict):
        raise InputError(f"{path}: [kvmemory] must be a table")
    data.update(table)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise InputError(f"{path}: unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(FIELDS)}")
    return data


def load(flags: dict[str, Any] | None = None, config_file=None,
         env: dict[str, str] | None = None) -> tuple[Settings, dict[str, str]]:
    """The settings in force: flags (None values: not given) over the environment over the file over
    the defaults. Returns them and, per field, where its value came from ("flag", "env VAR",
    "file PATH" or "default")."""
    import os
    from collections.abc import Mapping

    environ: Mapping[str, str] = os.environ if env is None else env
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    if config_file is not None:
        for k, v in read_file(config_file).items():
            values[k], source[k] = v, f"file {config_file}"
    for var, field in ENV.items():
        if environ.get(var):
            values[field], source[field] = environ[var], f"env {var}"
    for k, v in (flags or {}).items():
        if v is not None:
            if k not in FIELDS:
                raise InputError(f"unknown setting {k!r}")
            values[k], source[k] = v, "flag"
    try:
        settings = Settings.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else "?"
        where = source.get(field, "")
        what = f"environment variable {where[4:]}={values.get(field)!r}" if where.startswith("env ") else \
            f"{field}={values.get(field)!r} ({where})"
        raise InputError(f"{what} is invalid: {err['msg']}") from None
    return settings, {f: source.get(f, "default") for f in FIELDS}


def render(settings: Settings, source: dict[str, str]) -> str:
    """The settings in force as TOML a configuration file can hold, each with where it came from."""
    lines = ["# kvmemory settings in force (precedence: flag > environment > file > default)", "[kvmemory]"]
    for f in FIELDS:
        v = getattr(settings, f)
        line = f"# {f} =  (unset: the default of where it is used)" if v is None else f"{f} = {_toml(v)}"
        lines.append(line.ljust(60) + f"  # {source[f]}; env {env_name(f)}")
    return "\n".join(lines) + "\n"


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
