"""moto's S3-compatible server for the benchmarks that read a store on object storage: its own
process on a free port of 127.0.0.1 (plain HTTP), started and waited for until it listens."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def start_moto(timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """(process, endpoint URL) of a fresh moto server; the caller terminates the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:                                     # until the server accepts connections
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's server did not start (pip install 'moto[server]')") from None
            time.sleep(0.1)
