"""``pushtable demo``: the whole product in one run, on embedded defaults.

A local Spark (``local[2]``) streams generated Parquet files, one per epoch. The
:class:`~pushtable.spark.ForeachBatchBridge` commits each epoch to a Lance dataset exactly once
and pushes it, stamped with its epoch id, into a live table ordered by epoch; a SQL query
grouped by epoch prints each epoch's result the moment the epoch lands, while Spark is still
producing (the bridge advances the table's watermark at each epoch's end). At the end, one SQL
statement compares what the live *query* returned with what was persisted (the Lance dataset,
through Lance's own provider in the same DataFusion context), level by level.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pushtable.context import SessionContext
from pushtable.sink import TableSink
from pushtable.spark import ForeachBatchBridge, local_spark

LEVELS = ("debug", "info", "warn", "error", "fatal")
SCHEMA = pa.schema([("id", pa.int64()), ("level", pa.string()), ("latency_ms", pa.float64())])
#: The live table: the epoch's rows, stamped with the epoch id by the bridge.
LIVE_SCHEMA = SCHEMA.append(pa.field("epoch", pa.int64()))
SPARK_DDL = "id long, level string, latency_ms double"
DEFAULT_SQL = (
    "SELECT epoch, level, count(*) AS events, round(avg(latency_ms), 2) AS avg_latency_ms "
    "FROM events GROUP BY epoch, level"
)


class LiveQueryFailed(RuntimeError):
    """The demo's live query failed (a bad ``--sql``, say): raised as soon as it does.

    Spark's query is stopped, rather than the error waiting for Spark's last epoch.
    """


@dataclass(frozen=True)
class DemoResult:
    """What one demo run did: its epochs, the rows the live table and Lance took, and more."""

    epochs: int
    #: rows the live query counted (its ``events`` column summed), or rows the table took
    live_rows: int
    lance_rows: int
    lance_version: int
    interrupted: bool
    #: epochs Spark had committed when the live query printed its first result
    first_result_after_epochs: int | None = None

    @property
    def matched(self) -> bool:
        """Whether the live query and Lance have the same number of rows."""
        return self.live_rows == self.lance_rows


def generate(src: Path, epochs: int, rows_per_epoch: int) -> None:
    """One Parquet file per epoch of synthetic log events."""
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for e in range(epochs):
        ids = np.arange(e * rows_per_epoch, (e + 1) * rows_per_epoch, dtype=np.int64)
        levels = pa.array(np.array(LEVELS)[rng.integers(0, len(LEVELS), rows_per_epoch)])
        latency = pa.array(rng.gamma(2.0, 15.0, rows_per_epoch))
        pq.write_table(
            pa.table([ids, levels, latency], schema=SCHEMA), src / f"epoch-{e:05d}.parquet"
        )


def _progress_line(sink: TableSink, bridge: ForeachBatchBridge, epochs: int, started: float) -> str:
    s = sink.stats
    done = 0 if bridge.last_report is None else bridge.last_report.epoch_id + 1
    rate = s.rows / max(time.perf_counter() - started, 1e-9)
    return (
        f"epochs {done}/{epochs} · rows {s.rows:,} · {rate:,.0f} rows/s · "
        f"queue {s.queued_batches}/{sink.capacity} · producer blocked {s.blocked_seconds:.2f}s"
    )


def run(out: Path, epochs: int, rows_per_epoch: int, sql: str, capacity: int) -> DemoResult:
    """Run the demo into ``out``; print live results and the final check with rich."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    generate(out / "source", epochs, rows_per_epoch)
    console.print(f"[bold]pushtable demo[/] → {out}  ({epochs} epochs x {rows_per_epoch:,} rows)")
    console.print("starting local Spark (local[2])…")
    spark = local_spark("pushtable-demo")
    ctx = SessionContext()
    sink = ctx.register_streaming_table(
        "events", LIVE_SCHEMA, capacity=capacity, order_by="epoch", unbounded=True
    )
    uri = out / "events.lance"
    bridge = ForeachBatchBridge(sinks=[sink], lance_uri=uri, epoch_column="epoch")
    returned: list[pa.RecordBatch] = []
    first_after: list[int] = []

    def live_batches() -> Iterable[pa.RecordBatch]:
        for b in ctx.sql(sql).execute_stream():
            if not first_after:
                report = bridge.last_report
                first_after.append(0 if report is None else report.epoch_id + 1)
            returned.append(b.to_pyarrow())
            yield returned[-1]

    reader, live_error = _print_live(live_batches, console, "live result (as each epoch lands)")
    query = _start(spark, out, out / "checkpoint", lambda w: w.foreachBatch(bridge))
    bridge.watch(query, spark)
    started = time.perf_counter()
    interrupted = False
    try:
        with Live(console=console, refresh_per_second=8, transient=True) as live:
            # Until Spark is done and the live query has printed its last batch.
            while (query.isActive or reader.is_alive()) and not live_error:
                live.update(_progress_line(sink, bridge, epochs, started))
                reader.join(0.25)  # ends once Spark is done and the live query printed
        # The status line's last state, on a line of its own (a terminal or not).
        console.print(_progress_line(sink, bridge, epochs, started))
        _await_spark(query, sink, live_error)
    except KeyboardInterrupt:
        interrupted = True
        console.print("\n[yellow]interrupted: stopping the streaming query…[/]")
        query.stop()
        sink.close()
    reader.join(60)
    if live_error and not interrupted:
        raise _failed(live_error[0])

    spark.stop()
    epochs = 0 if bridge.last_report is None else bridge.last_report.epoch_id + 1
    return _verdict(
        ctx, console, uri, returned, sink.stats.rows, epochs, interrupted, first_after, "live"
    )


