"""The Spark bridge for a ``pushtable serve`` server: epochs go over Arrow Flight.

:class:`RemoteBridge` is a ``foreachBatch`` callable made only of plain settings, so it
pickles: it runs wherever Spark runs ``foreachBatch`` (the driver, or Spark Connect's
server-side Python worker) and its tasks run on the executors.

With ``push="executors"`` (the default) each partition goes from its own task straight to
the server, in parallel, staged under ``(query, epoch, partition, attempt)``; the tasks write
their Lance fragments in the same pass. The driver then commits the fragments (exactly once,
:mod:`pushtable.lance_epochs`) and publishes the epoch: the server moves the staged batches of
exactly the attempts Spark kept into the live table, once per epoch. ``push="driver"`` sends
the epoch from the driver (``toArrow``) through the same stage-and-publish step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from pushtable import lance_epochs
from pushtable.errors import SchemaDriftError, UnknownTableError
from pushtable.flight.client.client import Client, connect
from pushtable.spark.arrow import arrow_schema
from pushtable.spark.bridge import EpochReport, stamp_epoch, stamped_schema
from pushtable.spark.session import ensure_worker_python

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["RemoteBridge", "query_id_from_checkpoint"]

log = logging.getLogger(__name__)

Push = Literal["executors", "driver"]


def query_id_from_checkpoint(checkpoint: str | Path) -> str:
    """The streaming query's id as Spark keeps it in ``<checkpoint>/metadata``.

    Spark writes ``{"id": ...}`` there when a query first starts on a checkpoint and reads it
    back on every restart, so it is the same id ``StreamingQuery.id`` reports: a stable key
    for exactly-once commits where the query id is not a local property (Spark Connect).
    """
    text = str(checkpoint)
    path = Path(text.removeprefix("file://").removeprefix("file:")) / "metadata"
    try:
        first = path.read_text().splitlines()[0]
        query_id = json.loads(first)["id"]
    except (OSError, IndexError, ValueError, KeyError) as exc:
        raise ValueError(
            f"cannot read the query id from {path}: {exc}. checkpoint= must be the query's "
            "checkpointLocation on a local file system (Spark writes the metadata file when "
            "the query starts); elsewhere pass query_id=... instead"
        ) from exc
    if not isinstance(query_id, str) or not query_id:
        raise ValueError(f"{path} holds no query id: {first!r}")
    return query_id


class RemoteBridge:
    """Send each epoch of a streaming query to a ``pushtable serve`` table, persist it to Lance.

    Each epoch reaches both exactly once.

    Args:
        uri: the server, e.g. ``"grpc://127.0.0.1:8815"`` (``grpc+tls://`` for TLS).
        table: the server's table to feed; created from the first epoch's schema if absent.
        token: the server's bearer token, if it has one.
        tls_root_certs: PEM bytes (or a path) of the CA that signed the server's certificate.
        lance_uri: Lance dataset to commit epochs to (optional).
        mode: ``"append"`` (the live table needs it), ``"complete"`` or ``"update"``.
        query_id: the id stamped on commits and epochs. Default: read from ``checkpoint``,
            else Spark's query id (classic sessions only).
        checkpoint: the query's ``checkpointLocation``: its id is read from there (the way to
            a stable id under Spark Connect, where the driver's query id is not visible).
        push: ``"executors"`` (each task sends its partition) or ``"driver"``.
        publish_timeout: seconds the publish may wait for the live table's reader to make
            room; None (default): wait, so the reader paces the query (backpressure).
        epoch_column: stamp every row sent to the live table with its epoch id in this
            ``int64`` column (not persisted to Lance), as :class:`ForeachBatchBridge` does.
            A table the bridge creates is then ``order_by=epoch_column``, and the server
            advances an ordered table's watermark as it publishes each epoch, so a live
            ``GROUP BY epoch`` answers each epoch as it lands.

    Example:
        >>> from pushtable.spark import RemoteBridge
        >>> import pickle
        >>> bridge = RemoteBridge("grpc://127.0.0.1:8815", "events", checkpoint="/tmp/ck")
        >>> pickle.loads(pickle.dumps(bridge)).table     # it pickles: Spark Connect ships it
        'events'
        >>> # df.writeStream.foreachBatch(bridge).option("checkpointLocation", "/tmp/ck").start()
    """

    def __init__(
        self,
        uri: str,
        table: str,
        *,
        token: str | None = None,
        tls_root_certs: bytes | str | Path | None = None,
        lance_uri: str | Path | None = None,
        mode: lance_epochs.Mode = "append",
        query_id: str | None = None,
        checkpoint: str | Path | None = None,
        push: Push = "executors",
        publish_timeout: float | None = None,
        storage_options: dict[str, str] | None = None,
        epoch_column: str | None = None,
    ) -> None:
        if mode not in lance_epochs.MODES:
            raise ValueError(
                f"unknown mode {mode!r}; expected one of {', '.join(lance_epochs.MODES)}"
            )
        if mode != "append":
            raise ValueError(
                f"a live table needs mode='append': in {mode!r} mode every epoch restates "
                "results and the live table would show them duplicated (see docs/spark.md)"
            )
        if push not in ("executors", "driver"):
            raise ValueError(f"push must be 'executors' or 'driver', got {push!r}")
        if not table:
            raise ValueError("table must name the server's table")
        if epoch_column is not None and not epoch_column:
            raise ValueError("epoch_column must name a column or be None")
        if query_id is not None and not query_id:
            raise ValueError("query_id must be a non-empty string or None")
        if isinstance(tls_root_certs, (str, Path)):
            tls_root_certs = Path(tls_root_certs).read_bytes()
        self.uri = uri
        self.table = table
        self.token = token
        self.tls_root_certs = tls_root_certs
        self.lance_uri = None if lance_uri is None else str(lance_uri)
        self.mode: lance_epochs.Mode = mode
        self.query_id = query_id
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.push: Push = push
        self.publish_timeout = publish_timeout
        self.storage_options = storage_options
        self.epoch_column = epoch_column
        self.last_report: EpochReport | None = None
        #: test hook: (partition, step) at which attempt 0 of that partition's task fails
        self.fail_first_attempt: tuple[int, str] | None = None
        #: test hook: a path; before each publish the driver creates ``<path>.<epoch>.reached``
        #: and waits (at most two minutes) for ``<path>.<epoch>.go`` (a test kills the server
        #: between stage and publish)
        self.pause_before_publish: str | None = None
        self._client: Client | None = None
        self._writers: dict[str, lance_epochs.LanceEpochWriter] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_client=None, _writers={}, last_report=None)  # per-process connections
        return state

    def __repr__(self) -> str:
        return f"RemoteBridge({self.uri!r}, {self.table!r}, push={self.push!r})"

    # -- the foreachBatch callable ------------------------------------------------------

    def __call__(self, batch_df: DataFrame, epoch_id: int) -> None:
        """The foreachBatch callback: commit the epoch to Lance (if set), publish it; once each."""
        epoch = int(epoch_id)
        query_id = self._query_id(batch_df)
        client = self.client()
        writer = self.epoch_writer(query_id)
        lance_done = writer is None or writer.replayed(epoch) is not None
        live_done = epoch <= client.published(self.table, query_id)
        started = time.perf_counter()
        if lance_done and live_done:
            # A replay nobody needs. A stateful query still wants the batch processed.
            batch_df.write.format("noop").mode("overwrite").save()
            self._report(query_id, epoch, -1, started, "replayed: committed and published")
            return
        live_schema = self.live_schema(client, arrow_schema(batch_df.schema))
        plan = EpochPlan(query_id, epoch, writer, lance_done, live_done, live_schema)
        if self.push == "executors":
            ensure_worker_python(batch_df.sparkSession)
        send = self._from_executors if self.push == "executors" else self._from_driver
        rows, result = send(batch_df, plan)
        reason = result.reason if result is not None else "no Lance dataset configured"
        self._report(query_id, epoch, rows, started, reason)

    def _from_executors(
        self, batch_df: DataFrame, plan: EpochPlan
    ) -> tuple[int, lance_epochs.CommitResult | None]:
        writer = plan.writer
        lance_schema = None
        if writer is not None and not plan.lance_done:
            lance_schema = writer.schema_for(arrow_schema(batch_df.schema))
        task = PartitionTask(
            settings=self.settings(),
            table=self.table,
            query_id=plan.query_id,
            epoch=plan.epoch,
            live_schema=None if plan.live_done else plan.live_schema,
            lance_schema=lance_schema,
            lance_uri=self.lance_uri,
            storage_options=self.storage_options,
            fail_first_attempt=self.fail_first_attempt,
            epoch_column=self.epoch_column,
        )
        out = batch_df.mapInArrow(
            task, "partition int, attempt int, rows long, fragments string"
        ).collect()
        shares = [
            Share(
                int(r["partition"]), int(r["attempt"]), int(r["rows"]), json.loads(r["fragments"])
            )
            for r in out
        ]
        return sum(s.rows for s in shares), self.commit_shares(plan, shares, lance_schema)

    def commit_shares(
        self, plan: EpochPlan, shares: list[Share], lance_schema: pa.Schema | None
    ) -> lance_epochs.CommitResult | None:
        """The driver's half of an epoch the tasks staged: commit its fragments, then publish.

        The tasks' Lance fragments are committed once, then exactly the attempts in ``shares``
        (Spark's successful ones) are published once.
        """
        from lance.fragment import FragmentMetadata

        result = None
        if plan.writer is not None:
            if plan.lance_done:
                result = plan.writer.replayed(plan.epoch)
            else:
                assert lance_schema is not None
                fragments = [FragmentMetadata.from_json(f) for s in shares for f in s.fragments]
                result = plan.writer.commit_fragments(plan.epoch, fragments, lance_schema)
        self._publish(plan, [(s.partition, s.attempt, s.rows) for s in shares])
        return result

    def _from_driver(
        self, batch_df: DataFrame, plan: EpochPlan
    ) -> tuple[int, lance_epochs.CommitResult | None]:
        table = batch_df.toArrow()
        result = None
        if plan.writer is not None:
            done = plan.lance_done
            result = (
                plan.writer.replayed(plan.epoch) if done else plan.writer.commit(plan.epoch, table)
            )
        if not plan.live_done:
            stamped = stamp_epoch(table, self.epoch_column, plan.epoch)
            data = lance_epochs.conform_to(stamped, plan.live_schema).to_batches()
            self.client().stage(self.table, plan.query_id, plan.epoch, 0, 0, data, plan.live_schema)
        self._publish(plan, [(0, 0, table.num_rows)])
        return table.num_rows, result

    def _publish(self, plan: EpochPlan, parts: list[tuple[int, int, int]]) -> None:
        """After the Lance commit: the staged shares of ``parts`` into the live table, once."""
        if self.pause_before_publish is not None:
            _pause(f"{self.pause_before_publish}.{plan.epoch}")
        if not plan.live_done:
            self.client().publish(
                self.table,
                plan.query_id,
                plan.epoch,
                parts,
                timeout=self.publish_timeout,
                advance=None if self.epoch_column is None else plan.epoch + 1,
            )

    # -- helpers ------------------------------------------------------------------------

    def close(self) -> None:
        """End of stream for the server's table (the query is over): its reader finishes."""
        self.client().sink(self.table).close()

    def settings(self) -> dict[str, Any]:
        """The arguments of :func:`connect` for the server: ``uri``, ``token``, TLS roots."""
        return {"uri": self.uri, "token": self.token, "tls_root_certs": self.tls_root_certs}

    def client(self) -> Client:
        """This process's connection to the server, opened on first use."""
        if self._client is None:
            self._client = connect(**self.settings())
        return self._client

    def epoch_writer(self, query_id: str) -> lance_epochs.LanceEpochWriter | None:
        """The Lance writer of ``query_id``'s epochs, one per query (None: no ``lance_uri``)."""
        if self.lance_uri is None:
            return None
        writer = self._writers.get(query_id)
        if writer is None:
            writer = lance_epochs.LanceEpochWriter(
                self.lance_uri, query_id, self.mode, storage_options=self.storage_options
            )
            self._writers[query_id] = writer
        return writer

    def _query_id(self, batch_df: DataFrame) -> str:
        if self.query_id:
            return self.query_id
        if self.checkpoint is not None:
            self.query_id = query_id_from_checkpoint(self.checkpoint)
            return self.query_id
        with contextlib.suppress(Exception):  # Spark Connect has no SparkContext
            found = batch_df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
            if found:
                return str(found)
        raise ValueError(
            "no streaming query id: pass checkpoint=<the query's checkpointLocation> (Spark "
            "Connect) or query_id=...; it keys the exactly-once commits and live epochs"
        )

    def live_schema(self, client: Client, epoch_schema: pa.Schema) -> pa.Schema:
        """The server table's schema; the table is created from the epoch's if absent."""
        epoch_schema = stamped_schema(epoch_schema, self.epoch_column)
        try:
            schema = client.schema(self.table)
        except UnknownTableError:
            client.create_table(
                self.table, epoch_schema, if_not_exists=True, order_by=self.epoch_column
            )
            schema = client.schema(self.table)
        try:  # on the driver, before any task runs: a clear error, not an executor trace
            lance_epochs.conform_to(epoch_schema.empty_table(), schema)
        except SchemaDriftError as exc:
            raise SchemaDriftError(
                f"server table {self.table!r} cannot take this query's epochs: {exc}"
            ) from exc
        return schema

    def _report(self, query_id: str, epoch: int, rows: int, started: float, why: str) -> None:
        seconds = time.perf_counter() - started
        self.last_report = EpochReport(query_id, epoch, rows, 0.0, seconds, 0.0, True, True, why)


@dataclass(frozen=True)
class Share:
    """What one Spark task attempt staged: its partition's rows and its Lance fragments.

    The rows are on the server (under ``(partition, attempt)``); the fragments it wrote are
    JSON.
    """

    partition: int
    attempt: int
    rows: int
    fragments: list[str]


@dataclass(frozen=True)
class EpochPlan:
    """What one epoch still needs: a Lance commit, a publish, or both.

    A Lance commit unless ``lance_done``; a publish unless ``live_done``, i.e. the server
    published it before.
    """

    query_id: str
    epoch: int
    writer: lance_epochs.LanceEpochWriter | None
    lance_done: bool
    live_done: bool
    live_schema: pa.Schema


@dataclass(frozen=True)
class PartitionTask:
    """What one Spark task runs (pickled to the executors).

    It stages its partition on the server and writes its Lance fragments, in one pass over
    the partition's batches.
    """

    settings: dict[str, Any]
    table: str
    query_id: str
    epoch: int
    live_schema: pa.Schema | None
    lance_schema: pa.Schema | None
    lance_uri: str | None
    storage_options: dict[str, str] | None
    fail_first_attempt: tuple[int, str] | None
    epoch_column: str | None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        share = self.run(batches)
        yield pa.record_batch(
            {
                "partition": pa.array([share.partition], pa.int32()),
                "attempt": pa.array([share.attempt], pa.int32()),
                "rows": pa.array([share.rows], pa.int64()),
                "fragments": pa.array([json.dumps(share.fragments)], pa.string()),
            }
        )

    def run(self, batches: Iterator[pa.RecordBatch], client: Client | None = None) -> Share:
        """Stage this task's partition and write its fragments; what it did, as a share.

        ``client``: a connection the task already holds (else one of its own).
        """
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.attemptNumber() if context is not None else 0
        rows = 0
        fragments: list[str] = []
        held = contextlib.nullcontext(client) if client else connect(**self.settings)
        with held as client:
            stager = None
            if self.live_schema is not None:
                stager = client.stager(
                    self.table, self.query_id, self.epoch, partition, attempt, self.live_schema
                )

            def tee() -> Iterator[pa.RecordBatch]:
                nonlocal rows
                for batch in batches:
                    if not batch.num_rows:
                        continue
                    rows += batch.num_rows
                    if stager is not None:
                        assert self.live_schema is not None
                        stamped = stamp_epoch(
                            pa.Table.from_batches([batch]), self.epoch_column, self.epoch
                        )
                        live = lance_epochs.conform_to(stamped, self.live_schema)
                        for part in live.to_batches():
                            stager.write(part)
                    yield batch

            if self.lance_schema is not None:
                fragments = self._write_fragments(tee(), self.lance_schema)
            else:
                for _ in tee():
                    pass
            if stager is not None:
                stager.finish()
        self._fault(partition, attempt, "after_stage")
        return Share(partition, attempt, rows, fragments)

    def _write_fragments(self, batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> list[str]:
        assert self.lance_uri is not None
        written = lance_epochs.write_fragments(
            batches, self.lance_uri, schema, self.storage_options
        )
        return [json.dumps(f.to_json()) for f in written]

    def _fault(self, partition: int, attempt: int, step: str) -> None:
        if self.fail_first_attempt == (partition, step) and attempt == 0:
            raise RuntimeError(f"injected failure: partition {partition}, attempt 0, {step}")


def _pause(path: str) -> None:
    """The ``pause_before_publish`` test hook: say where the driver is, wait for the go."""
    Path(f"{path}.reached").touch()
    deadline = time.monotonic() + 120
    while not Path(f"{path}.go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
