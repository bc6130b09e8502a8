"""Shard responses arrive one by one on worker threads; SQL aggregates them as they land.

Run: ``python examples/shard_results.py``
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pyarrow as pa

from pushtable import SessionContext

SCHEMA = pa.schema([("shard", pa.int32()), ("score", pa.float64())])


def incoming(shard: int, responses: int = 20, rows: int = 5_000) -> Iterator[pa.RecordBatch]:
    """Pretend to receive ``responses`` answers from one shard, with network jitter."""
    rng = random.Random(shard)
    for _ in range(responses):
        time.sleep(rng.uniform(0.0, 0.02))
        scores = pa.array([rng.random() for _ in range(rows)], pa.float64())
        yield pa.record_batch([pa.array([shard] * rows, pa.int32()), scores], schema=SCHEMA)


def main() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("shard_results", SCHEMA, capacity=8)
    shards = 4
    done = threading.Barrier(shards, action=sink.close)  # the last producer to finish closes

    def produce(shard: int) -> None:
        try:
            for batch in incoming(shard):
                sink.write(batch)  # blocks while 8 batches are queued (backpressure)
            done.wait()
        except Exception as exc:  # noqa: BLE001 - any producer error fails the query
            sink.fail(exc)  # the query raises, carrying this error

    for shard in range(shards):
        threading.Thread(target=produce, args=(shard,), daemon=True).start()

    started = time.perf_counter()
    sql = "SELECT shard, count(*) AS n, avg(score) AS avg_score FROM shard_results GROUP BY shard"
    result = ctx.sql(sql + " ORDER BY shard").to_arrow_table()
    elapsed = time.perf_counter() - started
    print(result)
    stats = sink.stats
    print(
        f"{stats.rows:,} rows in {stats.batches} batches queried live in {elapsed:.2f}s; "
        f"producers spent {stats.blocked_seconds:.2f}s blocked on backpressure"
    )


if __name__ == "__main__":
    main()
