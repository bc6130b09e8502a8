"""The ``peers`` workload, shared by pushtable and the peer engines' child processes.

This file imports only numpy and pyarrow, so it runs under the peers venv's older pyarrow too.

Rows ``(ts, k, v)`` with ``ts`` in milliseconds (int64), ``v = 1``, a 1-second tumbling
``count(*)``/``sum(v)``. Batches never span more than ``DELAY_MS`` of event time, so an engine
whose watermark trails the newest row by ``DELAY_MS`` sees no late row.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([("ts", pa.int64()), ("k", pa.int64()), ("v", pa.int64())])
DELAY_MS = 100
#: rows per second of event time in the throughput run
PER_WINDOW = 100_000
#: rows per second of event time in the ``dense`` shape: ``ts`` is the row's number in
#: milliseconds, so a 1-second window closes every 1,000 rows (about 8 per 8,192-row batch)
DENSE_PER_WINDOW = 1_000


def batch(first_ms: int, rows: int, span_ms: int, schema: pa.Schema = SCHEMA) -> pa.RecordBatch:
    """``rows`` rows from ``first_ms`` spread over ``span_ms`` milliseconds, v = 1."""
    ts = first_ms + (np.arange(rows, dtype=np.int64) * span_ms) // max(rows, 1)
    arrays = [pa.array(ts), pa.array(np.arange(rows)), pa.array(np.ones(rows, np.int64))]
    return pa.record_batch(arrays, schema=schema)


def keyed_batch(i: int, rows: int, keys: int, schema: pa.Schema = SCHEMA) -> pa.RecordBatch:
    """Batch ``i`` of the updating ``GROUP BY`` workload: rows ``i * rows ..`` of the stream.

    Row ``r`` has key ``r % keys``, ``v`` = 1 and ``ts`` = ``i`` (the batch's number: the last
    column of pushtable's schema, or ``ts`` in the peers' int64 schema).
    """
    r = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
    ordered = {"k": pa.array(r % keys), "v": pa.array(np.ones(rows, np.int64))}
    ordered[schema.names[-1] if schema.names[0] == "k" else "ts"] = pa.array(np.full(rows, i))
    return pa.record_batch([ordered[name] for name in schema.names], schema=schema)


def throughput_batches(
    rows: int, batch_rows: int, schema: pa.Schema = SCHEMA, per_window: int = PER_WINDOW
) -> list[pa.RecordBatch]:
    """``rows`` rows at ``per_window`` rows per event-time second, in ``batch_rows`` batches."""
    out = []
    for first in range(0, rows, batch_rows):
        n = min(batch_rows, rows - first)
        out.append(batch((first * 1000) // per_window, n, (n * 1000) // per_window, schema))
    return out


def dense_batches(rows: int, batch_rows: int, schema: pa.Schema = SCHEMA) -> list[pa.RecordBatch]:
    """The ``dense`` shape: a 1-second tumbling window closes every ``DENSE_PER_WINDOW`` rows.

    The cost of a window aggregate is then the windows it emits, not the rows it folds.
    """
    return throughput_batches(rows, batch_rows, schema, DENSE_PER_WINDOW)


def burst_batches(rows: int, batch_rows: int, schema: pa.Schema = SCHEMA) -> list[pa.RecordBatch]:
    """The session workload: batch ``i`` is a burst of ``batch_rows`` rows in second ``i``.

    The burst spans the first 500 ms of that second: with a 300 ms gap, one session per batch.
    """
    return [batch(i * 1000, batch_rows, 500, schema) for i in range(rows // batch_rows)]


#: The window shapes side by side: (the batches, how many windows hold each row), with
#: Spark's ``window(ts, '10 seconds', '1 second')`` and ``session_window(ts, '300
#: milliseconds')`` in pushtable, and each peer's own form of them; ``dense`` is the 1-second
#: tumbling window closing every 1,000 rows.
SHAPES = {
    "sliding": (throughput_batches, 10),
    "session": (burst_batches, 1),
    "dense": (dense_batches, 1),
}
#: Past every window and session of a shape's batches: one row written last moves every
#: engine's watermark beyond them (its own window is not counted).
FAR_MS = 10**9


#: The interval join: 1,000 keys, rows 10 ms apart, ``b``'s 5 ms after ``a``'s of the same
#: key, ``a.k = b.k AND b.ts BETWEEN a.ts AND a.ts + 1 s``: each ``a`` row meets one ``b`` row.
JOIN_KEYS = 1_000
JOIN_SCHEMA = pa.schema([("k", pa.int64()), ("ts", pa.int64()), ("v", pa.int64())])


def join_side(i: int, rows: int, offset_ms: int, schema: pa.Schema = JOIN_SCHEMA) -> pa.RecordBatch:
    """Batch ``i`` of a join side: rows ``i * rows ..``, 10 ms apart, key ``r % JOIN_KEYS``."""
    r = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
    arrays = [pa.array(r % JOIN_KEYS), pa.array(r * 10 + offset_ms), pa.array(r)]
    return pa.record_batch(
        [a.cast(f.type) for a, f in zip(arrays, schema, strict=True)], schema=schema
    )


def latency_batch(i: int, rows: int, schema: pa.Schema = SCHEMA) -> pa.RecordBatch:
    """Batch ``i`` of the latency run: second ``i``, from 100 ms in, spanning 100 ms.

    Writing it closes window ``i - 1`` in both engines.
    """
    return batch(i * 1000 + DELAY_MS, rows, DELAY_MS, schema)


def percentiles(batch_rows: int, ms: list[float]) -> dict[str, Any]:
    """p50 / p99 / max of sorted write-to-row latencies (ms)."""
    if not ms:
        return {"batch_rows": batch_rows, "samples": 0}
    return {
        "batch_rows": batch_rows,
        "samples": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "max_ms": ms[-1],
    }
