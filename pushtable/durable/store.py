"""A durable topic's history on disk: one Lance dataset, appended to by group commits.

Each row carries its batch's offset (``_offset``) and arrival time (``_timestamp``), so any
Lance reader can read the history by offset or time, and compaction (which rewrites
fragments) never loses where a row came from. Each commit is stamped (transaction
properties) with the offset after its last batch and every idempotent producer's last
sequence number stored so far: the newest stamped commit says exactly what is stored, and a
restart reads it back without scanning any data.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from pushtable.lance_epochs import not_found, open_dataset, write_fragments

__all__ = ["OFFSET", "TIMESTAMP", "LogStore", "Recovered", "StoredBatch"]

log = logging.getLogger(__name__)

#: the column holding each row's batch offset
OFFSET = "_offset"
#: the column holding each row's batch arrival time (UTC, microseconds)
TIMESTAMP = "_timestamp"
_TIME_TYPE = pa.timestamp("us", tz="UTC")
#: transaction properties of a commit
NEXT_KEY = "pushtable.next_offset"
PRODUCERS_KEY = "pushtable.producers"
CONSUMERS_KEY = "pushtable.consumers"
#: the schema metadata key holding the topic's options (order_by, retain...)
CONFIG_KEY = "pushtable.topic"
#: the tag on the newest stamped commit, moved at each upkeep so cleanup keeps it
TAG = "pushtable-log"


@dataclass(frozen=True)
class StoredBatch:
    """A batch as a commit stores it: its offset and arrival time (µs since the epoch, UTC)."""

    offset: int
    time_us: int
    batch: pa.RecordBatch


@dataclass(frozen=True)
class Recovered:
    """What the newest stamped commit says is stored."""

    next_offset: int
    producers: dict[str, int]
    version: int
    #: consumer -> the offset it said it has read up to (Spark's ``commit(end)``)
    consumers: dict[str, int] = field(default_factory=dict)


class LogStore:
    """Appends, reads and upkeep of one durable topic's Lance dataset.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> store = LogStore(tempfile.mkdtemp() + "/t.lance", pa.schema([("v", pa.int64())]))
        >>> batch = pa.record_batch({"v": [1, 2]})
        >>> version = store.append([StoredBatch(0, 0, batch)], {"p": 0})
        >>> store.recover().next_offset, store.recover().producers
        (1, {'p': 0})
        >>> store.read(0, 1, version).read_all().to_pydict()
        {'v': [1, 2]}
    """

    def __init__(
        self,
        uri: str | Path,
        schema: pa.Schema,
        config: dict[str, Any] | None = None,
        *,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        for name in (OFFSET, TIMESTAMP):
            if name in schema.names:
                raise ValueError(
                    f"a durable topic's schema cannot have a column named {name!r}: the topic's "
                    "dataset uses it for each row's offset and arrival time"
                )
        self.uri = str(uri)
        self.schema = schema.remove_metadata()
        self.storage_options = storage_options
        ds = self._open()
        if ds is None:
            stamps = [pa.field(OFFSET, pa.int64(), False), pa.field(TIMESTAMP, _TIME_TYPE, False)]
            stored = pa.schema(
                [*self.schema, *stamps], metadata={CONFIG_KEY: json.dumps(config or {})}
            )
            ds = lance.write_dataset(
                stored.empty_table(), self.uri, mode="create", storage_options=storage_options
            )
        else:
            have = describe(ds)[0]
            if not have.equals(self.schema):
                raise ValueError(
                    f"{self.uri} holds a topic with schema {have}, not the one given: {self.schema}"
                )
        self._ds: lance.LanceDataset = ds

    def _open(self) -> lance.LanceDataset | None:
        return open_dataset(self.uri, self.storage_options)

    # -- restart ------------------------------------------------------------------------

    def recover(self) -> Recovered:
        """The newest stamped commit's offsets and producer sequences (a compaction's commit
        carries no stamp: the walk passes it; if cleanup removed the stamped version, the tag
        that upkeep moved to it is read instead)."""
        ds = self._open()  # its own handle: upkeep calls this beside the committer
        if ds is None:
            return Recovered(0, {}, 0)
        page = 8
        while True:
            want = min(page, ds.version)
            try:
                txs = ds.get_transactions(want)
            except (OSError, ValueError) as exc:
                if not not_found(exc):
                    raise
                txs = []
            for i, tx in enumerate(txs):
                if tx is None:  # cleaned up: what is older is gone too
                    return self._from_tag(ds)
                props = dict(tx.transaction_properties or {})
                if NEXT_KEY in props:
                    return _recovered(props, ds.version - i)
            if len(txs) < want or want == ds.version:
                return self._from_tag(ds) if len(txs) < want else Recovered(0, {}, ds.version)
            page *= 4

    def _from_tag(self, ds: lance.LanceDataset) -> Recovered:
        try:
            version = int(ds.tags.get_version(TAG))
            tx = ds.read_transaction(version)
            props = dict(tx.transaction_properties or {}) if tx is not None else {}
        except (OSError, ValueError, AttributeError) as exc:
            if isinstance(exc, AttributeError) or not_found(exc):
                return Recovered(0, {}, ds.version)
            raise
        return _recovered(props, version) if NEXT_KEY in props else Recovered(0, {}, ds.version)

    # -- writing ------------------------------------------------------------------------

    def append(
        self,
        batches: Sequence[StoredBatch],
        producers: dict[str, int],
        consumers: dict[str, int] | None = None,
    ) -> int:
        """Store ``batches`` (consecutive offsets) in one transaction stamped with the offset
        after the last, ``producers``' sequences and ``consumers``' positions; returns the new
        version. Lance's commit is atomic: on any error nothing of it is visible."""
        table = self._stamped(batches)
        fragments = write_fragments(table, self.uri, self._ds.schema, self.storage_options)
        props = {
            NEXT_KEY: str(batches[-1].offset + 1),
            PRODUCERS_KEY: json.dumps(producers, separators=(",", ":")),
        }
        if consumers:
            props[CONSUMERS_KEY] = json.dumps(consumers, separators=(",", ":"))
        for attempt in range(6):
            tx = lance.Transaction(
                self._ds.version,
                lance.LanceOperation.Append(fragments),
                transaction_properties=props,
            )
            try:
                self._ds = lance.LanceDataset.commit(
                    self._ds, tx, storage_options=self.storage_options
                )
                return int(self._ds.version)
            except OSError as exc:  # upkeep committed meanwhile: Lance rebases, or we retry
                text = str(exc).lower()
                if ("conflict" not in text and "concurrent" not in text) or attempt == 5:
                    raise
                time.sleep(0.01 * 2**attempt)
                self._ds = self._open() or self._ds
        raise AssertionError("unreachable")

    def _stamped(self, batches: Sequence[StoredBatch]) -> pa.Table:
        columns: list[list[pa.Array]] = [[] for _ in self.schema]
        offsets, times = [], []
        for stored in batches:
            n = stored.batch.num_rows
            for i, column in enumerate(_aligned(stored.batch).columns):
                columns[i].append(column)
            offsets.append(pa.array(np.full(n, stored.offset, dtype=np.int64)))
            times.append(pa.array(np.full(n, stored.time_us, dtype=np.int64)).cast(_TIME_TYPE))
        arrays = [
            pa.chunked_array(c, type=f.type) for c, f in zip(columns, self.schema, strict=True)
        ]
        return pa.Table.from_arrays(
            [*arrays, pa.chunked_array(offsets), pa.chunked_array(times)],
            schema=self._ds.schema,
        )

    # -- reading ------------------------------------------------------------------------

    def read(self, start: int, end: int, version: int | None = None) -> pa.RecordBatchReader:
        """The rows of offsets ``[start, end)`` as of ``version``, in offset order, with the
        topic's columns only."""
        ds = self._at(version)
        scanner = ds.scanner(
            columns=self.schema.names,
            filter=f"{OFFSET} >= {int(start)} AND {OFFSET} < {int(end)}",
            scan_in_order=True,
        )
        reader = scanner.to_reader()
        if not reader.schema.equals(self.schema):
            reader = reader.cast(self.schema)
        return reader

    def offset_at(self, when: datetime, version: int | None = None) -> int | None:
        """The first offset that arrived at or after ``when`` (None: none stored)."""
        us = micros(when)
        ds = self._at(version)
        table = ds.to_table(columns=[OFFSET], filter=f"{TIMESTAMP} >= {_sql_time(us)}")
        if table.num_rows == 0:
            return None
        return int(pa.compute.min(table.column(0)).as_py())

    def _at(self, version: int | None) -> lance.LanceDataset:
        """A handle of the reader's own (the committer's must not be shared across threads)."""
        return lance.dataset(self.uri, version=version, storage_options=self.storage_options)

    # -- upkeep -------------------------------------------------------------------------

    def upkeep(self, keep_versions: timedelta) -> None:
        """Compact small fragments into larger ones and remove versions older than
        ``keep_versions`` (the newest stamped commit is tagged first, so cleanup keeps what
        a restart reads). Commits may run meanwhile: Lance rebases them over the compaction.
        It uses handles of its own: the committer's must not be touched from this thread."""
        ds = self._open()
        if ds is None:
            return
        ds.optimize.compact_files()
        recovered = self.recover()
        ds = self._open() or ds
        try:
            ds.tags.update(TAG, recovered.version)
        except (OSError, ValueError) as exc:
            if not not_found(exc):
                raise
            ds.tags.create(TAG, recovered.version)
        ds.cleanup_old_versions(older_than=keep_versions, error_if_tagged_old_versions=False)

    def disk_bytes(self) -> int:
        """Bytes the dataset's files take on disk now (local datasets)."""
        return directory_bytes(Path(self.uri))


