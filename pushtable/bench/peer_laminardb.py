"""The ``peers`` workload on LaminarDB, run by the peers venv's interpreter.

That venv pins an older pyarrow than pushtable, so this file imports nothing of pushtable. It
prints one JSON object.

Same data and the same closing rule as pushtable's ordered table: the source's watermark is
the newest event time minus 100 ms, and every batch spans at most 100 ms of event time and
starts 100 ms into its second, so no row is late and a 1-second tumbling window closes with
the first batch of a later second (``EMIT ON WINDOW CLOSE``), as it does in pushtable.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import laminardb  # type: ignore[import-not-found]
import pyarrow as pa
import pyarrow.compute as pc

try:  # pushtable importable (type checking, tests)
    from pushtable.bench import peer_workload as work
except ImportError:  # the peers venv: the file beside this one
    import peer_workload as work  # type: ignore[import-not-found,no-redef]

SQL = (
    "CREATE STREAM win AS SELECT min(ts) / 1000 AS w, count(*) AS n, sum(v) AS s FROM events "
    "GROUP BY TUMBLE(ts, INTERVAL '1' SECOND) EMIT ON WINDOW CLOSE"
)


def _open(
    stream_sql: str = SQL, stream: str = "win", delay_ms: int = work.DELAY_MS
) -> tuple[Any, Any, Any, pa.Schema]:
    """A database with the ``events`` source (watermark ``delay_ms`` behind) and ``stream_sql``.

    Returns it, a subscription to ``stream``, the source's writer and schema.
    """
    db = laminardb.open(":memory:")
    db.execute(
        "CREATE SOURCE events (ts BIGINT, k BIGINT, v BIGINT, "
        f"WATERMARK FOR ts AS ts - INTERVAL '{delay_ms}' MILLISECOND)"
    )
    db.execute(stream_sql)
    db.start()
    sub = db.subscribe_stream(stream)
    return db, sub, db.writer("events"), db.schema("events")


def _read(sub: Any, until: threading.Event, out: list[tuple[float, pa.Table]]) -> None:
    while not until.is_set():
        try:
            got = sub.next_timeout(50)
        except Exception:  # noqa: BLE001 - laminardb raises SubscriptionError on timeout
            continue
        if got is not None:
            out.append((time.perf_counter(), got.to_arrow()))


def _reading(sub: Any) -> tuple[list[tuple[float, pa.Table]], threading.Event, threading.Thread]:
    """A started thread reading ``sub`` into a list of (arrival, table) until its event."""
    got: list[tuple[float, pa.Table]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read, args=(sub, stop, got), daemon=True)
    reader.start()
    return got, stop, reader


def _until_quiet(
    got: list[tuple[float, pa.Table]],
    first: float,
    quiet: float,
    enough: Any = lambda: False,
    give_up: float = 120.0,
) -> None:
    """Wait until ``enough()``, or until no result came for ``quiet`` seconds, at most ``give_up``.

    For the first result the quiet time is ``first`` seconds. LaminarDB has then given all it
    will.
    """
    now = time.monotonic()
    quiet_until, deadline, seen = now + first, now + give_up, 0
    while not enough() and time.monotonic() < min(quiet_until, deadline):
        time.sleep(0.05)
        if len(got) != seen:
            seen, quiet_until = len(got), time.monotonic() + quiet


def _write_flushed(writer: Any, batches: list[pa.RecordBatch]) -> None:
    """Each batch inserted and flushed in turn (LaminarDB's unit of arrival)."""
    for b in batches:
        writer.insert(b)
        writer.flush()


def throughput(rows: int, batch_rows: int) -> dict[str, Any]:
    """Rows per second through a 1-second tumbling window, flat out; results verified."""
    db, sub, writer, schema = _open()
    batches = work.throughput_batches(rows, batch_rows, schema)
    windows = -(-rows // work.PER_WINDOW)
    got, stop, reader = _reading(sub)
    start = time.perf_counter()
    # End of input: one row far ahead moves the watermark past every window (not counted).
    _write_flushed(writer, [*batches, work.latency_batch(windows + 1, 1, schema)])
    deadline = time.monotonic() + 120
    while sum(t.num_rows for _, t in got) < windows and time.monotonic() < deadline:
        time.sleep(0.001)
    seconds = (got[-1][0] if got else time.perf_counter()) - start
    stop.set()
    reader.join(5)
    n = sum(sum(t.column("n").to_pylist()) for _, t in got)
    s = sum(sum(t.column("s").to_pylist()) for _, t in got)
    db.close()
    return {
        "rows": rows,
        "batch_rows": batch_rows,
        "windows": sum(t.num_rows for _, t in got),
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "verified": n == rows and s == rows,
    }


def close_latency(batch_rows: int, samples: int, interval: float = 0.02) -> dict[str, Any]:
    """Write -> window row: each batch opens a new second, closing the one before."""
    db, sub, writer, schema = _open()
    got, stop, reader = _reading(sub)
    written: list[float] = []
    start = time.perf_counter()
    for i in range(samples + 1):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        b = work.latency_batch(i, batch_rows, schema)
        written.append(time.perf_counter())
        writer.insert(b)
        writer.flush()  # closes window i - 1
    deadline = time.monotonic() + 5  # every window row, however late it comes
    while len({int(w) for _, t in got for w in t.column("w").to_pylist()}) < samples:
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    stop.set()
    reader.join(5)
    arrived: dict[int, float] = {}
    for at, table in got:
        for w in table.column("w").to_pylist():
            arrived.setdefault(int(w), at)
    db.close()
    ms = sorted((arrived[i] - written[i + 1]) * 1e3 for i in range(samples) if i in arrived)
    return work.percentiles(batch_rows, ms)


UPDATING = (
    "CREATE STREAM agg AS SELECT k, count(*) AS n, sum(v) AS s, max(ts) AS b FROM events "
    "GROUP BY k EMIT CHANGES"
)


def _updating(keys: int, rows: int, i: int, schema: pa.Schema) -> pa.RecordBatch:
    """Batch ``i`` of the updating workload, its event time ``i`` seconds."""
    b = work.keyed_batch(i, rows, keys, schema)
    return b.set_column(0, "ts", pa.array([i * 1000] * rows, pa.int64()))


def updating_throughput(keys: int, rows: int, batch_rows: int) -> dict[str, Any]:
    """``GROUP BY k EMIT CHANGES`` flat out; timed to the change that completes every key.

    The reader applies each change as an upsert (vectorised, as pushtable's reader does).
    """
    import numpy as np

    db, sub, writer, schema = _open(UPDATING, "agg")
    batches = [_updating(keys, batch_rows, i, schema) for i in range(rows // batch_rows)]
    written = len(batches) * batch_rows
    expected = np.bincount(np.arange(written) % keys, minlength=keys)
    counts = np.full(keys, -1, np.int64)
    got: list[tuple[float, pa.Table]] = []
    applied = 0
    stop = threading.Event()
    reader = threading.Thread(target=_read, args=(sub, stop, got), daemon=True)
    reader.start()
    start = time.perf_counter()
    # One row far ahead, of no key of the workload, moves the watermark past everything.
    marker = pa.record_batch([pa.array([10**12]), pa.array([-1]), pa.array([0])], schema=schema)
    _write_flushed(writer, [*batches, marker])
    deadline = time.monotonic() + 300
    last = start
    while not np.array_equal(counts, expected) and time.monotonic() < deadline:
        time.sleep(0.005)
        for at, t in got[applied:]:  # each change, in order, as an upsert
            k, n = t.column("k").to_numpy(), t.column("n").to_numpy()
            keep = k >= 0
            counts[k[keep]] = n[keep]
            last = at
            applied += 1
    stop.set()
    reader.join(5)
    db.close()
    return {
        "keys": keys,
        "rows": written,
        "rows_per_s": written / (last - start),
        "verified": bool(np.array_equal(counts, expected)),
    }


def updating_latency(keys: int, batches: int, rows: int, rate: float) -> dict[str, Any]:
    """Write -> the first change carrying batch ``i``'s number, at ``rate`` batches/s."""
    db, sub, writer, schema = _open(UPDATING, "agg")
    data = [_updating(keys, rows, i, schema) for i in range(batches)]
    got, stop, reader = _reading(sub)
    written = [0.0] * batches
    t0 = time.perf_counter()
    for i, b in enumerate(data):
        time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        written[i] = time.perf_counter()
        writer.insert(b)
        writer.flush()
    last = (batches - 1) * 1000
    deadline = time.monotonic() + 10
    while not any(max(t.column("b").to_pylist()) >= last for _, t in got[-3:]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    stop.set()
    reader.join(5)
    db.close()
    # Batch i's update is the first change carrying max(ts) >= its second.
    seen = [0.0] * batches
    newest = -1
    for at, t in got:
        top = min(max(t.column("b").to_pylist()) // 1000, batches - 1)
        for i in range(newest + 1, top + 1):
            seen[i] = at
        newest = max(newest, top)
    warm = batches // 10
    ms = sorted((s - w) * 1e3 for s, w in zip(seen[warm:], written[warm:], strict=True) if s > 0)
    return {"keys": keys, "rate": rate, **work.percentiles(rows, ms)}


#: LaminarDB's own forms of the window shapes (its README's syntax).
SHAPE_SQL = {
    "sliding": "HOPPING(ts, 10000, 1000)",
    "session": "SESSION(ts, 300)",
    "dense": "TUMBLE(ts, INTERVAL '1' SECOND)",
}


def shape_throughput(shape: str, rows: int, batch_rows: int) -> dict[str, Any]:
    """A Spark window shape in LaminarDB's SQL (``EMIT ON WINDOW CLOSE``), flat out.

    Timed to the last window row (waiting up to 30 s after the last write); verified when the
    windows count every row as often as Spark's do.
    """
    make, copies = work.SHAPES[shape]
    sql = (
        "CREATE STREAM win AS SELECT min(ts) AS lo, count(*) AS n, sum(v) AS s FROM events "
        f"GROUP BY {SHAPE_SQL[shape]} EMIT ON WINDOW CLOSE"
    )
    # LaminarDB drops the rows of a batch that lie below the watermark its newest row sets:
    # the delay must cover a batch's span (8.2 s of event time in a dense batch).
    spans = [pc.max(b["ts"]).as_py() - pc.min(b["ts"]).as_py() for b in make(rows, batch_rows)]
    db, sub, writer, schema = _open(sql, delay_ms=max([work.DELAY_MS, *spans]) + 1)
    batches = make(rows, batch_rows, schema)
    got, stop, reader = _reading(sub)
    start = time.perf_counter()
    _write_flushed(writer, [*batches, work.batch(work.FAR_MS, 1, 0, schema)])
    written = sum(b.num_rows for b in batches)
    _until_quiet(got, first=30, quiet=5)
    stop.set()
    reader.join(5)
    db.close()
    rows_out = [r for _, t in got for r in t.to_pylist() if r["lo"] < work.FAR_MS]
    seconds = got[-1][0] - start if got else None  # no window at all: no rate either
    return {
        "shape": shape,
        "rows": written,
        "windows": len(rows_out),
        "counted_rows": sum(r["n"] for r in rows_out),
        "seconds": seconds,
        "rows_per_s": written / seconds if seconds else None,
        "verified": sum(r["n"] for r in rows_out) == written * copies,
    }


def join_throughput(rows_per_side: int, batch_rows: int) -> dict[str, Any]:
    """The interval join (``b.ts BETWEEN a.ts AND a.ts + 1000``), both sides written flat out.

    Watermarks trail by 100 ms; the sides are written in turn, one row far ahead on each at
    the end. Timed to the last match, waiting until no match came for 10 s (at most 120 s).
    """
    db = laminardb.open(":memory:")
    for side in ("a", "b"):
        db.execute(
            f"CREATE SOURCE {side} (k BIGINT, ts BIGINT, v BIGINT, "
            f"WATERMARK FOR ts AS ts - INTERVAL '{work.DELAY_MS}' MILLISECOND)"
        )
    db.execute(
        "CREATE STREAM j AS SELECT a.k AS k FROM a JOIN b ON a.k = b.k "
        "AND b.ts BETWEEN a.ts AND a.ts + 1000"
    )
    db.start()
    sub = db.subscribe_stream("j")
    writers = {side: (db.writer(side), db.schema(side)) for side in ("a", "b")}
    got, stop, reader = _reading(sub)
    batches = rows_per_side // batch_rows
    start = time.perf_counter()
    for i in range(batches):
        for side, offset in (("a", 0), ("b", 5)):
            writer, schema = writers[side]
            writer.insert(work.join_side(i, batch_rows, offset, schema))
            writer.flush()
    for writer, schema in writers.values():
        far = pa.record_batch(
            [pa.array([-1]), pa.array([work.FAR_MS]), pa.array([0])], schema=schema
        )
        _write_flushed(writer, [far])
    want = batches * batch_rows
    _until_quiet(got, first=10, quiet=10, enough=lambda: sum(t.num_rows for _, t in got) >= want)
    stop.set()
    reader.join(5)
    db.close()
    matches = sum(t.num_rows for _, t in got)
    seconds = got[-1][0] - start if got else None
    return {
        "rows_per_side": want,
        "matches": matches,
        "seconds": seconds,
        "rows_per_s": 2 * want / seconds if seconds else None,
        "verified": matches == want,
    }


def main() -> None:
    """Run what the JSON parameters in ``sys.argv[1]`` ask for; print one JSON object."""
    params = json.loads(sys.argv[1])
    if params.get("shape") == "join":
        result = join_throughput(params["rows"], params["batch_rows"])
        print(json.dumps({"engine": f"laminardb {laminardb.__version__}", "throughput": [result]}))
        return
    if params.get("shape") in work.SHAPES:
        result = shape_throughput(params["shape"], params["rows"], params["batch_rows"])
        print(json.dumps({"engine": f"laminardb {laminardb.__version__}", "throughput": [result]}))
        return
    if params.get("shape") == "updating":
        keys, rows = params["keys"], params["rows"]
        print(
            json.dumps(
                {
                    "engine": f"laminardb {laminardb.__version__}",
                    "throughput": [updating_throughput(k, rows, 8192) for k in keys],
                    "latency": [updating_latency(k, params["batches"], 8192, 100.0) for k in keys],
                }
            )
        )
        return
    runs = range(params["runs"])
    for _ in range(params.get("warmup", 0)):  # unmeasured, as for every engine of the run
        throughput(params["rows"], params["batch_rows"])
    result = {
        "engine": f"laminardb {laminardb.__version__}",
        "pyarrow": pa.__version__,
        "throughput": [throughput(params["rows"], params["batch_rows"]) for _ in runs],
        "close_latency": [
            close_latency(rows, params["samples"]) for rows in params["latency_batch_rows"]
        ],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
