"""A real S3-compatible server for the object-store tests: moto in server mode, started once per
session as its own process on 127.0.0.1 (plain HTTP), and a fresh bucket per test. The tests
reach it the way a user's program does: through the AWS_* environment variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto server did not start")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
          "AWS_ALLOW_HTTP": "true"}


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A fresh bucket; the environment points at the server. Returns an object with .url(prefix),
    .client (boto3), .bucket, .env (for subprocesses)."""
    import boto3

    env = dict(S3_ENV, AWS_ENDPOINT_URL=s3_server, KVMEMORY_STORE_CACHE_DIR=str(tmp_path / "work"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = f"kvm-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)

    class S3:
        pass
    s = S3()
    s.bucket, s.client, s.endpoint = bucket, client, s3_server
    s.env = dict(os.environ)
    s.url = lambda prefix="store": f"s3://{bucket}/{prefix}"
    s.keys = lambda prefix="": sorted(o["Key"] for p in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix) for o in p.get("Contents", []))
    return s
