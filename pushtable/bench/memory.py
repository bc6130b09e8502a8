"""RSS with a slow reader stays within the capacity / max_bytes bound.

A producer writes fresh batches as fast as it can while the query reads slowly, so the queue is
always full; resident memory must stay near the baseline plus the queue's bound, not grow.

Memory is the process's *anonymous* resident memory (RSS minus file-backed pages): the heap,
where queued batches live. Code pages of the native extension (DataFusion is most of it) are
file-backed, paged in as code paths first run, and say nothing about what the queue holds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

from pushtable import SessionContext

SCHEMA = pa.schema([("v", pa.float64())])


def measure(
    seconds: float, batch_rows: int, capacity: int, max_bytes: int | None
) -> dict[str, Any]:
    """RSS while a producer keeps the queue full and a slow query reads it for ``seconds``."""
    proc = psutil.Process()
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=capacity, max_bytes=max_bytes)
    batch_bytes = batch_rows * 8
    stop = threading.Event()

    def produce() -> None:
        rng = np.random.default_rng(0)
        with sink:
            while not stop.is_set():
                sink.write(pa.record_batch([pa.array(rng.random(batch_rows))], schema=SCHEMA))

    def anonymous() -> int:
        info = proc.memory_info()
        return int(info.rss - info.shared)

    baseline = anonymous()
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    samples: list[int] = []
    read = 0
    deadline = time.monotonic() + seconds
    for b in ctx.sql("SELECT v FROM t").execute_stream():
        read += b.to_pyarrow().num_rows
        samples.append(anonymous())
        time.sleep(0.01)  # the slow reader
        if time.monotonic() > deadline:
            stop.set()
    producer.join(30)
    queued_bound = min(capacity * batch_bytes, max_bytes or capacity * batch_bytes)
    half = len(samples) // 2
    first, second = samples[:half] or samples, samples[half:] or samples
    return {
        "seconds": seconds,
        "batch_rows": batch_rows,
        "capacity": capacity,
        "max_bytes": max_bytes,
        "rows_read": read,
        "baseline_rss_mb": baseline / 2**20,
        "min_rss_mb": min(samples) / 2**20,
        "max_rss_mb": max(samples) / 2**20,
        "queue_bound_mb": queued_bound / 2**20,
        "growth_mb": (np.mean(second) - np.mean(first)) / 2**20,
    }


def run(quick: bool) -> dict[str, Any]:
    """The ``memory`` suite: one capacity-bounded and one byte-bounded run."""
    seconds = 3.0 if quick else 20.0
    return {
        "capacity_bound": measure(seconds, 65_536, capacity=64, max_bytes=None),
        "max_bytes_bound": measure(seconds, 65_536, capacity=1024, max_bytes=8 << 20),
    }
