"""Updating aggregates: throughput and write -> updated row latency of a live ``GROUP BY``.

The workload of docs/benchmarks.md's "updating aggregates" section: rows ``(k, v, b)`` over an
``unbounded=True`` table, ``SELECT k, count(*), sum(v), max(b) FROM t GROUP BY k``, at 1,000
and 100,000 keys (row ``r`` of the stream has key ``r % keys``), 8,192-row batches.

- throughput: 10,000,000 rows pushed flat out by a producer thread while the reader applies
  every change as an upsert; rows per second from the first write to the end of the stream
  (the median of 5 runs, with min and max), the applied state checked against the input
  (each key's count);
- latency: one batch every 10 ms (100 batches/s); ``b`` is the batch's number, so the first
  change carrying ``max(b) >= i`` is batch ``i``'s update: the time from its ``write`` to
  that change in Python (p50/p99).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from pushtable import SessionContext
from pushtable.bench.peer_workload import keyed_batch, percentiles

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("b", pa.int64())])
SQL = "SELECT k, count(*) AS n, sum(v) AS s, max(b) AS b FROM t GROUP BY k"
KEYS = (1_000, 100_000)


def _batch(i: int, rows: int, keys: int) -> pa.RecordBatch:
    """Batch ``i``: rows ``i * rows ..`` of the stream, key ``r % keys``, v = 1, b = i."""
    return keyed_batch(i, rows, keys, SCHEMA)


def throughput(
    keys: int, rows: int = 10_000_000, batch_rows: int = 8192, reps: int = 5
) -> dict[str, Any]:
    """Rows per second through the updating ``GROUP BY`` (median of ``reps`` runs).

    Each run's applied state is checked.
    """
    batches = [_batch(i, batch_rows, keys) for i in range(rows // batch_rows)]
    runs = [_run(batches, keys) for _ in range(reps)]
    rates = [r["rows_per_s"] for r in runs]
    middle = sorted(runs, key=lambda r: r["rows_per_s"])[len(runs) // 2]
    return {
        **middle,
        "rows_per_s": statistics.median(rates),
        "rows_per_s_min": min(rates),
        "rows_per_s_max": max(rates),
        "reps": reps,
    }


def _run(batches: list[pa.RecordBatch], keys: int) -> dict[str, Any]:
    """One run: every batch through the query, every change applied as an upsert."""
    batch_rows = batches[0].num_rows
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, 8, unbounded=True)
    stream = ctx.sql(SQL).execute_stream()

    def produce() -> None:
        with sink:
            for b in batches:
                sink.write(b)

    counts = np.zeros(keys, np.int64)
    changes = out_batches = 0
    start = time.perf_counter()
    threading.Thread(target=produce, daemon=True).start()
    for out in stream:
        rb = out.to_pyarrow()
        k = rb.column("k").to_numpy()
        counts[k] = rb.column("n").to_numpy()  # upsert: the last value of each key wins
        changes += rb.num_rows
        out_batches += 1
    elapsed = time.perf_counter() - start
    written = len(batches) * batch_rows
    expected = np.bincount(np.arange(written) % keys, minlength=keys)
    if not np.array_equal(counts, expected):
        raise AssertionError("the applied changes differ from the input's counts")
    return {
        "keys": keys,
        "rows": written,
        "rows_per_s": written / elapsed,
        "output_batches": out_batches,
        "changed_rows": changes,
    }


def latency(keys: int, batches: int = 500, rows: int = 8192, rate: float = 100.0) -> dict[str, Any]:
    """Write -> updated row in Python at ``rate`` batches per second."""
    data = [_batch(i, rows, keys) for i in range(batches)]
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, 8, unbounded=True)
    stream = ctx.sql(SQL).execute_stream()
    written = [0.0] * batches
    seen = [0.0] * batches

    def produce() -> None:
        with sink:
            t0 = time.perf_counter()
            for i, b in enumerate(data):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                written[i] = time.perf_counter()
                sink.write(b)

    threading.Thread(target=produce, daemon=True).start()
    newest = -1
    for out in stream:
        now = time.perf_counter()
        top = int(pa.compute.max(out.to_pyarrow().column("b")).as_py())
        for i in range(newest + 1, top + 1):
            seen[i] = now
        newest = max(newest, top)
    warm = batches // 10  # the first tenth warms up
    ms = sorted((s - w) * 1e3 for s, w in zip(seen[warm:], written[warm:], strict=True))
    return {"keys": keys, "rate": rate, **percentiles(rows, ms)}


def run(quick: bool, peers: bool = False) -> dict[str, Any]:
    """Both measurements at each key count (fewer rows and batches with ``quick``).

    With ``peers``, the same workload on LaminarDB (``GROUP BY k EMIT CHANGES``) from the
    peers venv, after pushtable's.
    """
    rows, batches, reps = (200_000, 60, 3) if quick else (10_000_000, 500, 5)
    out: dict[str, Any] = {
        "throughput": [throughput(k, rows, reps=reps) for k in KEYS],
        "latency": [latency(k, batches) for k in KEYS],
    }
    if peers:
        from pushtable.bench.peers import peer

        params = {"shape": "updating", "keys": list(KEYS), "rows": rows, "batches": batches}
        out["laminardb"] = peer("laminardb", params)
        params["pathway_max_rows"] = PATHWAY_ROWS // (10 if quick else 1)
        out["pathway"] = peer("pathway", params)
    return out


#: Pathway's Python connector takes rows one per call: its run has this many rows.
PATHWAY_ROWS = 204_800


def table(suite: dict[str, Any]) -> str:
    """The updating suite's results as text."""
    lines = [
        "updating GROUP BY (unbounded table, 8,192-row batches)",
        f"{'keys':>9} {'M rows/s':>9} {'out batches':>12} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    for t, lat in zip(suite["throughput"], suite["latency"], strict=True):
        lines.append(
            f"{t['keys']:>9,} {t['rows_per_s'] / 1e6:>9.1f} {t['output_batches']:>12,} "
            f"{lat['p50_ms']:>8.2f} {lat['p99_ms']:>8.2f}"
        )
    for name, title, rows in (
        ("pathway", "Pathway", _pathway_lines),
        ("laminardb", "LaminarDB", _laminardb_lines),
    ):
        peer = suite.get(name)
        if peer and "skipped" in peer:
            lines.append(f"{title}: {peer['skipped']}")
        elif peer:
            lines.extend(rows(peer, suite))
    return "\n".join(lines)


def _pathway_lines(peer: dict[str, Any], suite: dict[str, Any]) -> list[str]:
    lines = [f"{peer['engine']}, groupby(k).reduce(count, sum, max), throughput:"]
    for t in peer["throughput"]:
        lines.append(
            f"{t['keys']:>9,} {t['rows_per_s'] / 1e6:>9.3f} M rows/s over {t['rows']:,} rows "
            f"(verified={t['verified']})"
        )
    return lines


def _laminardb_lines(peer: dict[str, Any], suite: dict[str, Any]) -> list[str]:
    lines = [f"{peer['engine']}, the same workload (GROUP BY k EMIT CHANGES):"]
    for t, lat, ours in zip(peer["throughput"], peer["latency"], suite["throughput"], strict=True):
        lines.append(
            f"{t['keys']:>9,} {t['rows_per_s'] / 1e6:>9.2f} M rows/s "
            f"(pushtable {ours['rows_per_s'] / t['rows_per_s']:.1f}x, verified="
            f"{t['verified']}), p50 {lat.get('p50_ms', float('nan')):.2f} / p99 "
            f"{lat.get('p99_ms', float('nan')):.2f} ms"
        )
    return lines
