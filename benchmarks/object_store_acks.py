"""Acknowledgement latency of a durable topic: a local disk against an S3-compatible store.

One producer writes a one-row batch every ``--every`` seconds into ``Topic(persist=...)`` and
waits for it to be committed (``flush``); printed: the p50 / p99 / max of write → committed,
for each place and ``commit_interval``. The store is moto's S3 server on loopback (the tests'
store; a real one's puts take longer), so this shows what pushtable's commit path adds.

Run: ``python -m benchmarks.object_store_acks [--samples 200]`` (not in CI; needs
``moto[server]``, a dev dependency).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import pyarrow as pa

from benchmarks.moto_store import store
from pushtable import Topic

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])


def acks(
    persist: str, options: dict[str, str] | None, interval: float, args: argparse.Namespace
) -> str:
    topic = Topic(
        "acks", SCHEMA, persist=persist, storage_options=options, commit_interval=interval
    )
    delays = []
    try:
        for i in range(args.samples):
            started = time.perf_counter()
            topic.write(pa.record_batch([pa.array([i]), pa.array([0.5])], schema=SCHEMA))
            topic.flush(timeout=60)
            delays.append((time.perf_counter() - started) * 1000)
            time.sleep(args.every)
    finally:
        topic.close()
    delays.sort()
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    return f"p50 {statistics.median(delays):.1f} ms, p99 {p99:.1f} ms, max {delays[-1]:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--every", type=float, default=0.01)
    args = parser.parse_args()
    with store() as options, tempfile.TemporaryDirectory() as tmp:
        for interval in (0.1, 1.0):
            for place, persist, opts in (
                ("local disk, fsync", f"{tmp}/i{interval}.lance", None),
                ("S3 (moto)", f"s3://bench/i{interval}.lance", options),
            ):
                figures = acks(persist, opts, interval, args)
                print(f"{place}, commit_interval {interval}: {figures}")


if __name__ == "__main__":
    main()
