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
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Final

import lance
import numpy as np
import pyarrow as pa

from pushtable import lance_commits
from pushtable.durable.fence import (
    EPOCH_KEY,
    FENCE_TAG,
    REFENCE_S,
    Fence,
    check_epoch,
    fence_topic,
    refence,
)
from pushtable.errors import DataDirInUseError, OffsetOutOfRangeError
from pushtable.lance_commits import open_dataset
from pushtable.lance_epochs import write_fragments

__all__ = ["OFFSET", "TIMESTAMP", "LogStore", "Recovered", "Stamp", "StoredBatch"]

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
#: the first offset retention has not deleted
EARLIEST_KEY = "pushtable.earliest"
#: producer -> CRC-32s of its last stored batches (the newest last; see ``DurableLog``)
PRINTS_KEY = "pushtable.prints"
#: producer -> the rows of its newest stored unit (a Spark epoch)
UNITS_KEY = "pushtable.units"
#: the schema metadata key holding the topic's options (order_by, retain...)
CONFIG_KEY = "pushtable.topic"
#: the tag on the newest stamped commit, moved at each upkeep so cleanup keeps it
TAG = "pushtable-log"


#: The Lance file version of a topic's dataset. 2.1 encodes a topic's rows (with the two
#: per-row columns, constant within a batch) about 18 % faster than 2.2, pylance 14's default
#: (13.7 vs 11.6 M rows/s of ``k int64, v float64, s string`` + ``_offset``, ``_timestamp``;
#: docs/benchmarks.md). A dataset keeps the version it was created with.
STORAGE_VERSION: Final = "2.1"


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
    #: the first offset still stored (retention deletes whole fragments below it)
    earliest: int = 0
    #: producer -> fingerprints of its last stored batches, the newest (its sequence) last
    prints: dict[str, list[int]] = field(default_factory=dict)
    #: producer -> the rows of its newest stored unit (a Spark epoch)
    units: dict[str, int] = field(default_factory=dict)

    def stamp(self) -> Stamp:
        """The stamp that says what this says is stored."""
        return Stamp(
            self.next_offset, self.producers, self.consumers, self.earliest, self.prints, self.units
        )


@dataclass(frozen=True)
class Stamp:
    """What a commit says is stored: written in its transaction properties."""

    next_offset: int
    producers: dict[str, int]
    consumers: dict[str, int]
    earliest: int
    #: producer -> fingerprints of its last stored batches (the newest last): a reuse of a
    #: sequence with other rows is refused after a restart too
    prints: dict[str, list[int]] = field(default_factory=dict)
    #: producer -> the rows of its newest stored unit: a replay with other rows is refused
    units: dict[str, int] = field(default_factory=dict)

    def props(self) -> dict[str, str]:
        """The stamp as transaction properties (optional keys only when there are some)."""
        props = {
            NEXT_KEY: str(self.next_offset),
            PRODUCERS_KEY: json.dumps(self.producers, separators=(",", ":")),
            EARLIEST_KEY: str(self.earliest),
        }
        for key, value in (
            (CONSUMERS_KEY, self.consumers),
            (PRINTS_KEY, self.prints),
            (UNITS_KEY, self.units),
        ):
            if value:
                props[key] = json.dumps(value, separators=(",", ":"))
        return props


@dataclass(frozen=True)
class _Bounds:
    """A fragment's offsets and newest arrival time, and its bytes on disk."""

    first: int
    last: int
    newest_us: int
    nbytes: int


@dataclass(frozen=True)
class Written:
    """Fragments written and synced for one group commit, not yet committed."""

    fragments: list[Any]
    bounds: _Bounds


class Pin:
    """A reader's hold on a version of the dataset (see :meth:`LogStore.pin`)."""

    def __init__(self, store: LogStore, version: int, key: int) -> None:
        self._store: LogStore | None = store
        self.version = version
        self._key = key
        #: when it was taken (monotonic seconds): a store's ``hold`` bounds how long it counts
        self.taken = time.monotonic()
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let cleanup remove the version (idempotent)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store._unpin(self._key)


