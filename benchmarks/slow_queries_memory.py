"""Slow remote queries and the server's memory: N queries over one topic, read slowly.

A ``pushtable serve`` child process with ``max_queries`` 64 and one topic; N clients each
subscribe and run ``SELECT * FROM`` their subscription, reading one batch every ``--sleep``
seconds, while one producer writes ``--mb`` MiB (int64 and a 32-byte string, 4,096 rows a
batch). Prints the server's RSS before the queries, its peak while they run, and the data
written. ``--thp`` starts the server with transparent huge pages allowed (``pushtable serve``
turns them off: see docs/network.md, Resource limits).

Run: ``python benchmarks/slow_queries_memory.py [--queries 50] [--thp]`` (not in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa

from pushtable.flight import connect

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--mb", type=float, default=7.0)
    parser.add_argument("--sleep", type=float, default=0.3)
    parser.add_argument("--thp", action="store_true", help="allow transparent huge pages")
    args = parser.parse_args()
    config = {
        "limits": {"max_queries": 64},
        "topics": [{"name": "ev", "schema": {"k": "int64", "s": "string"}}],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "serve.json"
        path.write_text(json.dumps(config))
        env = dict(os.environ, PUSHTABLE_SERVE_THP="1" if args.thp else "0")
        server = subprocess.Popen(
            [sys.executable, "-m", "pushtable", "serve", "--port", "0", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        try:
            assert server.stdout is not None
            match = re.search(r"grpc://\S+", server.stdout.readline())
            assert match, "the server did not start"
            run(args, psutil.Process(server.pid), match.group(0))
        finally:
            server.terminate()
            server.wait(30)


def run(args: argparse.Namespace, server: psutil.Process, location: str) -> None:
    time.sleep(1.0)
    base = server.memory_info().rss
    batch = pa.record_batch(
        [pa.array(range(4096), pa.int64()), pa.array(["x" * 32] * 4096)], schema=SCHEMA
    )
    count = max(1, int(args.mb * 2**20 / batch.nbytes))
    clients = [connect(location) for _ in range(args.queries)]
    results = []
    for i, client in enumerate(clients):
        client.subscribe("ev", f"sub{i}")
        results.append(client.sql(f"SELECT * FROM sub{i}"))
    done = threading.Event()

    def read(result: object) -> None:
        for _ in result:  # type: ignore[attr-defined]
            time.sleep(args.sleep)
            if done.is_set():
                return

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in results]
    for reader in readers:
        reader.start()
    peak = base

    def produce() -> None:
        with connect(location) as producer, producer.sink("ev") as sink:
            for _ in range(count):
                sink.write(batch)

    writer = threading.Thread(target=produce, daemon=True)
    writer.start()
    started = time.monotonic()
    while writer.is_alive() or time.monotonic() - started < 4:
        peak = max(peak, server.memory_info().rss)
        time.sleep(0.1)
    done.set()
    for result in results:
        result.cancel()
    for client in clients:
        client.close()
    mib = 2**20
    print(
        f"{args.queries} queries, {count * batch.nbytes / mib:.1f} MiB written, THP "
        f"{'allowed' if args.thp else 'off'}: server RSS {base / mib:.0f} MiB before, peak "
        f"{peak / mib:.0f} MiB (+{(peak - base) / mib:.0f})"
    )


if __name__ == "__main__":
    main()
