"""The ``peers`` workload on Pathway, run by the peers venv's interpreter.

That venv pins an older pyarrow than pushtable, so this file imports nothing of pushtable
that needs it. It prints one JSON object.

Pathway's Python connector takes rows one at a time (``ConnectorSubject.next``); the window
is ``windowby(ts, tumbling(1000 ms), exactly_once_behavior())``, which emits each window once,
when a row past its end has been seen: the closing rule of pushtable's ordered table.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import pathway as pw  # type: ignore[import-not-found]
import pyarrow as pa

try:  # pushtable importable (type checking, tests)
    from pushtable.bench import peer_workload as work
except ImportError:  # the peers venv: the file beside this one
    import peer_workload as work  # type: ignore[import-not-found,no-redef]


class _Rows(pw.Schema):  # type: ignore[misc]
    ts: int
    k: int
    v: int


class _Feed(pw.io.python.ConnectorSubject):  # type: ignore[misc]
    """Writes the batches' rows; ``paced`` batches one every ``interval`` seconds."""

    def __init__(self, batches: list[pa.RecordBatch], interval: float = 0.0) -> None:
        super().__init__()
        self.batches = batches
        self.interval = interval
        self.written: list[float] = []

    def run(self) -> None:
        start = time.perf_counter()
        for i, b in enumerate(self.batches):
            if self.interval:
                time.sleep(max(0.0, start + i * self.interval - time.perf_counter()))
            self.written.append(time.perf_counter())
            cols = b.to_pydict()
            for ts, k, v in zip(cols["ts"], cols["k"], cols["v"], strict=True):
                self.next(ts=ts, k=k, v=v)
            self.commit()


def _run(batches: list[pa.RecordBatch], interval: float = 0.0) -> tuple[_Feed, list[Any], float]:
    """Run one Pathway graph over ``batches``.

    Returns the feed, the window rows (with their arrival times) and the seconds from start
    to the end of the run.
    """
    got: list[tuple[float, dict[str, Any]]] = []
    lock = threading.Lock()

    def on_change(key: Any, row: dict[str, Any], time: Any, is_addition: bool, **_: Any) -> None:
        if is_addition:
            with lock:
                got.append((_now(), row))

    feed = _Feed(batches, interval)
    table = pw.io.python.read(feed, schema=_Rows, autocommit_duration_ms=1)
    windows = table.windowby(
        table.ts,
        window=pw.temporal.tumbling(duration=1000),
        behavior=pw.temporal.exactly_once_behavior(),
    ).reduce(w=pw.this._pw_window_start, n=pw.reducers.count(), s=pw.reducers.sum(pw.this.v))
    pw.io.subscribe(windows, on_change=on_change)
    start = _now()
    pw.run(monitoring_level=pw.MonitoringLevel.NONE)
    return feed, got, _now() - start


_now = time.perf_counter