def run_connect(out: Path, epochs: int, rows_per_epoch: int, sql: str, capacity: int) -> DemoResult:
    """The demo over the network: Spark Connect streams into ``writeStream.format("pushtable")``.

    Spark Connect (``remote("local[2]")``) runs the stream; the executors stage each
    micro-batch on a ``pushtable serve`` server and write its Lance fragments, the driver
    commits Lance and publishes the batch once; the server stamps it with its epoch and
    advances the table's watermark as it publishes it, and the live SQL result streams back
    to this process over Arrow Flight, one epoch at a time.
    """
    from rich.console import Console
    from rich.live import Live

    from pushtable.flight import Server, connect
    from pushtable.spark import query_id_from_checkpoint, register
    from pushtable.spark.session import local_spark_connect

    console = Console()
    generate(out / "source", epochs, rows_per_epoch)
    server = Server()  # loopback; Spark's Python workers connect to it
    client = connect(server.location)
    client.create_table("events", LIVE_SCHEMA, capacity=capacity, order_by="epoch", unbounded=True)
    console.print(
        f"[bold]pushtable demo --connect[/] → {out}  ({epochs} epochs x {rows_per_epoch:,} rows)"
        f"\npushtable server: {server.location}; starting Spark Connect (local[2])…"
    )
    spark = local_spark_connect("pushtable-demo-connect")
    register(spark)
    uri, checkpoint = out / "events.lance", out / "checkpoint"

    def to_server(writer: Any) -> Any:
        return (
            writer.format("pushtable")
            .option("uri", server.location)
            .option("table", "events")
            .option("lance_uri", str(uri))
            .option("epoch_column", "epoch")
        )

    returned: list[pa.RecordBatch] = []
    first_after: list[int] = []

    def published() -> int:
        """Epochs the server has published (the query's id is in its checkpoint)."""
        try:
            return client.published("events", query_id_from_checkpoint(checkpoint)) + 1
        except ValueError:  # the query has not written its checkpoint yet
            return 0

    def live_batches() -> Iterable[pa.RecordBatch]:
        for b in client.sql(sql):
            if not first_after:
                first_after.append(published())
            returned.append(b)
            yield b

    reader, live_error = _print_live(live_batches, console, "live result (remote)")
    query = _start(spark, out, checkpoint, to_server)
    sink = client.sink("events")
    interrupted = False
    try:
        with Live(console=console, refresh_per_second=4, transient=True) as live:
            while query.isActive and not live_error:
                s = sink.stats.table
                live.update(
                    f"epochs {published()}/{epochs} · rows {s.rows:,} · "
                    f"queue {s.queued_batches}/{capacity}"
                )
                query.awaitTermination(0.25)
        s = sink.stats.table
        console.print(f"epochs {published()}/{epochs} · rows {s.rows:,}")
        _await_spark(query, sink, live_error)
    except KeyboardInterrupt:
        interrupted = True
        query.stop()
    sink.close()  # end of stream: the live query gives its final answer
    reader.join(60)
    if live_error and not interrupted:
        raise _failed(live_error[0])
    epochs, table_rows = published(), sink.stats.table.rows
    spark.stop()
    client.close()
    server.stop()
    return _verdict(
        SessionContext(),
        console,
        uri,
        returned,
        table_rows,
        epochs,
        interrupted,
        first_after,
        "live on the server",
    )