class LogStore:
    """Appends, reads and upkeep of one durable topic's Lance dataset.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> store = LogStore(tempfile.mkdtemp() + "/t.lance", pa.schema([("v", pa.int64())]))
        >>> batch = pa.record_batch({"v": [1, 2]})
        >>> version = store.append([StoredBatch(0, 0, batch)], Stamp(1, {"p": 0}, {}, 0))
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
        sync: bool = True,
        fence: Fence | None = None,
    ) -> None:
        for name in (OFFSET, TIMESTAMP):
            if name in schema.names:
                raise ValueError(
                    f"a durable topic's schema cannot have a column named {name!r}: the topic's "
                    "dataset uses it for each row's offset and arrival time"
                )
        self.uri = str(uri)
        if fence is not None and not (fence.current() and fence.held()):  # lost its data dir
            raise fence.refuse(f"opening durable topic {self.uri}")
        self.schema = schema.remove_metadata()
        self.storage_options = storage_options
        #: the owner's epoch its commits carry (a server's data dir; see
        #: :mod:`pushtable.durable.fence`): None, nothing fences the dataset
        self.fence = fence
        #: fsync what each commit wrote before it counts as stored (local datasets)
        self.sync = sync
        #: fragments' bounds by their first data file (a fragment's files never change;
        #: compaction writes new ones)
        self._bounds: dict[str, _Bounds] = {}
        #: held by each commit and by upkeep: a commit that landed while a compaction was
        #: in flight had Lance rebase the compaction over it, and the rows came out of
        #: offset order (the rebased compaction's fragment after the appended ones).
        self._committing = threading.Lock()
        #: versions readers hold (pin -> (version, taken at)): cleanup keeps them, for
        #: ``hold`` seconds at most
        self._pins: dict[int, tuple[int, float]] = {}
        self._next_pin = 0
        self._pins_lock = threading.Lock()
        #: seconds a reader may hold a version against cleanup (None: as long as it reads).
        #: Past it the version's files may go, and the reader is told with
        #: ``OffsetOutOfRangeError`` (a server sets its ``reader_hold`` limit here).
        self.hold: float | None = None
        #: bytes of retention's deletions a reader's pin may keep on disk beyond the live
        #: dataset (None: no bound); past them the oldest pins hold no more (``reader_hold_bytes``)
        self.hold_bytes: int | None = None
        #: (the version of a retention deletion, its bytes): kept by pins of older versions
        self._removed: list[tuple[int, int]] = []
        #: pins of versions below this hold nothing: they would keep more than ``hold_bytes``
        self._bytes_floor = 0
        #: every version below this is removed (a lower bound: cleanup may have done more)
        self._cleaned_below = 1
        ds = self._open()
        if ds is None:
            stamps = [pa.field(OFFSET, pa.int64(), False), pa.field(TIMESTAMP, _TIME_TYPE, False)]
            stored = pa.schema(
                [*self.schema, *stamps], metadata={CONFIG_KEY: json.dumps(config or {})}
            )
            ds = lance.write_dataset(
                stored.empty_table(),
                self.uri,
                mode="create",
                storage_options=storage_options,
                data_storage_version=STORAGE_VERSION,
            )
        else:
            have = describe(ds)[0]
            if not have.equals(self.schema):
                raise ValueError(
                    f"{self.uri} holds a topic with schema {have}, not the one given: {self.schema}"
                )
        if fence is not None:  # the owner's first act: no commit prepared before lands
            ds = fence_topic(
                self.uri,
                fence,
                lambda state: _stamp(stamp_of(state)).props(),
                storage_options,
            )
        self._ds: lance.LanceDataset = ds
        #: when this owner last fenced the topic (monotonic; see :meth:`_refence_if_due`):
        #: never, as far as cleanup goes, so its first cleanup fences again at once and the
        #: open's fence (which pins the history from before the open) goes with it
        self._fenced_at = -REFENCE_S
        #: versions of this owner's older fences (untagged): the next cleanup removes them
        self._old_fences: set[int] = set()
        #: the stored schema (the topic's columns and the two per row): fixed for its life
        self._schema: pa.Schema = ds.schema

    def _open(self) -> lance.LanceDataset | None:
        return open_dataset(self.uri, self.storage_options)

    # -- restart ------------------------------------------------------------------------

    def recover(self) -> Recovered:
        """The newest stamped commit's offsets and producer sequences.

        A compaction's commit carries no stamp: the walk passes it; if cleanup removed the
        stamped version, the tag that upkeep moved to it is read instead.
        """
        ds = self._open()  # its own handle: upkeep calls this beside the committer
        if ds is None:
            return Recovered(0, {}, 0)
        return stamp_of(ds)

    # -- writing ------------------------------------------------------------------------

    def append(self, batches: Sequence[StoredBatch], stamp: Stamp) -> int:
        """Store ``batches`` (consecutive offsets) in one transaction stamped with ``stamp``.

        ``stamp`` counts them. Returns the new version. Lance's commit is atomic: on any error
        nothing of it is visible. With :attr:`sync`, it is on disk when this returns.
        """
        return self.commit_written(self.write(batches), stamp)

    def write(self, batches: Sequence[StoredBatch]) -> Written:
        """The first half of :meth:`append`: write (and sync) the fragments, uncommitted.

        Thread-safe beside :meth:`commit_written` of an earlier group: a topic encodes the next
        group while the last one commits.
        """
        table = self._stamped(batches)
        fragments = write_fragments(table, self.uri, self._schema, self.storage_options)
        if self.sync:
            lance_commits.sync_fragments(self.uri, fragments)
        bounds = _Bounds(
            batches[0].offset,
            batches[-1].offset,
            max(b.time_us for b in batches),
            0,
        )
        return Written(fragments, bounds)

    def commit_written(self, written: Written, stamp: Stamp) -> int:
        """The second half of :meth:`append`: commit ``written`` stamped with ``stamp``.

        When it raises, the commit may still have landed (its manifest written, then the sync
        after it failed, or an object store's reply lost): :meth:`landed` tells, before
        anything is committed again.
        """
        props = self._props(stamp)
        self._commit(
            lambda ds: lance.Transaction(
                ds.version,
                lance.LanceOperation.Append(written.fragments),
                transaction_properties=props,
            )
        )
        self._learn(written)
        return int(self._ds.version)

    def _learn(self, written: Written) -> None:
        for fragment in written.fragments:  # whole group commits expire together
            size = sum(f.file_size_bytes or 0 for f in fragment.files)
            self._bounds[fragment.files[0].path] = dataclasses.replace(written.bounds, nbytes=size)

    def landed(self, after: int, written: Written | None = None) -> Recovered | None:
        """The newest stamp, read afresh, when it stores offsets from ``after`` on; else None.

        Called after a commit raised, before it is tried again: the commit may have landed.
        A landed commit is synced again (with :attr:`sync`: the failure may have been the
        sync) and becomes the store's current version; ``written`` is then what it holds.
        Raises when the dataset cannot be read (or synced): the caller cannot tell yet.
        """
        ds = self._open()
        if ds is None:
            return None
        self._check_fence(ds, "reading back a commit")  # a newer owner's stamp is not ours
        found = stamp_of(ds)
        if found.next_offset <= after:
            return None
        if self.sync:
            lance_commits.sync_commit(ds.checkout_version(found.version))
        self._ds = ds
        if written is not None:
            self._learn(written)
        return found

    def discard(self, written: Written) -> None:
        """Delete the data files of ``written``: fragments no commit holds.

        Its commit failed and did not land, or its group was given up: otherwise the files
        would stay until Lance's sweep of unreferenced files, counted against the data dir's
        bound. Best effort.
        """
        names = [file.path for fragment in written.fragments for file in fragment.files]
        lance_commits.remove_data_files(self._ds, names)

    def _props(self, stamp: Stamp) -> dict[str, str]:
        """``stamp`` as a commit's properties, with the owner's epoch when fenced."""
        props = stamp.props()
        if self.fence is not None:
            props[EPOCH_KEY] = str(self.fence.epoch)
        return props

    def _check_fence(self, ds: lance.LanceDataset, what: str) -> None:
        """Raise :class:`~pushtable.DataDirInUseError` when this owner may not commit to ``ds``.

        The store's fence is the conflict a commit over an older version meets; this is what
        keeps a commit from being retried over a version a newer owner fenced (and, beside
        it, an owner that knows it lost the data dir from trying at all).
        """
        fence = self.fence
        if fence is None:
            return
        if not fence.current():
            raise fence.refuse(f"{what} of {self.uri}")
        check_epoch(ds, fence, f"{what} of {self.uri}")

    def _commit(self, transaction: Any) -> lance.LanceDataset:
        """Commit ``transaction(ds)`` over the version this store last read (or wrote).

        A fenced store commits over the version it read and, when a commit conflicts, reads
        the epoch before anything is tried again: a newer owner's fence raises
        :class:`~pushtable.DataDirInUseError` (the commit did not land).
        """
        if self.fence is not None and not self.fence.current():  # its own version: no read
            raise self.fence.refuse(f"committing to {self.uri}")
        mine = transaction(self._ds).transaction_properties or {}

        def recheck(ds: lance.LanceDataset) -> lance.LanceDataset | None:
            """Before a retry: a newer owner's fence raises; this very commit, landed, ends it.

            (A commit that landed and was reported as a conflict, as an object store's
            conditional PUT retried after a lost reply answers: committed again over its own
            version, it was stored twice.) A stamp names its offsets, so no other commit has
            the same properties.
            """
            if self.fence is not None:
                self._check_fence(ds, "committing")
            if mine and lance_commits.props_at(ds, ds.version) == mine:
                return ds
            return None

        with self._committing:
            for attempt in range(2):
                try:
                    new = lance_commits.commit(
                        self._ds,
                        transaction,
                        storage_options=self.storage_options,
                        retries=6,  # another writer of the dataset committed meanwhile
                        sync=self.sync,
                        recheck=recheck,
                        # fenced: a lost race comes back to ``recheck``, never rebased by Lance
                        lance_retries=None if self.fence is None else 0,
                    )
                    break
                except OSError as exc:
                    if self.fence is None or (latest := self._open()) is None:
                        raise
                    self._check_fence(latest, "committing")  # fenced: it did not land
                    if (landed := recheck(latest)) is not None:  # its own, reported refused
                        new = landed
                        break
                    refused = isinstance(exc, lance_commits.CommitContentionError)
                    # Any other error may have come after the commit landed (a late sync, a
                    # lost reply): the caller reads the stamp back (:meth:`landed`) before
                    # anything is committed again. Committing it again here would store it
                    # twice.
                    if not refused or attempt or latest.version == self._ds.version:
                        raise
                    # Refused, not fenced: the conflict was with a version this handle did
                    # not know (a successor's fence that this owner restored back, its own
                    # fence again): once more, over the newest, its epoch checked.
                    self._ds = latest
            assert isinstance(new, lance.LanceDataset)
            if self.fence is not None:
                self._landed_on_top(new)
            self._ds = new  # under the lock: upkeep's fence, made under it too, is not undone
        return new

    def _refence_if_due(self, ds: lance.LanceDataset) -> lance.LanceDataset:
        """Fence the topic again before cleanup, at most every ``REFENCE_S``.

        The caller holds ``_committing``; ``ds`` is the newest version, checked. Cleanup
        keeps the newest fence (tagged), which Lance needs to refuse an old owner's commit
        once the versions after its read are gone; fencing again now and then lets the
        files of the older fence go (a tagged version pins them).
        """
        if self.fence is None or time.monotonic() - self._fenced_at < REFENCE_S:
            return ds
        previous = lance_commits.read_tag(ds, FENCE_TAG)
        new = refence(ds, self.fence, _stamp(stamp_of(ds)).props(), self.storage_options)
        self._fenced_at = time.monotonic()
        self._ds = new
        if previous is not None:  # untagged now: the next cleanup below it removes it
            self._old_fences.add(previous)
        return new

    @property
    def fenced_at(self) -> float:
        """When this owner last fenced the topic (monotonic seconds)."""
        return self._fenced_at

    def _landed_on_top(self, new: lance.LanceDataset) -> None:
        """Raise :class:`~pushtable.DataDirInUseError` unless ``new`` is the newest version.

        This store is its dataset's one writer while its fence holds (commits and upkeep
        take ``_committing``), so a newer version is another owner's. A commit stalled
        inside Lance past its successor's cleanup (a paused process, a partition) can write
        a manifest number that cleanup freed, below the successor's newest: it "lands" in
        no version the topic reads. It is not acknowledged.
        """
        latest = self._open()
        if latest is not None and latest.version != new.version:
            assert self.fence is not None
            self._check_fence(latest, "committing")
            raise DataDirInUseError(
                f"committing to {self.uri}: version {new.version} is not the newest "
                f"({latest.version}): another writer committed meanwhile; nothing more is "
                "stored or acknowledged here"
            )

    # -- retention ----------------------------------------------------------------------

    def expire(
        self, stamp: Stamp, older_than_us: int | None, keep_bytes: int | None
    ) -> tuple[int, int] | None:
        """Delete the oldest whole fragments retention no longer keeps, in one Lance transaction.

        Those are the fragments whose rows all arrived before ``older_than_us``, and the oldest
        while the history holds more than ``keep_bytes``. The transaction is stamped with
        ``stamp`` and the new earliest offset. Returns (earliest, version), or None when
        nothing is due. Readers of older versions keep their rows until cleanup removes those
        versions.
        """
        plan: dict[str, Any] = {}

        def transaction(ds: lance.LanceDataset) -> lance.Transaction:
            ids, earliest = self._due(ds, stamp.next_offset, older_than_us, keep_bytes)
            plan["earliest"] = earliest
            props = self._props(dataclasses.replace(stamp, earliest=earliest))
            delete = lance.LanceOperation.Delete([], ids, f"{OFFSET} < {earliest}")
            return lance.Transaction(ds.version, delete, transaction_properties=props)

        ids, _ = self._due(self._ds, stamp.next_offset, older_than_us, keep_bytes)
        if not ids:
            return None
        chosen = set(ids)
        nbytes = sum(
            self._bounds_of(f).nbytes for f in self._ds.get_fragments() if f.fragment_id in chosen
        )
        self._commit(transaction)
        with self._pins_lock:  # what a reader of an older version keeps on disk from now
            self._removed.append((int(self._ds.version), nbytes))
        live = {fragment.metadata.files[0].path for fragment in self._ds.get_fragments()}
        self._bounds = {k: v for k, v in self._bounds.items() if k in live}
        return int(plan["earliest"]), int(self._ds.version)

    def expired_after_all(self, next_offset: int) -> tuple[int, int] | None:
        """After :meth:`expire` raised: (earliest, version) if its deletion landed all the same.

        The newest stamp is read afresh; when it is this owner's (the fence is checked) and
        says the same offsets are stored with a later ``earliest``, the deletion landed: it
        becomes the store's current version. None when it did not (the next check deletes
        again). Raises when the dataset cannot be read.
        """
        ds = self._open()
        if ds is None:
            return None
        self._check_fence(ds, "reading back a deletion")
        found = stamp_of(ds)
        if found.next_offset != next_offset or found.earliest <= self.recover_earliest():
            return None
        with self._committing:
            self._ds = ds
        live = {fragment.metadata.files[0].path for fragment in ds.get_fragments()}
        self._bounds = {k: v for k, v in self._bounds.items() if k in live}
        return found.earliest, int(ds.version)

    def recover_earliest(self) -> int:
        """The first offset the handle's own version says is stored."""
        return stamp_of(self._ds).earliest

    def _due(
        self,
        ds: lance.LanceDataset,
        next_offset: int,
        older_than_us: int | None,
        keep_bytes: int | None,
    ) -> tuple[list[int], int]:
        """The ids of the oldest fragments retention deletes, and the first offset after them.

        They are a prefix in offset order: no gap is ever left.
        """
        fragments = [(f.fragment_id, self._bounds_of(f)) for f in ds.get_fragments()]
        total = sum(b.nbytes for _, b in fragments)
        ids: list[int] = []
        last = -1
        for fid, bounds in fragments:
            if bounds.first <= last:
                break  # not in offset order (never seen): stop rather than leave a gap
            aged = older_than_us is not None and bounds.newest_us < older_than_us
            large = keep_bytes is not None and total > keep_bytes
            if not (aged or large):
                return ids, bounds.first
            ids.append(fid)
            total -= bounds.nbytes
            last = bounds.last
        return ids, (next_offset if len(ids) == len(fragments) else fragments[len(ids)][1].first)

    def _bounds_of(self, fragment: lance.LanceFragment) -> _Bounds:
        meta = fragment.metadata
        key = meta.files[0].path
        known = self._bounds.get(key)
        if known is None:  # compacted, or stored before this process: read its two columns
            table = fragment.to_table(columns=[OFFSET, TIMESTAMP])
            offsets = pa.compute.min_max(table.column(OFFSET))
            newest = pa.compute.max(table.column(TIMESTAMP).cast(pa.int64()))
            known = _Bounds(
                int(offsets["min"].as_py()),
                int(offsets["max"].as_py()),
                int(newest.as_py()),
                sum(f.file_size_bytes or 0 for f in meta.files),
            )
            self._bounds[key] = known
        return known

    def _stamped(self, batches: Sequence[StoredBatch]) -> pa.Table:
        """The batches as one table with each row's ``_offset`` and ``_timestamp``.

        The fragment writer aligns what the network left unaligned, copying only those chunks.
        """
        columns = [
            pa.chunked_array([b.batch.column(i) for b in batches], type=f.type)
            for i, f in enumerate(self.schema)
        ]
        counts = [b.batch.num_rows for b in batches]
        offsets = np.repeat(np.array([b.offset for b in batches], np.int64), counts)
        times = np.repeat(np.array([b.time_us for b in batches], np.int64), counts)
        return pa.Table.from_arrays(
            [*columns, pa.array(offsets), pa.array(times, _TIME_TYPE)],
            schema=self._schema,
        )

    # -- reading ------------------------------------------------------------------------

    def read(
        self, start: int, end: int, version: int | None = None, pin: Pin | None = None
    ) -> pa.RecordBatchReader:
        """The rows of offsets ``[start, end)`` as of ``version``, in offset order.

        Only the topic's columns are returned. ``pin`` (from :meth:`pin`, taken where the
        version was chosen) is released once the reader is exhausted, closed or collected:
        until then :meth:`release` keeps the version's files. Upkeep may still remove the
        version between its choice and the pin (its cleanup's floor read just before): the
        read then goes on from the newest version, which holds the same rows of a retained
        range, as an executor's read does (:func:`read_offsets`).
        """
        try:
            try:
                ds = self._at(version)
            except (OSError, ValueError) as exc:
                if not lance_commits.not_found(exc):
                    raise
                ds = _holding(self.uri, start, end, self.storage_options)
            stored = _resuming(ds, self.schema, self.uri, start, end, self.storage_options)
        except BaseException:
            if pin is not None:
                pin.release()  # a failed read holds nothing: the cleanup floor moves on
            raise
        if pin is None:
            return pa.RecordBatchReader.from_batches(self.schema, stored)

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                yield from stored
            except (OSError, ValueError) as exc:
                gone = isinstance(exc, OffsetOutOfRangeError) or lance_commits.not_found(exc)
                if self._overheld(pin) and gone:  # its files went once it held them too long
                    raise self._overheld_error(start, end, pin) from exc
                raise
            finally:
                pin.release()

        rows = batches()
        weakref.finalize(rows, pin.release)  # a reader dropped unread
        return pa.RecordBatchReader.from_batches(self.schema, rows)

    def pin(self, version: int) -> Pin:
        """Hold ``version``: :meth:`release` keeps it (and its files) until the pin is released.

        Take it where the version is chosen, under the lock that orders it with the commit
        after which :meth:`release` runs, so no release falls between the choice and the pin.
        """
        with self._pins_lock:
            key, self._next_pin = self._next_pin, self._next_pin + 1
            pin = Pin(self, version, key)
            self._pins[key] = (version, pin.taken)
        return pin

    def _unpin(self, key: int) -> None:
        with self._pins_lock:
            self._pins.pop(key, None)

    def oldest_pinned(self) -> int | None:
        """The oldest version a reader holds, within ``hold`` and ``hold_bytes`` (None: none).

        A pin of a version older than the retention deletions it would keep past
        ``hold_bytes`` holds it no more (its reader learns so if the files went), so a
        stalled reader pins at most that much beyond retention, however fast producers write.
        """
        since = -float("inf") if self.hold is None else time.monotonic() - self.hold
        with self._pins_lock:
            pinned = sorted({v for v, taken in self._pins.values() if taken > since})
            removed = list(self._removed)
        if self.hold_bytes is not None:
            for version in pinned:
                held = sum(nbytes for deleted_at, nbytes in removed if deleted_at > version)
                if held <= self.hold_bytes:
                    break
                self._bytes_floor = max(self._bytes_floor, version + 1)
        return next((v for v in pinned if v >= self._bytes_floor), None)

    def _overheld(self, pin: Pin) -> bool:
        aged = self.hold is not None and time.monotonic() - pin.taken >= self.hold
        return aged or pin.version < self._bytes_floor

    def _overheld_error(self, start: int, end: int, pin: Pin) -> OffsetOutOfRangeError:
        """A read that held its version past ``hold`` and lost its files: told as Kafka's is."""
        earliest = self.recover().earliest
        bound = f"{self.hold:g} s, the server's reader_hold" if self.hold is not None else ""
        if self.hold_bytes is not None:
            bound += f"{'; ' if bound else ''}{self.hold_bytes:,} bytes beyond retention, "
            bound += "its reader_hold_bytes"
        error = OffsetOutOfRangeError(
            f"the read of offsets [{start}, {end}) of {self.uri} held version {pin.version} "
            f"longer than readers may ({bound}) and retention or upkeep removed its files: "
            f"read again from offset {earliest} or later"
        )
        error.earliest = earliest  # type: ignore[attr-defined]
        return error

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

    def release(self, floor: int, stamped: int) -> int:
        """Remove every version below ``floor``, and the files only they hold.

        Called after retention deleted fragments (their files leave the disk now, not when
        versions age out) and after upkeep compacted a topic with retention (the files it
        replaced). ``floor`` is the oldest version still needed (the newest commit's,
        or an older one a reader holds); ``stamped`` is a stamped version (the commit of the
        deletion), which the restart tag moves to first, as a tagged version is never removed.
        Returns the bytes removed.
        """
        with self._committing:  # one at a time, and not beside a compaction or a commit
            if floor <= self._cleaned_below:
                return 0
            ds = self._open()  # its own handle: upkeep calls this too
            assert ds is not None
            self._check_fence(ds, "cleanup")  # a fenced owner removes no version
            ds = self._refence_if_due(ds)
            lance_commits.move_tag(ds, TAG, stamped)
            # and the older fences below it: tagged when an earlier cleanup passed them
            old_fences = {v for v in self._old_fences if v < floor}
            stats = ds.cleanup_old_versions(
                versions=sorted(set(range(self._cleaned_below, floor)) | old_fences),
                error_if_tagged_old_versions=False,
            )
            self._cleaned_below = floor
            self._old_fences -= old_fences
            with self._pins_lock:  # files deleted at or below the floor left the disk
                self._removed = [(v, b) for v, b in self._removed if v > floor]
        return int(stats.bytes_removed)

    def upkeep(
        self, keep_versions: timedelta, room: int | None = None, spare_oldest: bool = False
    ) -> None:
        """Compact small fragments into larger ones and remove old versions.

        Versions older than ``keep_versions`` are removed (the newest stamped commit is tagged
        first, so cleanup keeps what a restart reads). Compaction writes its new files before
        cleanup removes the old: it is skipped when the small fragments' bytes do not fit in
        ``room``. No commit lands while it runs: commits wait for it (they write their
        fragments meanwhile), as a compaction rebased over an append put rows out of offset
        order. It uses handles of its own: the committer's must not be touched from this
        thread. With ``spare_oldest`` (a topic with retention) the oldest half of the fragments
        is left alone: retention deletes from there.
        """
        ds = self._open()
        if ds is None:
            return
        compact = room is None or _small_bytes(ds) <= room
        if not compact:
            log.info("upkeep of %s skips compaction: %s bytes of room left", self.uri, room)
        with self._committing:  # no commit while compaction is in flight (see __init__)
            if self.fence is not None and (latest := self._open()) is not None:
                self._check_fence(latest, "upkeep")
                self._refence_if_due(latest)
            before = self._open()
            lance_commits.upkeep(
                self.uri,
                compact=compact,
                exclude=_oldest_half if spare_oldest else None,
                keep={TAG: self.recover().version},
                older_than=keep_versions,
                floor=self.oldest_pinned(),
                storage_options=self.storage_options,
                # under ``_committing``, on the very versions it compacts and cleans
                check=None if self.fence is None else lambda d: self._check_fence(d, "upkeep"),
            )
            if before is not None:
                self._count_replaced(before)

    def _count_replaced(self, before: lance.LanceDataset) -> None:
        """Count the files compaction replaced as kept by the pins of older versions.

        A reader's pin keeps every version from its own up, so also the files a compaction
        replaced: ``hold_bytes`` counts them with retention's deletions (uncounted, a
        stalled reader kept about twice its bound).
        """
        after = self._open()
        if after is None or after.version == before.version:
            return
        live = {f.path for fragment in after.get_fragments() for f in fragment.metadata.files}
        replaced = sum(
            f.file_size_bytes or 0
            for fragment in before.get_fragments()
            for f in fragment.metadata.files
            if f.path not in live
        )
        if replaced:
            with self._pins_lock:  # held by pins below the compaction's version
                self._removed.append((int(before.version) + 1, replaced))

    def disk_bytes(self) -> int:
        """Bytes the dataset's files take now.

        On a local disk, every file; on an object store, the newest version's data files
        (see :func:`dataset_bytes`).
        """
        if lance_commits.is_local(self.uri):
            return directory_bytes(Path(self.uri.removeprefix("file://")))
        ds = self._open()
        return 0 if ds is None else dataset_bytes(ds)


