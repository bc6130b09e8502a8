"""moto's S3 server in a child process on loopback: the benchmarks' object store.

The tests' store (``tests/conftest.py``'s ``object_store`` fixture runs it in the test
process); here it has a process of its own, so its Python does not share an interpreter with
what is measured. Needs ``moto[server]`` (a dev dependency).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["store"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def store() -> Iterator[dict[str, str]]:
    """moto's S3 server in a child process, bucket ``bench``; yields the storage options."""
    import boto3

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    options = {
        "aws_endpoint": f"http://127.0.0.1:{port}",
        "aws_access_key_id": "bench",
        "aws_secret_access_key": "bench",
        "aws_region": "us-east-1",
        "allow_http": "true",
    }
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=options["aws_endpoint"],
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                s3.create_bucket(Bucket="bench")
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield options
    finally:
        proc.terminate()
        proc.wait(30)