def _aligned(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch``, copied once if a buffer is not aligned to 8 bytes (Lance's import refuses
    it; a batch from the network may carry one, depending on its message's framing)."""
    for column in batch.columns:
        if any(b is not None and b.address % 8 for b in _buffers(column)):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            return pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    return batch


def _buffers(array: pa.Array) -> list[pa.Buffer | None]:
    out = list(array.buffers())
    if isinstance(array, pa.DictionaryArray):
        out += _buffers(array.dictionary)
    return out


def describe(ds_or_uri: lance.LanceDataset | str | Path) -> tuple[pa.Schema, dict[str, Any]]:
    """A topic dataset's schema (its own columns) and the options it was created with."""
    ds = ds_or_uri if isinstance(ds_or_uri, lance.LanceDataset) else lance.dataset(str(ds_or_uri))
    schema = ds.schema
    config = json.loads((schema.metadata or {}).get(CONFIG_KEY.encode(), b"{}"))
    names = [n for n in schema.names if n not in (OFFSET, TIMESTAMP)]
    return pa.schema([schema.field(n) for n in names]), config


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # removed by a cleanup meanwhile
                total += os.stat(os.path.join(root, f)).st_size
    return total


def _recovered(props: dict[str, str], version: int) -> Recovered:
    producers = json.loads(props.get(PRODUCERS_KEY, "{}"))
    consumers = json.loads(props.get(CONSUMERS_KEY, "{}"))
    return Recovered(
        int(props[NEXT_KEY]),
        {str(k): int(v) for k, v in producers.items()},
        version,
        {str(k): int(v) for k, v in consumers.items()},
    )


def micros(when: datetime) -> int:
    """``when`` in µs since the epoch (it must carry a time zone)."""
    if when.tzinfo is None:
        raise ValueError(f"a start time needs a time zone (e.g. UTC), got {when!r}")
    return int((when - datetime(1970, 1, 1, tzinfo=timezone.utc)) / timedelta(microseconds=1))


def _sql_time(us: int) -> str:
    when = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=us)
    text = when.strftime("%Y-%m-%d %H:%M:%S.%f")
    return f"timestamp '{text}'"


def now_us() -> int:
    """The arrival time stamped on a batch: now, in µs since the epoch (UTC)."""
    return time.time_ns() // 1000