#: Rows per batch a read of stored history yields (Lance's default is 8,192): fewer, larger
#: batches for whoever takes them next (Flight messages, a Spark Python worker's Arrow stream).
SCAN_BATCH_ROWS = 65_536


def _scan(ds: lance.LanceDataset, schema: pa.Schema, start: int, end: int) -> pa.RecordBatchReader:
    """The topic columns of offsets ``[start, end)`` of ``ds``, in offset order."""
    scanner = ds.scanner(
        columns=schema.names,
        filter=f"{OFFSET} >= {int(start)} AND {OFFSET} < {int(end)}",
        scan_in_order=True,
        batch_size=SCAN_BATCH_ROWS,
    )
    reader = scanner.to_reader()
    return reader if reader.schema.equals(schema) else reader.cast(schema)


def stamp_of(ds: lance.LanceDataset) -> Recovered:
    """What the newest stamped commit of ``ds`` (as of its version) says is stored.

    A compaction's commit carries no stamp: the walk passes it; if cleanup removed the
    stamped version, the tag that upkeep and cleanup move to it is read instead.
    """
    found = lance_commits.newest_stamp(ds, lambda props: NEXT_KEY in props)
    if found is None:  # cleaned up past the newest stamp: it is tagged
        tagged = lance_commits.read_tag(ds, TAG)
        props = None if tagged is None else lance_commits.props_at(ds, tagged)
        if tagged is None or props is None or NEXT_KEY not in props:
            return Recovered(0, {}, ds.version)
        found = tagged, props
    return _recovered(found[1], found[0])


