"""The ``peers`` workload on LaminarDB, run by the peers venv's interpreter (it pins an older
pyarrow than pushtable, so this file imports nothing of pushtable): prints one JSON object.

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

try:  # pushtable importable (type checking, tests)
    from pushtable.bench.peer_workload import (
        DELAY_MS,
        PER_WINDOW,
        latency_batch,
        percentiles,
        throughput_batches,
    )
except ImportError:  # the peers venv: the file beside this one
    from peer_workload import (  # type: ignore[import-not-found,no-redef]
        DELAY_MS,
        PER_WINDOW,
        latency_batch,
        percentiles,
        throughput_batches,
    )

SQL = (
    "CREATE STREAM win AS SELECT min(ts) / 1000 AS w, count(*) AS n, sum(v) AS s FROM events "
    "GROUP BY TUMBLE(ts, INTERVAL '1' SECOND) EMIT ON WINDOW CLOSE"
)


def _open() -> tuple[Any, Any, Any, pa.Schema]:
    db = laminardb.open(":memory:")
    db.execute(
        "CREATE SOURCE events (ts BIGINT, k BIGINT, v BIGINT, "
        f"WATERMARK FOR ts AS ts - INTERVAL '{DELAY_MS}' MILLISECOND)"
    )
    db.execute(SQL)
    db.start()
    sub = db.subscribe_stream("win")
    return db, sub, db.writer("events"), db.schema("events")


def _read(sub: Any, until: threading.Event, out: list[tuple[float, pa.Table]]) -> None:
    while not until.is_set():
        try:
            got = sub.next_timeout(50)
        except Exception:  # noqa: BLE001 - laminardb raises SubscriptionError on timeout
            continue
        if got is not None:
            out.append((time.perf_counter(), got.to_arrow()))


def throughput(rows: int, batch_rows: int) -> dict[str, Any]:
    db, sub, writer, schema = _open()
    batches = throughput_batches(rows, batch_rows, schema)
    windows = -(-rows // PER_WINDOW)
    got: list[tuple[float, pa.Table]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read, args=(sub, stop, got), daemon=True)
    reader.start()
    start = time.perf_counter()
    for b in batches:
        writer.insert(b)
        writer.flush()
    # End of input: one row far ahead moves the watermark past every window (not counted).
    writer.insert(latency_batch(windows + 1, 1, schema))
    writer.flush()
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
    db, sub, writer, schema = _open()
    got: list[tuple[float, pa.Table]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read, args=(sub, stop, got), daemon=True)
    reader.start()
    written: list[float] = []
    start = time.perf_counter()
    for i in range(samples + 1):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        b = latency_batch(i, batch_rows, schema)
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
    return percentiles(batch_rows, ms)


def main() -> None:
    params = json.loads(sys.argv[1])
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