def _verdict(
    ctx: SessionContext,
    console: Any,
    uri: Path,
    returned: list[pa.RecordBatch],
    table_rows: int,
    epochs: int,
    interrupted: bool,
    first_after: list[int],
    where: str,
) -> DemoResult:
    """What the demo shows last: the live answers against the Lance dataset at ``uri``."""
    import lance

    ds = lance.dataset(str(uri))
    ctx.register_table("persisted", ds)
    live_rows, lance_rows = _compare(ctx, console, returned, table_rows)
    result = DemoResult(
        epochs=epochs,
        live_rows=live_rows,
        lance_rows=lance_rows,
        lance_version=ds.version,
        interrupted=interrupted,
        first_result_after_epochs=first_after[0] if first_after else None,
    )
    verdict = "[green]counts match[/]" if result.matched else "[red]counts differ[/]"
    console.print(
        f"{verdict}: {result.live_rows:,} rows {where}, {result.lance_rows:,} rows in {uri} "
        f"(version {result.lance_version})"
    )
    _say_first_result(console, result)
    return result


def _await_spark(query: Any, sink: Any, live_error: list[BaseException]) -> None:
    """Wait for Spark's streaming query to end (raising its error if it failed).

    A live query that failed is said at once, not after Spark's last epoch: nothing reads the
    table then, so the next epoch would wait for room for good. Closing the table ends that
    wait, and Spark's query is stopped.
    """
    if live_error:
        sink.close()
        query.stop()
        raise _failed(live_error[0])
    query.awaitTermination()


def _failed(error: BaseException) -> LiveQueryFailed:
    failed = LiveQueryFailed(f"the live query failed: {error}")
    failed.__cause__ = error
    return failed


def _say_first_result(console: Any, result: DemoResult) -> None:
    if result.first_result_after_epochs is not None:
        console.print(
            f"first live result after {result.first_result_after_epochs} of {result.epochs} "
            "epochs committed (results stream while Spark runs)"
        )


def _compare(
    ctx: SessionContext, console: Any, returned: list[pa.RecordBatch], table_rows: int
) -> tuple[int, int]:
    """One SQL statement: what the live query returned against the Lance dataset.

    With a query that counts ``events`` per ``level`` (the default), level by level; with any
    other query, the rows the live table took against the rows persisted.
    """
    names = returned[0].schema.names if returned else []
    if {"level", "events"} <= set(names):
        ctx.register_record_batches("live_results", [returned])
        check = ctx.sql(
            "SELECT coalesce(l.level, p.level) AS level, l.events AS live_query, "
            "p.events AS lance, l.events IS NOT DISTINCT FROM p.events AS match "
            "FROM (SELECT level, sum(events) AS events FROM live_results GROUP BY level) l "
            "FULL JOIN (SELECT level, count(*) AS events FROM persisted GROUP BY level) p "
            "ON l.level = p.level ORDER BY 1"
        ).to_arrow_table()
        title = "what the live query returned vs the persisted Lance dataset (one SQL statement)"
        console.print(_as_table(check, title))
        live = sum(v or 0 for v in check["live_query"].to_pylist())
        lance = sum(v or 0 for v in check["lance"].to_pylist())
        return int(live), int(lance)
    ctx.register_record_batches(
        "live_stats", [[pa.record_batch({"live_rows": pa.array([table_rows], pa.int64())})]]
    )
    check = ctx.sql(
        "SELECT l.live_rows, p.lance_rows, l.live_rows = p.lance_rows AS counts_match "
        "FROM live_stats l CROSS JOIN (SELECT count(*) AS lance_rows FROM persisted) p"
    ).to_arrow_table()
    console.print(_as_table(check, "live table vs persisted Lance dataset (one SQL statement)"))
    return int(check["live_rows"][0].as_py()), int(check["lance_rows"][0].as_py())


def _print_live(
    batches: Callable[[], Iterable[pa.RecordBatch]], console: Any, title: str
) -> tuple[threading.Thread, list[BaseException]]:
    """Print each live result batch as the query yields it, on a thread; its error is kept."""
    errors: list[BaseException] = []

    def show() -> None:
        try:
            for batch in batches():
                console.print(_as_table(pa.Table.from_batches([batch]), title))
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    reader = threading.Thread(target=show, name="live-sql", daemon=True)
    reader.start()
    return reader, errors


def _start(spark: Any, out: Path, checkpoint: Path, sink: Callable[[Any], Any]) -> Any:
    """The demo's streaming query: one generated file per epoch, into the writer ``sink`` makes.

    ``sink`` makes that writer of Spark's ``DataStreamWriter``.
    """
    stream = (
        spark.readStream.schema(SPARK_DDL)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(out / "source"))
    )
    return (
        sink(stream.writeStream)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def _as_table(data: pa.Table, title: str) -> Any:
    from rich.table import Table

    table = Table(title=title, min_width=len(title) + 2)  # the title on one line
    for name in data.column_names:
        table.add_column(name)
    for row in data.to_pylist():
        table.add_row(
            *(
                f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
                for v in row.values()
            )
        )
    return table