def read_offsets(
    uri: str | Path,
    start: int,
    end: int,
    storage_options: dict[str, str] | None = None,
) -> pa.RecordBatchReader:
    """Offsets ``[start, end)`` of the topic stored at ``uri``, read from its dataset directly.

    For a reader that can open the dataset (an executor on the server's machine, or with the
    same object store): no server in the way. The rows are those a read through the server
    gives, in the same order: the newest version is opened, and its stamp must hold the
    whole range, or :class:`~pushtable.OffsetOutOfRangeError` says which offsets can be read
    (``earliest`` as retention left it, ``committed``).

    Such a reader holds no pin on the server (it is another process): when upkeep's
    compaction or a retention deletion removes the files of the version it opened before it
    read them, it opens the newest version and goes on from the first row it had not yielded
    (a stored offset's rows are the same in every version that holds it). Only when
    retention deleted the rest of the range meanwhile does it raise ``OffsetOutOfRangeError``.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> uri = tempfile.mkdtemp() + "/t.lance"
        >>> store = LogStore(uri, pa.schema([("v", pa.int64())]))
        >>> batch = StoredBatch(0, 0, pa.record_batch({"v": [1, 2]}))
        >>> _ = store.append([batch], Stamp(1, {}, {}, 0))
        >>> read_offsets(uri, 0, 1).read_all().to_pydict()
        {'v': [1, 2]}
    """
    uri = str(uri)
    ds = _holding(uri, start, end, storage_options)
    schema = describe(ds)[0]
    return pa.RecordBatchReader.from_batches(
        schema, _resuming(ds, schema, uri, start, end, storage_options)
    )