def throughput(rows: int, batch_rows: int) -> dict[str, Any]:
    """Rows per second through a 1-second tumbling window, flat out; results verified."""
    batches = work.throughput_batches(rows, batch_rows)
    feed, got, seconds = _run(batches)
    last = max((at for at, _ in got), default=_now())
    seconds = last - feed.written[0] if feed.written else seconds
    n = sum(r["n"] for _, r in got)
    s = sum(r["s"] for _, r in got)
    return {
        "rows": rows,
        "batch_rows": batch_rows,
        "windows": len(got),
        "expected_windows": -(-rows // work.PER_WINDOW),
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "verified": n == rows and s == rows,
    }


def close_latency(batch_rows: int, samples: int, interval: float = 0.02) -> dict[str, Any]:
    """Write -> window row: each batch opens a new second, closing the one before."""
    feed, got, _ = _run([work.latency_batch(i, batch_rows) for i in range(samples + 1)], interval)
    arrived: dict[int, float] = {}
    for at, row in got:
        arrived.setdefault(int(row["w"]) // 1000, at)
    ms = sorted(
        (arrived[i] - feed.written[i + 1]) * 1e3
        for i in range(samples)
        if i in arrived and arrived[i] >= feed.written[i + 1]
    )
    return work.percentiles(batch_rows, ms)


def _shape(table: Any, shape: str) -> Any:
    """Pathway's form of a window shape.

    ``sliding(hop=1 s, duration=10 s)`` and ``dense``'s ``tumbling(duration=1 s)`` emitted
    once per window, ``session(max_gap=300 ms)`` (its final rows are the sessions).
    """
    if shape == "sliding":
        window = pw.temporal.sliding(hop=1000, duration=10_000)
        behavior = pw.temporal.exactly_once_behavior()
    elif shape == "dense":
        window = pw.temporal.tumbling(duration=1000)
        behavior = pw.temporal.exactly_once_behavior()
    else:
        window, behavior = pw.temporal.session(max_gap=300), None
    return table.windowby(table.ts, window=window, behavior=behavior).reduce(
        lo=pw.this._pw_window_start, n=pw.reducers.count(), s=pw.reducers.sum(pw.this.v)
    )


def shape_throughput(shape: str, rows: int, batch_rows: int) -> dict[str, Any]:
    """A Spark window shape over ``rows`` rows, flat out, timed from first write to last change.

    Verified when the final windows count every row as often as Spark does.
    """
    make, copies = work.SHAPES[shape]
    batches = make(rows, batch_rows)
    final: dict[Any, tuple[float, dict[str, Any]]] = {}
    lock = threading.Lock()

    def on_change(key: Any, row: dict[str, Any], time: Any, is_addition: bool, **_: Any) -> None:
        with lock:  # an upsert per window key: a session's rows change as it grows
            if is_addition:
                final[key] = (_now(), row)
            elif key in final and final[key][1] == row:
                del final[key]

    feed = _Feed([*batches, work.batch(work.FAR_MS, 1, 0)])
    table = pw.io.python.read(feed, schema=_Rows, autocommit_duration_ms=1)
    pw.io.subscribe(_shape(table, shape), on_change=on_change)
    pw.run(monitoring_level=pw.MonitoringLevel.NONE)
    counted = [row for _, row in final.values() if row["lo"] < work.FAR_MS - 10_000]
    written = sum(b.num_rows for b in batches)
    last = max((at for at, _ in final.values()), default=_now())
    seconds = last - feed.written[0]
    return {
        "shape": shape,
        "rows": written,
        "windows": len(counted),
        "seconds": seconds,
        "rows_per_s": written / seconds,
        "verified": sum(r["n"] for r in counted) == written * copies,
    }


def join_throughput(rows_per_side: int, batch_rows: int) -> dict[str, Any]:
    """The interval join, both sides fed at once; timed from the first write to the last match.

    It is ``interval_join`` with ``interval(0, 1000)`` on ``a.k == b.k``.
    """
    matches: list[float] = []
    lock = threading.Lock()

    def on_change(key: Any, row: dict[str, Any], time: Any, is_addition: bool, **_: Any) -> None:
        with lock:
            if is_addition:
                matches.append(_now())
            else:
                matches.pop()

    batches = rows_per_side // batch_rows
    feeds = [_Feed([work.join_side(i, batch_rows, off) for i in range(batches)]) for off in (0, 5)]
    a, b = (pw.io.python.read(f, schema=_Rows, autocommit_duration_ms=1) for f in feeds)
    joined = a.interval_join(b, a.ts, b.ts, pw.temporal.interval(0, 1000), a.k == b.k).select(
        k=pw.left.k
    )
    pw.io.subscribe(joined, on_change=on_change)
    pw.run(monitoring_level=pw.MonitoringLevel.NONE)
    want = batches * batch_rows
    first = min(f.written[0] for f in feeds if f.written)
    seconds = (max(matches) if matches else _now()) - first
    return {
        "rows_per_side": want,
        "matches": len(matches),
        "seconds": seconds,
        "rows_per_s": 2 * want / seconds,
        "verified": len(matches) == want,
    }


def updating_throughput(keys: int, rows: int, batch_rows: int) -> dict[str, Any]:
    """``groupby(k).reduce(count, sum, max)`` over ``rows`` rows flat out.

    Its changes are applied as upserts; timed from the first write to the change that
    completes every key.
    """
    import numpy as np

    batches = [work.keyed_batch(i, batch_rows, keys) for i in range(rows // batch_rows)]
    written = len(batches) * batch_rows
    expected = np.bincount(np.arange(written) % keys, minlength=keys)
    counts = np.zeros(keys, np.int64)
    done: list[float] = []
    lock = threading.Lock()
    left = [int(np.count_nonzero(expected))]

    def on_change(key: Any, row: dict[str, Any], time: Any, is_addition: bool, **_: Any) -> None:
        if not is_addition:
            return
        with lock:
            k = row["k"]
            before = counts[k] == expected[k]
            counts[k] = row["n"]
            left[0] += int(before) - int(counts[k] == expected[k])
            if left[0] == 0 and not done:
                done.append(_now())

    feed = _Feed(batches)
    table = pw.io.python.read(feed, schema=_Rows, autocommit_duration_ms=1)
    agg = table.groupby(pw.this.k).reduce(
        pw.this.k,
        n=pw.reducers.count(),
        s=pw.reducers.sum(pw.this.v),
        b=pw.reducers.max(pw.this.ts),
    )
    pw.io.subscribe(agg, on_change=on_change)
    pw.run(monitoring_level=pw.MonitoringLevel.NONE)
    seconds = (done[0] if done else _now()) - feed.written[0]
    return {
        "keys": keys,
        "rows": written,
        "rows_per_s": written / seconds,
        "verified": bool(np.array_equal(counts, expected)),
    }


def main() -> None:
    """Run what the JSON parameters in ``sys.argv[1]`` ask for; print one JSON object."""
    params = json.loads(sys.argv[1])
    rows = min(params["rows"], params.get("pathway_max_rows", params["rows"]))
    shape = params.get("shape")
    if shape is not None:  # one of the live SQL shapes beside the tumbling workload
        if shape == "updating":
            runs_ = [updating_throughput(k, rows, 8192) for k in params["keys"]]
        elif shape == "join":
            runs_ = [join_throughput(rows, params["batch_rows"])]
        else:
            runs_ = [shape_throughput(shape, rows, params["batch_rows"])]
        print(json.dumps({"engine": f"pathway {pw.__version__}", "throughput": runs_}))
        return
    runs = range(params["runs"])
    for _ in range(params.get("warmup", 0)):  # unmeasured, as for every engine of the run
        throughput(rows, params["batch_rows"])
    result = {
        "engine": f"pathway {pw.__version__}",
        "pyarrow": pa.__version__,
        "throughput": [throughput(rows, params["batch_rows"]) for _ in runs],
        "close_latency": [
            close_latency(rows_, params["samples"]) for rows_ in params["latency_batch_rows"]
        ],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
