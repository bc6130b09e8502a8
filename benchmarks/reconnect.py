"""Reconnect: how soon an idempotent producer reaches a server back from an outage.

A real ``pushtable serve --data-dir`` process is killed with SIGKILL while a producer writes,
kept away for ``--outage`` seconds, and started again on its data dir; the figure is the time
from its return to the producer's successful flush. ``--grpc-default`` runs it with gRPC's own
reconnect backoff (it grows to 120 s) instead of the client's cap (``RECONNECT_BACKOFF_MS``).

Run: ``python benchmarks/reconnect.py [--outage 40] [--grpc-default]`` (not in CI).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

import pushtable.flight.client.transport as transport
from pushtable.flight import connect

SCHEMA = pa.schema([("v", pa.int64())])


def _serve(port: int, data: Path) -> subprocess.Popen[str]:
    """``pushtable serve`` on ``port`` and ``data``, once it listens."""
    command = [sys.executable, "-m", "pushtable", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening" in line:
            return proc
    raise RuntimeError("pushtable serve exited before it listened")


def measure(outage: float) -> float:
    """Seconds from the server's return to the producer's flush, after ``outage`` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    data = Path(tempfile.mkdtemp()) / "data"
    proc = _serve(port, data)
    client = connect(f"grpc://127.0.0.1:{port}", timeout=10)
    client.create_topic("t", SCHEMA, durable=True)
    sink = client.sink("t", producer_id="p", retry=outage + 150)
    sink.write(pa.record_batch({"v": [1]}, schema=SCHEMA))
    sink.flush(timeout=10)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    flushed: list[float] = []

    def produce() -> None:
        sink.write(pa.record_batch({"v": [2]}, schema=SCHEMA))
        sink.flush(timeout=outage + 150)
        flushed.append(time.monotonic())

    writer = threading.Thread(target=produce)
    writer.start()
    time.sleep(outage)  # the outage
    proc = _serve(port, data)
    back = time.monotonic()
    writer.join(outage + 160)
    sink.close()
    client.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    if not flushed:
        raise RuntimeError("the producer never flushed")
    return flushed[0] - back


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=40.0)
    parser.add_argument("--grpc-default", action="store_true")
    args = parser.parse_args()
    if args.grpc_default:
        transport.RECONNECT_BACKOFF_MS = 120_000  # gRPC's own default
    took = measure(args.outage)
    print(
        f"outage {args.outage:g} s, reconnect backoff cap {transport.RECONNECT_BACKOFF_MS} ms: "
        f"flushed {took:.2f} s after the server was back"
    )