#: How many times an executor's read opens a newer version after its files were removed.
READ_REOPENS = 5


def _holding(
    uri: str, start: int, end: int, storage_options: dict[str, str] | None
) -> lance.LanceDataset:
    """The newest version of the dataset at ``uri``, which must hold offsets ``[start, end)``."""
    ds = open_dataset(uri, storage_options)
    stamp = stamp_of(ds) if ds is not None else Recovered(0, {}, 0)
    if ds is None or not stamp.earliest <= start <= end <= stamp.next_offset:
        error = OffsetOutOfRangeError(
            f"offsets [{start}, {end}) cannot be read from the topic at {uri}: offsets "
            f"{stamp.earliest}..{stamp.next_offset} (committed) can be"
            + (f"; retention has deleted those below {stamp.earliest}" if stamp.earliest else "")
        )
        error.earliest = stamp.earliest  # type: ignore[attr-defined]
        raise error
    return ds


def _resuming(
    ds: lance.LanceDataset,
    schema: pa.Schema,
    uri: str,
    start: int,
    end: int,
    storage_options: dict[str, str] | None,
) -> Iterator[pa.RecordBatch]:
    """The rows of ``[start, end)``, from ``ds`` and then, if its files go, from newer versions.

    ``at`` is the offset of the last row yielded and ``done`` how many of its rows were: a
    newer version is read from ``at``, its first ``done`` rows skipped.
    """
    at, done = start, 0
    reopens = 0
    with_offset = pa.schema([*schema, pa.field(OFFSET, pa.int64())])
    while True:
        skip = done  # rows of ``at`` a read before this one yielded
        try:
            for batch in _scan(ds, with_offset, at, end):
                if skip:
                    cut = min(skip, batch.num_rows)
                    batch, skip = batch.slice(cut), skip - cut
                    if batch.num_rows == 0:
                        continue
                offsets = batch.column(len(schema)).to_numpy()
                last = int(offsets[-1])
                tail = int(len(offsets) - np.searchsorted(offsets, last, side="left"))
                if last == at:
                    done += tail
                else:
                    at, done = last, tail
                yield pa.RecordBatch.from_arrays(batch.columns[: len(schema)], schema=schema)
            return
        except (OSError, ValueError) as exc:
            if not lance_commits.not_found(exc) or reopens == READ_REOPENS:
                raise
            reopens += 1
            log.info(
                "%s: files of version %d went mid-read; reading on from the newest", uri, ds.version
            )
            ds = _holding(uri, at, end, storage_options)


