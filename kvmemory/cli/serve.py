"""`kvmemory` commands. kvmemory serve. Each command's parser sits beside its handler."""

from __future__ import annotations

import argparse
import os

from kvmemory.cli.common import KVMemoryError, positive_int, store_dtype

# kvmemory.server.logs' LEVELS and FORMATS (not imported here: `kvmemory --help` stays light; a test holds them equal)
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


def register(add) -> None:
    """Add this module's commands: add(name, handler, help, description, store=, model=) -> a subparser."""
    sp = add("serve", cmd_serve, "serve the store over HTTP: document QA and OpenAI-compatible chat",
             "Serve STORE (created if missing) with FastAPI/uvicorn: POST /v1/documents (deposit jobs), "
             "GET /v1/jobs/ID, GET/DELETE /v1/documents, POST /v1/ask (SSE with stream), GET /v1/models, "
             "POST /v1/chat/completions (OpenAI shapes; every conversation persists as exact KV states, a "
             "request extending one restores its stored prefix), GET/DELETE /v1/sessions/ID, POST /v1/learn and "
             "/v1/solve (the verified-solution library), GET /health. "
             "Anything but loopback needs an API key.", model=True)
    sp.add_argument("--config", metavar="FILE", default=None,
                    help="a TOML file of settings (`name = value`, at the top level or under [kvmemory]; the names "
                         "are the long flags' with _ for -); precedence: flag > environment (KVMEMORY_*) > file > "
                         "default")
    sp.add_argument("--print-config", action="store_true",
                    help="print every setting in force and where it came from (TOML), then exit")
    sp.add_argument("--host", default=None, help="default 127.0.0.1 (loopback; env KVMEMORY_HOST)")
    sp.add_argument("--port", type=int, default=None, help="default 8000 (env KVMEMORY_PORT)")
    sp.add_argument("--api-key-file", metavar="FILE", default=None,
                    help="file holding the bearer token clients must send (or set KVMEMORY_API_KEY)")
    sp.add_argument("--queue", type=positive_int, default=None, metavar="N",
                    help="requests that may wait for the model; more get 429 (default 32)")
    sp.add_argument("--batch", type=positive_int, default=None, metavar="N",
                    help="requests in flight at once, their decoding batched: one forward a step for all "
                         "(continuous batching; default 8; 1: one request at a time, decoded alone)")
    sp.add_argument("--ask-rerank", type=int, default=None, metavar="N",
                    help="the re-rank of an ask that does not set `rerank` (0: off, the most requests/s; "
                         "default: Memory.ask's, kvmemory.config.ASK_RERANK)")
    sp.add_argument("--invariant-rows", action=argparse.BooleanOptionalAction, default=None,
                    help="batched decoding reduces every row of a product the same way whatever the batch, so a "
                         "greedy reply is the one served alone (default: on for a bfloat16 model, where ~1 in 3 "
                         "replies differed without it, off for float32, where none did and it costs ~18%% at one "
                         "client)")
    sp.add_argument("--max-body-mb", type=positive_int, default=None, metavar="MB",
                    help="request size limit (413; default 16)")
    sp.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="serve with Ray Serve replicas reading the same store (a chat session always goes to the "
                         "replica holding its KV); ADDRESS of a cluster, or none for a local one")
    sp.add_argument("--replicas", type=positive_int, default=None, metavar="N", help="Ray Serve replicas (default 2)")
    sp.add_argument("--log-level", choices=LEVELS, default=None,
                    help="info (default): one access line a request, with its X-Request-Id; warning: problems only")
    sp.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None,
                    help="record and serve GET /metrics in the Prometheus text format (default: yes)")
    sp.add_argument("--log-format", choices=FORMATS, default=None,
                    help="text (default) or json: one JSON object a line (time, level, logger, message, "
                         "request_id, and the access line's method, path, status, duration_ms)")


def settings_of(args):
    """The settings in force for `serve` (kvmemory.settings: flag > environment > --config file > default)."""
    from kvmemory.settings import FIELDS, load
    return load({f: getattr(args, f, None) for f in FIELDS if f != "api_key_file"} |
                {"api_key_file": args.api_key_file}, config_file=args.config)


def cmd_serve(args) -> int:
    import sys

    from kvmemory.settings import SERVE_ONLY, env_name, render
    settings, source = settings_of(args)
    if args.print_config:
        sys.stdout.write(render(settings, source))
        return 0
    # the file's store and runtime settings reach every Memory (here and in Ray workers) as the
    # environment they would have come from (a variable already set won over the file: not touched)
    for f, where in source.items():
        if where.startswith("file ") and f not in SERVE_ONLY:
            os.environ[env_name(f)] = str(getattr(settings, f))
    s = settings
    if s.encrypt:                          # a store the server creates is encrypted (StoreConfig reads it)
        os.environ[env_name("encrypt")] = "true"
    args.dtype, args.model = s.dtype, s.model
    dtype, why = store_dtype(args), f"asked for ({source['dtype']})"
    if dtype is None:
        from kvmemory.model.choose import default_dtype
        dtype, why = default_dtype(s.device or "cpu", default_model=s.model is None)
    elif s.dtype is None:
        why = "the store's blocks were computed in it"
    print(f"kvmemory serve: computing in {dtype}: {why}", file=sys.stderr, flush=True)
    from kvmemory.server import serve

    key = os.environ.get("KVMEMORY_API_KEY") or None
    if s.api_key_file:
        try:
            key = open(s.api_key_file, encoding="utf-8").read().strip()
        except OSError as e:
            raise KVMemoryError(f"cannot read {s.api_key_file}: {e.strerror}") from None
        if not key:
            raise KVMemoryError(f"{s.api_key_file} is empty")
    if s.ray is not None:
        from kvmemory.server.ray import serve_ray

        serve_ray(args.store, host=s.host, port=s.port, replicas=s.replicas,
                  address=None if s.ray == "local" else s.ray, model=s.model, api_key=key,
                  queue_size=s.queue, max_body_bytes=s.max_body_mb << 20, batch=s.batch,
                  invariant=s.invariant, ask_rerank=s.ask_rerank, dtype=dtype,
                  invariant_rows=s.invariant_rows, device=s.device)
        return 0
    serve(args.store, host=s.host, port=s.port, model=s.model, api_key=key, queue_size=s.queue,
          max_body_bytes=s.max_body_mb << 20, batch=s.batch, invariant=s.invariant,
          ask_rerank=s.ask_rerank, dtype=dtype, invariant_rows=s.invariant_rows,
          log_level=s.log_level, log_format=s.log_format, device=s.device, dtype_reason=why, metrics=s.metrics)
    return 0
