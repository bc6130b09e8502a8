"""A durable topic's log: offsets, group commits to Lance, and reads.

A batch appended here gets the next offset and goes to the topic's live subscribers at
once (their queries see it in milliseconds); it is *acknowledged* only once a Lance commit
holds it. A committer thread gathers everything appended within ``commit_interval`` (or
sooner, when a producer waits: ``commit_soon``) into one transaction, started early by what
recent commits took, so the oldest batch is stored about one interval after it arrived. A
failed commit keeps its batches pending (they are retried at the next interval; nothing is
acknowledged and new appends are refused until a commit succeeds), so a producer that sends
them again after the error is deduplicated, not appended twice (its producer id's sequences,
fingerprints and Spark units: :mod:`pushtable.durable.producers`).

Reads start at any offset, with no gap and no duplicate: what is committed and no longer in
memory comes from Lance, the committed tail kept in memory (``retain``/``retain_bytes``) and
the pending batches follow, then the live stream. All of it is taken between two appends, so
nothing is missed or seen twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

from pushtable.durable.fence import Fence
from pushtable.durable.producers import Mark, Producers, epoch_of, epoch_sequence, fingerprint
from pushtable.durable.store import LogStore, Stamp, StoredBatch, Written, micros, now_us
from pushtable.errors import (
    CommitFailedError,
    DataDirInUseError,
    OffsetOutOfRangeError,
    PushTableError,
    ResourceLimitError,
    SinkClosedError,
    WriteTimeoutError,
)
from pushtable.producer import batch_bytes

__all__ = ["DurableLog", "Start", "epoch_of", "epoch_sequence"]

log = logging.getLogger(__name__)

MiB = 1 << 20

#: where a read starts: "earliest", "latest" (alias "now"), an offset, or an arrival time
Start = str | int | datetime

#: called after each commit attempt with the committed offset and the failure, if any (a
#: CommitFailedError; DataDirInUseError once a newer owner fenced the topic)
Listener = Callable[[int, "PushTableError | None"], None]


def check_retention(retention: timedelta | None, retention_bytes: int | None) -> None:
    """Refuse a retention that cannot be meant (a non-positive age or size)."""
    if retention is not None and (
        not isinstance(retention, timedelta) or retention <= timedelta(0)
    ):
        raise ValueError(f"retention must be a positive timedelta or None, got {retention!r}")
    if retention_bytes is not None and (
        isinstance(retention_bytes, bool)
        or not isinstance(retention_bytes, int)
        or retention_bytes <= 0
    ):
        raise ValueError(f"retention_bytes must be an integer > 0 or None, got {retention_bytes!r}")


def _micros(delta: timedelta) -> int:
    return delta // timedelta(microseconds=1)


@dataclass(frozen=True)
class _Entry:
    offset: int
    time_us: int
    batch: pa.RecordBatch
    nbytes: int
    producer: str | None
    sequence: int | None
    #: False for a batch of a unit still being appended (a Spark epoch): no commit takes
    #: it before the unit's last batch, so a unit is stored by one commit or none.
    closes: bool = True
    #: an idempotent producer's batch: its CRC-32 (stored with the commit, see
    #: ``STORED_PRINTS``)
    fingerprint: int | None = None
    #: a unit's last batch: the rows of the whole unit (stored with the commit)
    unit_rows: int | None = None


#: the longest consumer name :meth:`DurableLog.consumed` takes, and how many consumers a topic
#: keeps positions for (each commit stores them all)
MAX_CONSUMER_NAME_BYTES = 256
MAX_CONSUMERS = 1024


def _whole_units(entries: list[_Entry]) -> list[_Entry]:
    """The batches of ``entries`` a commit may take: up to the last that closes its unit."""
    end = len(entries)
    while end and not entries[end - 1].closes:
        end -= 1
    return entries[:end]


#: how often a closing committer looks again while a unit is being appended
POLL_UNIT_S = 0.1

#: groups whose fragments are written at once while the group before them commits
ENCODERS = 2


@dataclass
class _Group:
    """One group commit in the pipeline.

    Its batches, the producer sequences its stamp records, and the write of its fragments.
    """

    entries: list[_Entry]
    stored: dict[str, int]
    written: Future[Written]
    started: float


class DurableLog:
    """The log behind ``Topic(..., persist=...)`` and a server's durable topics."""

    def __init__(
        self,
        name: str,
        schema: pa.Schema,
        uri: str | Path,
        live: Callable[[pa.RecordBatch, float | None], None],
        *,
        config: dict[str, Any] | None = None,
        commit_interval: float = 0.1,
        retain: int | None = None,
        retain_bytes: int | None = None,
        max_pending_bytes: int = 256 * MiB,
        upkeep_interval: float | None = 60.0,
        keep_versions: timedelta = timedelta(minutes=10),
        reserve: Callable[[int], None] | None = None,
        storage_options: dict[str, str] | None = None,
        retention: timedelta | None = None,
        retention_bytes: int | None = None,
        fsync: bool = True,
        room: Callable[[], int | None] | None = None,
        fence: Fence | None = None,
    ) -> None:
        if commit_interval <= 0:
            raise ValueError(f"commit_interval must be > 0 seconds, got {commit_interval!r}")
        check_retention(retention, retention_bytes)
        self.name = name
        self.schema = schema
        self.store = LogStore(
            uri, schema, config, storage_options=storage_options, sync=fsync, fence=fence
        )
        recovered = self.store.recover()
        #: history older than this is deleted, whole fragments at a time (None: kept)
        self.retention = retention
        #: history beyond this many bytes on disk is deleted, oldest first (None: kept)
        self.retention_bytes = retention_bytes
        #: bytes upkeep may add to the data dir now (None: no limit)
        self.room = room
        self._earliest = recovered.earliest
        self._expired_at = 0.0  # monotonic time of the last retention check
        self._live = live
        self.commit_interval = float(commit_interval)
        self.retain = retain
        self.retain_bytes = retain_bytes
        self.max_pending_bytes = max_pending_bytes
        #: called with each batch's size before it is appended; raises to refuse it (a
        #: server's data dir budget)
        self.reserve = reserve
        self._order = threading.Lock()  # appends in offset order; reads start between two
        self._cond = threading.Condition()  # everything below
        self._next = recovered.next_offset
        self._committed = recovered.next_offset
        self._version = recovered.version
        #: the idempotent producers' sequences, fingerprints and units (under ``_cond``)
        self._producers = Producers(name, recovered)
        self._consumers = dict(recovered.consumers)  # consumer -> offset it has read up to
        self._pending: deque[_Entry] = deque()
        self._pending_bytes = 0
        self._tail: deque[_Entry] = deque()  # committed batches kept in memory
        self._tail_bytes = 0
        self._failure: CommitFailedError | None = None
        #: why the log was abandoned, when its writes are refused for a reason (see abandon)
        self._gone: PushTableError | None = None
        self._attempts = 0  # commit attempts finished, failed or not
        #: a commit raised and it is not known whether it landed: read before the next one
        self._unsure = False
        #: the files of that commit, removed once it is known it did not land
        self._unsure_written: Written | None = None
        self._urgent = False
        self._took: deque[float] = deque(maxlen=8)  # seconds the latest commits took
        self._closing = False
        self._closed = False
        self._abandoned = False  # stopped without committing what is pending (abandon)
        self._listeners: list[Listener] = []
        self.commits = 0
        self.commit_failures = 0
        #: retention's deletions so far
        self.expirations = 0
        self._committer = threading.Thread(
            target=self._commit_loop, name=f"pushtable-commit-{name}", daemon=True
        )
        self._committer.start()
        self._upkeep_stop = threading.Event()
        self._keep_versions = keep_versions
        self._upkeep: threading.Thread | None = None
        if upkeep_interval is not None:
            self._upkeep = threading.Thread(
                target=self._upkeep_loop,
                args=(upkeep_interval,),
                name=f"pushtable-upkeep-{name}",
                daemon=True,
            )
            self._upkeep.start()

    # -- appending ----------------------------------------------------------------------

    def append(
        self,
        batch: pa.RecordBatch,
        timeout: float | None = None,
        *,
        producer: str | None = None,
        sequence: int | None = None,
        gaps: bool = False,
        nbytes: int | None = None,
    ) -> int:
        """Give ``batch`` the next offset and send it live.

        Returns the offset whose commit acknowledges it (-1: already stored). A ``(producer,
        sequence)`` seen before is not appended again: its acknowledgement is that of
        everything appended so far. A producer's sequences follow each other, unless ``gaps``:
        then any higher one is taken (a Spark query's batches are numbered by epoch, see
        :func:`epoch_sequence`). ``nbytes`` is what the batch counts against
        ``max_pending_bytes``: by default the bytes it references (a slice its own rows,
        :func:`~pushtable.producer.batch_bytes`); a server passes the bytes it received.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._order.acquire(timeout=-1 if timeout is None else timeout):
            raise WriteTimeoutError(f"write to durable topic '{self.name}' timed out")
        try:
            return self._append(batch, deadline, producer, sequence, gaps, True, nbytes)
        finally:
            self._order.release()

    def append_unit(
        self,
        batches: Sequence[pa.RecordBatch],
        sequences: Sequence[int],
        producer: str,
        poll: float,
        give_up: Callable[[], bool],
    ) -> int:
        """Append ``batches`` as one unit (a Spark epoch): one commit stores all or none.

        Nothing else is appended between them, and no commit takes a part of the unit: a
        replay after a crash finds the whole unit stored or none of it, however the re-run
        batch is split. ``sequences`` number the batches (gaps allowed); those stored already
        are skipped. A write that finds no room waits, ``poll`` seconds at a time, until
        ``give_up()``; then, or on any error, the batches appended so far are taken back
        (never stored; live readers may have seen them) and the error is raised. Returns the
        offset whose commit acknowledges the unit (-1: already stored).
        """
        with self._order:
            with self._cond:
                before = (self._next, self._producers.mark(producer))
                self._producers.check_unit(producer, batches, sequences)
            ticket = -1
            try:
                for i, (batch, sequence) in enumerate(zip(batches, sequences, strict=True)):
                    last = i == len(batches) - 1
                    while True:
                        try:
                            deadline = time.monotonic() + poll
                            rows = sum(b.num_rows for b in batches) if last else None
                            offset = self._append(
                                batch, deadline, producer, sequence, True, last, None, rows
                            )
                            break
                        except WriteTimeoutError:
                            if give_up():
                                raise
                    ticket = max(ticket, offset)
            except BaseException:
                self._take_back(producer, *before)
                raise
            return ticket

    def check_unit(
        self, producer: str, batches: Sequence[pa.RecordBatch], sequences: Sequence[int]
    ) -> None:
        """Raise :class:`~pushtable.SequenceError` if this replay of a unit is not what is stored.

        (A Spark epoch published again: see :meth:`Producers.check_unit`.)
        """
        with self._cond:
            self._producers.check_unit(producer, batches, sequences)

    def _take_back(self, producer: str, next_offset: int, mark: Mark) -> None:
        """Remove the batches appended from ``next_offset`` on (an unfinished unit's)."""
        with self._cond:
            while self._pending and self._pending[-1].offset >= next_offset:
                self._pending_bytes -= self._pending.pop().nbytes
            self._next = next_offset
            self._producers.take_back(producer, mark)
            self._cond.notify_all()

    def _append(
        self,
        batch: pa.RecordBatch,
        deadline: float | None,
        producer: str | None,
        sequence: int | None,
        gaps: bool,
        closes: bool,
        nbytes: int | None = None,
        unit_rows: int | None = None,
    ) -> int:
        """:meth:`append`'s work; the caller holds ``_order``."""
        # An idempotent producer's batches are told apart from a reuse of their numbers.
        crc = fingerprint(batch) if producer is not None and not gaps else None
        with self._cond:
            if self._closing:
                raise self._refused()
            if producer is not None:
                assert sequence is not None
                if self._producers.admit(producer, sequence, crc, gaps):  # stored already
                    return self._next - 1 if self._pending else -1
            if self._failure is not None:  # a resend above waits for the next attempt
                raise self._failure
            nbytes = batch_bytes(batch) if nbytes is None else nbytes
            # Room for it, unless all that waits is this unit's own (a unit's batches are the
            # tail of what waits, and it commits whole: waiting for room would wait forever).
            while self._ready() and self._pending_bytes + nbytes > self.max_pending_bytes:
                self._urgent = True
                self._cond.notify_all()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WriteTimeoutError(
                        f"write to durable topic '{self.name}' timed out with "
                        f"{self._pending_bytes:,} bytes waiting for their commit"
                    )
                self._cond.wait(left)
                if self._failure is not None:
                    raise self._failure
        if self.reserve is not None:
            self.reserve(nbytes)  # ResourceLimitError over the data dir's limit
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._live(batch, left)  # checks the batch; raises before anything is appended
        with self._cond:
            offset = self._next
            was_ready = self._ready()
            entry = _Entry(
                offset, now_us(), batch, nbytes, producer, sequence, closes, crc, unit_rows
            )
            self._pending.append(entry)
            self._pending_bytes += nbytes
            self._next += 1
            if producer is not None:
                assert sequence is not None
                self._producers.accept(producer, sequence, crc, unit_rows)
            if closes and not was_ready:
                self._cond.notify_all()  # the committer starts its interval
            return offset

    def _ready(self) -> bool:
        """Whether a commit can take something (holding ``_cond``).

        Something is, once a waiting batch closes its unit (an unfinished unit's batches are
        the tail of what waits: its appender holds ``_order``; the walk passes only them).
        """
        return any(e.closes for e in reversed(self._pending))

    @property
    def pending_bytes(self) -> int:
        """The bytes of batches accepted and not committed yet.

        Read without the lock: a disk budget asks while it holds its own.
        """
        return self._pending_bytes

    def last_sequence(self, producer: str) -> int:
        """The last sequence number of ``producer`` appended (-1: none)."""
        with self._cond:
            return self._producers.last(producer)

    def last_stored_sequence(self, producer: str) -> int:
        """The last sequence number of ``producer`` that a commit holds (-1: none).

        It survives a restart, stamped in the same commit as the rows.
        """
        with self._cond:
            return self._producers.last_stored(producer)

    # -- acknowledgements ---------------------------------------------------------------

    @property
    def committed(self) -> int:
        """The offset after the last committed batch: every offset below it is stored."""
        with self._cond:
            return self._committed

    def commit_soon(self) -> None:
        """Commit what is pending now, not at the end of the interval (a producer waits)."""
        with self._cond:
            if self._pending:
                self._urgent = True
                self._cond.notify_all()

    def wait_committed(self, offset: int, timeout: float | None = None) -> bool:
        """Wait until ``offset`` is stored (False: ``timeout`` passed first).

        Raises the :class:`CommitFailedError` of a failed commit that held it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if offset >= self._committed and self._pending:
                self._urgent = True
                self._cond.notify_all()
            # A failure before this call is news to nobody here: the next attempt decides.
            seen = self._attempts
            while offset >= self._committed:
                if self._failure is not None and self._attempts > seen:
                    raise self._failure
                if self._gone is not None:
                    raise self._refused()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything appended so far is stored.

        A unit still being appended is not waited for: until it is whole it may be taken back.
        """
        with self._cond:
            whole = _whole_units(list(self._pending))
            target = whole[-1].offset if whole else self._committed - 1
        if target >= 0 and not self.wait_committed(target, timeout):
            raise WriteTimeoutError(
                f"flush of durable topic '{self.name}' timed out before offset {target} was stored"
            )

    def listen(self, listener: Listener) -> None:
        """Call ``listener(committed, failure)`` after each commit attempt.

        It is called on the committer's thread: it must not block.
        """
        with self._cond:
            self._listeners.append(listener)

    def unlisten(self, listener: Listener) -> None:
        """Stop calling ``listener`` (nothing happens if it was not listening)."""
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # -- the committer ------------------------------------------------------------------

    def _commit_loop(self) -> None:
        """Group commits, pipelined.

        While one group commits here, the fragments of the next :data:`ENCODERS` groups are
        written on threads of their own (Lance's encoder releases the GIL): groups are taken
        once due (their oldest batch waited ``commit_interval``, or a producer waits), so a
        saturated topic keeps every stage busy, and a slower one commits once per interval
        as before. Commits land in offset order.
        """
        encoder = ThreadPoolExecutor(ENCODERS, thread_name_prefix=f"pushtable-encode-{self.name}")
        try:
            self._commit_groups(encoder)
        finally:
            encoder.shutdown(wait=True)

    def _commit_groups(self, encoder: ThreadPoolExecutor) -> None:
        ahead: deque[_Group] = deque()  # gathered and being written, not yet committed
        if self.retention is not None or self.retention_bytes is not None:
            # Opened over history retention has not trimmed yet (a kill came between a commit
            # and its deletion, or the bound was lowered): catch up now, not at the next
            # commit, which may never come.
            with self._cond:
                stamp = self._stamp()
            self._expire(stamp)
            # A kill between a deletion and its cleanup left the deleted fragments' files on
            # disk: they leave now, not at the first upkeep (never, without one).
            self._release()
        while True:
            if self._abandoned:  # nothing pending is committed any more
                self._discard(ahead)
                return
            if not ahead:
                with self._cond:
                    while not self._ready() and not self._closing:
                        if not self._cond.wait(self._retention_wait()):
                            break
                    if self._abandoned or (not self._pending and self._closing):
                        return  # abandoned, or closing with nothing left
                    if not self._ready() and self._closing:
                        # A unit is being appended: it closes or is taken back (both notify).
                        self._cond.wait(POLL_UNIT_S)
                        continue
                    idle = None if self._ready() else self._stamp()
                    if idle is None:
                        ahead.append(self._group(encoder, self._gather(), self._producers.stored()))
                if idle is not None:  # nothing to commit: retention still deletes what ages out
                    self._expire(idle)
                    continue
            current = ahead.popleft()
            self._take_due(encoder, current, ahead)
            written: Written | None = None
            try:
                written = current.written.result()
                if self._unsure and self._settle_landed(self._unsure_written):
                    # What landed was an earlier gathering of these offsets: this one's files
                    # and those ahead are gathered again, after it.
                    self._unsure_written = None  # it landed: its files are stored
                    self.store.discard(written)
                    self._discard(ahead)
                    continue
                if not self._unsure and self._unsure_written is not None:
                    # settled: it did not land, and its files were held while unsure
                    self.store.discard(self._unsure_written)
                    self._unsure_written = None
                if self._unsure:
                    # Still cannot tell whether an earlier commit of these offsets landed:
                    # committing them now could store them twice. This gathering never
                    # landed: its files go; the next attempt asks again first.
                    self.store.discard(written)
                    written = None
                    raise OSError(
                        "cannot tell whether the previous commit landed (its stamp could not "
                        "be read); asked again before the next attempt"
                    )
                with self._cond:  # as of now: retention or a consumer may have moved meanwhile
                    consumers, earliest = dict(self._consumers), self._earliest
                    prints, units = self._producers.stamped_after(current.entries)
                last = current.entries[-1].offset
                stamp = Stamp(last + 1, current.stored, consumers, earliest, prints, units)
                version = self.store.commit_written(written, stamp)
            except DataDirInUseError as exc:  # fenced by a newer owner: it did not land
                self._discard(ahead)
                if written is not None:
                    self.store.discard(written)
                self._fenced(exc)
                return
            except BaseException as exc:  # I/O, a full disk, a read-only dir, a Lance panic
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                self._discard(ahead)  # written after a group not stored: gathered again, from it
                # The commit may have landed before it raised (a late sync error, an object
                # store's lost reply): then its offsets are stored, and appending them again
                # would store them twice. Read the newest stamp before anything is retried.
                # (Unsure already, it stays so: a failure before this commit proves nothing.)
                self._unsure = self._unsure or written is not None
                try:
                    if written is not None and self._settle_landed(written):
                        continue
                except DataDirInUseError as fenced:  # a newer owner's stamp, not this commit's
                    self._fenced(fenced)
                    return
                if written is not None and not self._unsure:
                    self.store.discard(written)  # known not to have landed
                elif written is not None:  # held until settled (at most one: see above)
                    self._unsure_written = written
                self._failed(current.entries, exc)
                with self._cond:  # retry after an interval (sooner if a producer waits)
                    self._cond.wait_for(lambda: self._closed or self._urgent, self.commit_interval)
                    if self._closed:
                        return
                continue
            self._unsure = False
            if self._abandoned:  # abandoned while it committed: it acknowledges nothing
                self._discard(ahead)
                return
            self._took.append(time.monotonic() - current.started)
            self._succeeded(current.entries, stamp, version)
            # A bound in bytes is held after every commit (the history stays within one
            # commit of it); a bound in age at its own pace.
            due = time.monotonic() - self._expired_at >= self._retention_check
            if self.retention_bytes is not None or due:
                with self._cond:
                    stamp = self._stamp()
                self._expire(stamp)

    def _settle_landed(self, written: Written | None) -> bool:
        """After a commit raised: whether it landed all the same, settled as a success if so.

        The newest stamp is read afresh. When it stores offsets past those committed, that
        commit is this group's (``written``, when it is the group that raised; the committer
        is the one writer of stamped commits): it is synced again and acknowledged, and
        nothing is appended twice. When the stamp cannot be read, the log stays unsure and
        asks again before its next commit.
        """
        with self._cond:
            committed = self._committed
        try:
            found = self.store.landed(committed, written)
        except DataDirInUseError:
            raise
        except Exception as exc:  # noqa: BLE001 - unsure still: asked again before the retry
            log.warning(
                "durable topic '%s': cannot tell whether offsets from %d were stored: %s",
                self.name,
                committed,
                exc,
            )
            return False
        self._unsure = False
        if found is None:
            return False
        with self._cond:
            entries = [e for e in self._pending if e.offset < found.next_offset]
        if not entries or entries[-1].offset != found.next_offset - 1:
            if self.store.fence is not None:  # another owner's commits: this one is fenced
                raise DataDirInUseError(
                    f"durable topic '{self.name}': the newest stamp stores offsets to "
                    f"{found.next_offset}, which this server did not write: another server "
                    "took the data dir"
                )
            raise AssertionError(
                f"durable topic '{self.name}': the newest stamp stores offsets to "
                f"{found.next_offset}, beyond what was written ({committed}..)"
            )
        log.warning(
            "durable topic '%s': offsets %d..%d were stored by a commit that raised after it "
            "landed; acknowledged, not stored again",
            self.name,
            entries[0].offset,
            entries[-1].offset,
        )
        self._succeeded(entries, found.stamp(), found.version)
        return True

    def _discard(self, ahead: deque[_Group]) -> None:
        """Give up the groups ``ahead`` (they are gathered again): their files are deleted."""
        for group in ahead:
            try:
                written = group.written.result()
            except Exception:  # noqa: BLE001 - nothing written, nothing to delete
                continue
            self.store.discard(written)
        ahead.clear()

    def _take_due(self, encoder: ThreadPoolExecutor, current: _Group, ahead: deque[_Group]) -> None:
        """Hand the encoder what is due beyond the groups in flight, while ``current`` commits."""
        with self._cond:
            if len(ahead) >= ENCODERS:
                return
            flight = len(current.entries) + sum(len(g.entries) for g in ahead)
            more = _whole_units(list(self._pending)[flight:])
            now = time.monotonic()
            if more and (self._urgent or self._closing or self._due(more[0]) <= now):
                self._urgent = False
                base = ahead[-1].stored if ahead else current.stored
                ahead.append(self._group(encoder, more, base))

    def _group(
        self, encoder: ThreadPoolExecutor, entries: list[_Entry], stored: dict[str, int]
    ) -> _Group:
        """``entries`` handed to the encoder; ``stored`` is what the commit before says."""
        stored = self._producers.stored_after(stored, entries)
        batches = [StoredBatch(e.offset, e.time_us, e.batch) for e in entries]
        return _Group(entries, stored, encoder.submit(self.store.write, batches), time.monotonic())

    # -- retention ----------------------------------------------------------------------

    @property
    def _retention_check(self) -> float:
        """Seconds between two checks of a retention by age: a tenth of the age, 0.1 s to 5 s.

        (A bound in bytes is checked after every commit: only a commit adds bytes.)
        """
        if self.retention is None:
            return 5.0
        return min(5.0, max(0.1, self.retention.total_seconds() / 10))

    def _retention_wait(self) -> float | None:
        if self.retention is None:  # idle, only age moves on
            return None
        return max(0.0, self._expired_at + self._retention_check - time.monotonic())

    def _stamp(self) -> Stamp:
        """What the newest commit says is stored (the caller holds ``_cond``)."""
        return self._producers.stamp(self._committed, dict(self._consumers), self._earliest)

    def _expire(self, stamp: Stamp) -> None:
        """Delete the history retention no longer keeps; a failure never fails the topic.

        Runs on the committer's thread: it is the one writer of stamped commits. A failure is
        logged and retried at the next check.
        """
        self._expired_at = time.monotonic()
        if self.retention is None and self.retention_bytes is None:
            return
        cutoff = None if self.retention is None else now_us() - _micros(self.retention)
        try:
            done = self.store.expire(stamp, cutoff, self.retention_bytes)
        except DataDirInUseError as exc:
            self._fenced(exc)
            return
        except Exception as exc:  # noqa: BLE001 (the next check tries again)
            log.warning("retention of durable topic '%s' failed: %s", self.name, exc)
            # The deletion may have landed before it raised (a late sync, a lost reply):
            # then ``earliest`` moved, and a read below it must be told so, not get no rows.
            try:
                done = self.store.expired_after_all(stamp.next_offset)
            except DataDirInUseError as fenced:
                self._fenced(fenced)
                return
            except Exception:  # noqa: BLE001 (unreadable: the next check reads again)
                return
        if done is None:
            return
        earliest, version = done
        with self._cond:
            self._earliest = max(self._earliest, earliest)
            if version > self._version:
                self._version = version
            while self._tail and self._tail[0].offset < self._earliest:
                self._tail_bytes -= self._tail.popleft().nbytes
            self.expirations += 1
        self._release()

    def _release(self) -> None:
        """Remove the versions below the newest stamped commit that no reader holds.

        Their files (fragments retention deleted, those a compaction replaced) leave the disk
        now; a failure is logged, and upkeep's cleanup removes them later.
        """
        with self._cond:  # readers pin their version under this lock: none takes an older one
            pinned = self.store.oldest_pinned()
            stamped = self._version
        floor = stamped if pinned is None else min(pinned, stamped)
        try:
            self.store.release(floor, stamped)
        except DataDirInUseError as exc:  # another owner: this one stops at once
            self._fenced(exc)
        except Exception as exc:  # noqa: BLE001
            log.warning("cleanup of durable topic '%s' failed: %s", self.name, exc)

    def _gather(self) -> list[_Entry]:
        """Wait for the commit's moment, then take what it stores (holding ``_cond``).

        The oldest waiting batch is to be stored one interval after it arrived: the commit
        starts early by what recent commits took (their slowest of 8).
        """
        due = self._due(self._pending[0])
        while not (self._urgent or self._closing) and time.monotonic() < due:
            self._cond.wait(max(0.0, due - time.monotonic()))
        self._urgent = False
        return _whole_units(list(self._pending))

    def _due(self, oldest: _Entry) -> float:
        """When a group whose oldest batch is ``oldest`` is to start (monotonic seconds)."""
        lead = min(max(self._took, default=0.0), self.commit_interval)
        waited = time.time() - oldest.time_us / 1e6
        return time.monotonic() + max(0.0, self.commit_interval - lead - waited)

    def _failed(self, entries: list[_Entry], exc: BaseException) -> None:
        error = CommitFailedError(
            f"durable topic '{self.name}': storing offsets {entries[0].offset}.."
            f"{entries[-1].offset} in {self.store.uri} failed ({type(exc).__name__}: {exc}); "
            "they are not acknowledged yet: the topic keeps them and retries the commit, and "
            "they are stored once it succeeds (lost only if the topic closes first), so do not "
            "write them again"
        )
        error.__cause__ = exc
        log.warning("%s", error)
        with self._cond:
            self._failure = error
            self._attempts += 1
            self.commit_failures += 1
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener(self._committed, error)

    def _fenced(self, exc: DataDirInUseError) -> None:
        """A newer owner fenced the topic, or this one lost the data dir: it stops at once.

        Nothing pending is committed or acknowledged; producers waiting for a commit and
        every later write hear ``exc``, and the owner is told (its other topics stop too).
        """
        log.error("durable topic '%s': %s", self.name, exc)
        self.abandon(exc)  # its listeners hear it
        fence = self.store.fence
        if fence is not None and fence.lost is not None:
            fence.lost(str(exc))

    def _succeeded(self, entries: list[_Entry], stamp: Stamp, version: int) -> None:
        with self._cond:
            for _ in entries:
                entry = self._pending.popleft()
                self._pending_bytes -= entry.nbytes
                self._keep(entry)
            self._committed = entries[-1].offset + 1
            self._producers.committed(stamp)
            self._version = version
            self._failure = None
            self._attempts += 1
            self.commits += 1
            self._cond.notify_all()
            committed, listeners = self._committed, list(self._listeners)
        for listener in listeners:
            listener(committed, None)

    def _keep(self, entry: _Entry) -> None:
        """Keep a committed batch in the in-memory tail, within ``retain``/``retain_bytes``."""
        if self.retain == 0 or self.retain_bytes == 0:
            return
        if self.retain is None and self.retain_bytes is None:
            return
        self._tail.append(entry)
        self._tail_bytes += entry.nbytes
        while self._tail and (
            (self.retain is not None and len(self._tail) > self.retain)
            or (self.retain_bytes is not None and self._tail_bytes > self.retain_bytes)
        ):
            self._tail_bytes -= self._tail.popleft().nbytes

    def _upkeep_loop(self, interval: float) -> None:
        while not self._upkeep_stop.wait(interval):
            try:
                self.upkeep()
            except DataDirInUseError as exc:  # another owner: this one stops at once
                self._fenced(exc)
                return
            except Exception as exc:  # noqa: BLE001 (best effort: the next round tries again)
                log.warning("upkeep of durable topic '%s' failed: %s", self.name, exc)

    def upkeep(self) -> None:
        """Compact and clean up now (it also runs every ``upkeep_interval`` seconds)."""
        room = None if self.room is None else self.room()
        retained = self.retention is not None or self.retention_bytes is not None
        self.store.upkeep(self._keep_versions, room, spare_oldest=retained)
        if retained:  # history is bounded by retention, not kept by version: free the rest
            self._release()

    # -- reading ------------------------------------------------------------------------

    def consumed(self, consumer: str, offset: int) -> None:
        """Record that ``consumer`` has read every offset below ``offset``.

        Spark's source calls it from ``commit(end)``. Positions are kept in memory, reported by
        :attr:`stats`, and stored with the topic's next commit, so a restart recovers them.
        Every commit carries every consumer's position, so names are at most
        :data:`MAX_CONSUMER_NAME_BYTES` bytes and a topic keeps at most :data:`MAX_CONSUMERS`
        consumers (200 KB names made every commit carry megabytes).
        """
        if not consumer:
            raise ValueError("a consumer needs a name")
        if len(consumer.encode()) > MAX_CONSUMER_NAME_BYTES:
            raise ValueError(
                f"a consumer name takes at most {MAX_CONSUMER_NAME_BYTES} bytes, got "
                f"{len(consumer.encode()):,} (every commit of the topic stores it)"
            )
        with self._cond:
            if consumer not in self._consumers and len(self._consumers) >= MAX_CONSUMERS:
                raise ResourceLimitError(
                    f"durable topic '{self.name}' keeps the positions of {MAX_CONSUMERS:,} "
                    f"consumers already (every commit stores them all): refused {consumer!r}"
                )
            if not 0 <= offset <= self._committed:
                raise ValueError(
                    f"durable topic '{self.name}': consumer {consumer!r} cannot have read up to "
                    f"offset {offset}; offsets 0..{self._committed} are committed"
                )
            self._consumers[consumer] = int(offset)

    def offsets(self) -> dict[str, int]:
        """The log's ``earliest``, ``committed`` and ``next`` offsets.

        ``earliest`` is the first stored offset; every offset below ``committed`` is stored;
        ``next`` is the offset the next batch gets.
        """
        with self._cond:
            return {"earliest": self._earliest, "committed": self._committed, "next": self._next}

    def start_offset(self, start: Start) -> int:
        """The offset a read from ``start`` begins at."""
        with self._cond:
            nxt, version, committed = self._next, self._version, self._committed
            recent = [*self._tail, *self._pending]
            earliest = self._earliest
            pin = self.store.pin(version)
        try:
            return self._start_offset(start, nxt, version, committed, recent, earliest)
        finally:
            pin.release()

    def _start_offset(
        self,
        start: Start,
        nxt: int,
        version: int,
        committed: int,
        recent: list[_Entry],
        earliest: int,
    ) -> int:
        if start == "earliest":
            return earliest
        if start in ("latest", "now"):
            return nxt
        if isinstance(start, datetime):
            if start.tzinfo is None:
                raise ValueError(f"a start time needs a time zone (e.g. UTC), got {start!r}")
            us = micros(start)
            if recent and recent[0].time_us <= us:
                return next((e.offset for e in recent if e.time_us >= us), nxt)
            found = self.store.offset_at(start, version) if committed else None
            found = found if found is not None else next((e.offset for e in recent), nxt)
            return max(found, earliest)
        if isinstance(start, int) and not isinstance(start, bool):
            if not earliest <= start <= nxt:
                raise self._out_of_range(f"offset {start}", earliest, nxt)
            return start
        raise ValueError(
            f"start must be 'earliest', 'latest', an offset or a datetime, got {start!r}"
        )

    def subscribe(self, start: Start, then: Callable[[pa.RecordBatchReader | None], Any]) -> Any:
        """Call ``then(history)`` between two appends, to start a reader at ``start``.

        ``history`` holds every batch from ``start`` up to the newest appended (None when that
        is nothing), and ``then`` starts the live reader for what comes after.
        """
        # A start time may need a scan of Lance to resolve: done before the append lock is
        # taken, so producers are not held up by it. A start at or before now is settled
        # then: what is appended afterwards arrives later and belongs to the read.
        early = None
        if isinstance(start, datetime) and start.tzinfo is not None and micros(start) <= now_us():
            early = self.start_offset(start)
        with self._order:
            first = early if early is not None else self.start_offset(start)
            return then(self._history(first))

    def _history(self, first: int) -> pa.RecordBatchReader | None:
        with self._cond:  # the caller holds _order: no append moves these meanwhile
            committed, version, nxt = self._committed, self._version, self._next
            memory = [e for e in (*self._tail, *self._pending) if e.offset >= first]
            from_store = first < nxt and not (memory and memory[0].offset == first)
            # Held from here, under the lock retention's cleanup takes its floor under.
            pin = self.store.pin(version) if from_store else None
        if first >= nxt:
            return None
        if first < self._earliest:  # retention deleted it between start_offset and here
            if pin is not None:
                pin.release()
            raise self._out_of_range(f"offset {first}", self._earliest, nxt)
        # The tail ends where the pending batches begin: memory is contiguous up to nxt.
        stored: pa.RecordBatchReader | None = None
        if pin is not None:
            stored = self.store.read(first, committed, version, pin)
            memory = [e for e in memory if e.offset >= committed]

        def batches() -> Iterator[pa.RecordBatch]:
            if stored is not None:
                yield from stored
            for e in memory:
                yield pa.RecordBatch.from_arrays(e.batch.columns, schema=self.schema)

        return pa.RecordBatchReader.from_batches(self.schema, batches())

    def read(self, start: int, end: int) -> pa.RecordBatchReader:
        """Committed offsets ``[start, end)``: the same rows each time they are read."""
        with self._cond:
            committed, version, earliest = self._committed, self._version, self._earliest
            tail = [e for e in self._tail if start <= e.offset < end]
            in_memory = bool(tail) and tail[0].offset == start and len(tail) == end - start
            ok = earliest <= start <= end <= committed
            pin = self.store.pin(version) if ok and not in_memory else None
        if not ok:
            raise self._out_of_range(f"offsets [{start}, {end})", earliest, committed, "committed")
        if pin is None:
            arrays = [pa.RecordBatch.from_arrays(e.batch.columns, schema=self.schema) for e in tail]
            return pa.RecordBatchReader.from_batches(self.schema, arrays)
        return self.store.read(start, end, version, pin)

    def _out_of_range(
        self, what: str, earliest: int, end: int, kind: str = "the next batch's"
    ) -> OffsetOutOfRangeError:
        error = OffsetOutOfRangeError(
            f"{what} cannot be read from durable topic '{self.name}': offsets "
            f"{earliest}..{end} ({kind}) can be"
            + (f"; retention has deleted those below {earliest}" if earliest else "")
        )
        error.earliest = earliest  # type: ignore[attr-defined]
        return error

    # -- ending -------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Store what is pending, then stop the committer and upkeep threads and join them.

        Raises if the last commit fails: what it held is not stored, and was never
        acknowledged; the committer stops all the same, after at most the attempt under way.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._upkeep_stop.set()
            self._join(timeout)

    def _join(self, timeout: float | None) -> None:
        """Join the threads this log owns.

        Bounded: a commit or an upkeep round under way finishes first; ``timeout`` None waits
        for it.
        """
        for thread in (self._committer, self._upkeep):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def abandon(self, reason: PushTableError | None = None) -> None:
        """Stop without committing pending batches (a failed topic, a stopping server).

        What is pending is never committed, so never acknowledged (a commit under way may
        still land: it is not acknowledged either). With ``reason`` (another server took the
        data dir), writes and waits for a commit raise it.
        """
        with self._cond:
            first = not self._abandoned
            self._closing = True
            self._closed = True
            self._abandoned = True
            if reason is not None:
                self._gone = reason
            self._cond.notify_all()
            committed, listeners = self._committed, list(self._listeners)
        self._upkeep_stop.set()
        if reason is not None and first:  # producers waiting for a commit hear why: none comes
            for listener in listeners:
                listener(committed, reason)

    def _refused(self) -> PushTableError:
        """Why a write or a wait is refused once the log closed (the caller holds ``_cond``)."""
        gone = self._gone
        if gone is None:
            return SinkClosedError(f"durable topic '{self.name}' is closed")
        return type(gone)(f"durable topic '{self.name}': {gone}")

    @property
    def stats(self) -> dict[str, Any]:
        """The log's counters: offsets, pending and retained data, commits, consumer positions."""
        with self._cond:
            return {
                "durable": True,
                "next_offset": self._next,
                "committed_offset": self._committed,
                "pending_batches": len(self._pending),
                "pending_bytes": self._pending_bytes,
                "retained_batches": len(self._tail),
                "retained_bytes": self._tail_bytes,
                "earliest_offset": self._earliest,
                "commits": self.commits,
                "commit_failures": self.commit_failures,
                "expirations": self.expirations,
                "consumers": dict(self._consumers),
            }