def _oldest_half(ds: lance.LanceDataset) -> list[int]:
    """The ids of the oldest half of ``ds``'s fragments (appended in offset order)."""
    fragments = ds.get_fragments()
    return [f.fragment_id for f in fragments[: (len(fragments) + 1) // 2]]


def _small_bytes(ds: lance.LanceDataset) -> int:
    """Bytes of the fragments compaction would rewrite (those under its default target)."""
    target = 1024 * 1024
    return sum(
        f.file_size_bytes or 0
        for fragment in ds.get_fragments()
        if fragment.metadata.physical_rows < target
        for f in fragment.metadata.files
    )


def describe(
    ds_or_uri: lance.LanceDataset | str | Path, storage_options: dict[str, str] | None = None
) -> tuple[pa.Schema, dict[str, Any]]:
    """A topic dataset's schema (its own columns) and the options it was created with."""
    ds = (
        ds_or_uri
        if isinstance(ds_or_uri, lance.LanceDataset)
        else lance.dataset(str(ds_or_uri), storage_options=storage_options)
    )
    schema = ds.schema
    config = json.loads((schema.metadata or {}).get(CONFIG_KEY.encode(), b"{}"))
    names = [n for n in schema.names if n not in (OFFSET, TIMESTAMP)]
    return pa.schema([schema.field(n) for n in names]), config


def dataset_bytes(ds: lance.LanceDataset) -> int:
    """Bytes of the data files ``ds``'s version references (no listing of the store)."""
    return sum(f.file_size_bytes or 0 for frag in ds.get_fragments() for f in frag.metadata.files)


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # removed by a cleanup meanwhile
                total += os.stat(os.path.join(root, f)).st_size
    return total


def _stamp(found: Recovered) -> Stamp:
    """The stamp that says what ``found`` says is stored."""
    return found.stamp()


def _recovered(props: dict[str, str], version: int) -> Recovered:
    producers = json.loads(props.get(PRODUCERS_KEY, "{}"))
    consumers = json.loads(props.get(CONSUMERS_KEY, "{}"))
    prints = json.loads(props.get(PRINTS_KEY, "{}"))
    units = json.loads(props.get(UNITS_KEY, "{}"))
    return Recovered(
        int(props[NEXT_KEY]),
        {str(k): int(v) for k, v in producers.items()},
        version,
        {str(k): int(v) for k, v in consumers.items()},
        int(props.get(EARLIEST_KEY, 0)),
        {str(k): [int(x) for x in v] for k, v in prints.items()},
        {str(k): int(v) for k, v in units.items()},
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
