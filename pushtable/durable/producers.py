"""A durable topic's idempotent producers: their sequences, fingerprints and Spark units.

A producer with an id numbers its batches; the log stores each one once. A batch under a
sequence already taken is a resend (a lost acknowledgement), acknowledged and not appended
again, unless its rows differ from the batch stored under it: then it is a reuse (two
producers with one id, one that numbered afresh) and refused. Each of a producer's last
:data:`FINGERPRINTS` batches keeps a CRC-32 to tell them apart, and each commit stores the
newest :data:`STORED_PRINTS`, so a restart refuses a reuse too (as Kafka's idempotent producer
keeps the last sequences of each producer id with its log).

A Spark query's epochs are *units*: their batches are numbered epoch-major
(:func:`epoch_sequence`, gaps allowed) and stored by one commit or none, so a replay finds a
unit stored whole or not at all; the newest unit's row count is stored with the commit to tell
a replay of it from other rows under its numbers.

What a commit stores of them (each producer's last sequence, its newest fingerprints, its
newest unit's rows) is part of the commit's stamp, so a restart reads it with the rows. Not
thread-safe: the log's lock guards every call.

Example:
    >>> from pushtable.durable.store import Recovered
    >>> known = Producers("t", Recovered(0, {}, 0))
    >>> known.admit("p", 0, fingerprint=7, gaps=False)  # a new batch: append it
    False
    >>> known.accept("p", 0, fingerprint=7, unit_rows=None)
    >>> known.admit("p", 0, fingerprint=7, gaps=False)  # the same batch again: a resend
    True
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

import pyarrow as pa

from pushtable.durable.store import Recovered, Stamp
from pushtable.errors import ResourceLimitError, SequenceError

__all__ = [
    "EPOCH_BATCHES",
    "FINGERPRINTS",
    "MAX_PRODUCERS",
    "PRODUCER_IDLE_S",
    "STORED_PRINTS",
    "Producers",
    "epoch_of",
    "epoch_sequence",
    "fingerprint",
]

#: batches of one epoch a Spark query may publish (the low bits of a sequence number)
EPOCH_BATCHES = 1 << 24

#: how many idempotent producers a topic keeps the last sequence of (each commit stores them
#: all), and how long one that appends nothing keeps its place once the topic is at that bound
#: (Kafka forgets an idle producer id after a day; Spark queries and services restarted from
#: their state write at least daily, or start afresh with their sequence as the server has it)
MAX_PRODUCERS = 1024
PRODUCER_IDLE_S = 7 * 24 * 3600.0

#: how many of each idempotent producer's last sequences keep a fingerprint (~40 KB a
#: producer): a client's window of resends is 256 by default
FINGERPRINTS = 1024
#: how many of those each commit stores (the newest): a reuse of a recent sequence with
#: other rows is refused after a restart too (~90 bytes a producer in every commit)
STORED_PRINTS = 8


def epoch_sequence(epoch: int, index: int, last: bool) -> int:
    """The sequence number of batch ``index`` of a Spark query's ``epoch`` in a durable log.

    Epoch-major, so a replayed epoch's batches stored before a crash are skipped one by one;
    the epoch's last batch takes the highest number of the epoch, so a stored last batch
    means the whole epoch is stored (:func:`epoch_of`).
    """
    if not 0 <= index < EPOCH_BATCHES - 1:
        raise ValueError(f"an epoch holds at most {EPOCH_BATCHES - 1:,} batches, got {index + 1}")
    return epoch * EPOCH_BATCHES + (EPOCH_BATCHES - 1 if last else index)


def epoch_of(sequence: int) -> int:
    """The newest epoch a query's stored ``sequence`` says is whole (-1: none)."""
    if sequence < 0:
        return -1
    epoch, index = divmod(sequence, EPOCH_BATCHES)
    return epoch if index == EPOCH_BATCHES - 1 else epoch - 1


def fingerprint(batch: pa.RecordBatch) -> int:
    """A CRC-32 of a batch's rows and buffers (zlib releases the GIL past 5 KB; ~2 GB/s)."""
    crc = zlib.crc32(batch.num_rows.to_bytes(8, "little"))
    for column in batch.columns:
        arrays = [column]
        if pa.types.is_dictionary(column.type):
            arrays.append(column.dictionary)
        for array in arrays:
            for buffer in array.buffers():
                if buffer is not None:
                    crc = zlib.crc32(buffer, crc)
    return crc


class Appended(Protocol):
    """What :class:`Producers` reads of an appended batch (the log's entries)."""

    @property
    def producer(self) -> str | None: ...

    @property
    def sequence(self) -> int | None: ...

    @property
    def fingerprint(self) -> int | None: ...

    @property
    def unit_rows(self) -> int | None: ...


#: a producer's state before a unit, to take it back (its last sequence, its newest unit)
Mark = tuple[int | None, int | None]


class Producers:
    """What a durable log knows of its idempotent producers, appended and stored."""

    def __init__(self, topic: str, recovered: Recovered) -> None:
        self._topic = topic
        self._accepted = dict(recovered.producers)  # producer -> last sequence appended
        self._stored = dict(recovered.producers)  # producer -> last sequence committed
        #: producer -> the fingerprints of its last FINGERPRINTS batches (the newest last: a
        #: producer's sequences follow each other, so the newest is ``_accepted[producer]``'s)
        self._prints = {
            p: deque(prints, maxlen=FINGERPRINTS) for p, prints in recovered.prints.items()
        }
        #: producer -> the newest fingerprints a commit stores (the newest last)
        self._stored_prints = dict(recovered.prints)
        #: producer -> the rows of its newest unit appended, and stored (a Spark epoch's)
        self._units = dict(recovered.units)
        self._stored_units = dict(recovered.units)
        #: producer -> when it last appended (monotonic; those recovered: when the log opened)
        self._seen = dict.fromkeys(recovered.producers, time.monotonic())

    # -- appending ----------------------------------------------------------------------

    def admit(self, producer: str, sequence: int, fingerprint: int | None, gaps: bool) -> bool:
        """Whether ``producer``'s batch ``sequence`` is stored already (a resend), or raise.

        False: it is the next one, to append (then :meth:`accept`). A new producer takes a
        place (:meth:`_make_room_for`); other rows under a taken sequence, or a sequence
        past the next (unless ``gaps``: a Spark unit's), raise :class:`SequenceError`.
        """
        if producer not in self._accepted:
            self._make_room_for(producer)
        last = self._accepted.get(producer, -1)
        if sequence <= last:
            if not gaps:
                self._check_resend(producer, sequence, fingerprint)
            return True
        if sequence != last + 1 and not gaps:
            raise SequenceError(
                f"producer {producer!r} of topic '{self._topic}' sent sequence "
                f"{sequence}, but the last one stored is {last}: batches "
                f"{last + 1}..{sequence - 1} were never received"
            )
        return False

    def accept(
        self, producer: str, sequence: int, fingerprint: int | None, unit_rows: int | None
    ) -> None:
        """``producer``'s batch ``sequence`` is appended (its fingerprint, a unit's rows)."""
        self._accepted[producer] = sequence
        self._seen[producer] = time.monotonic()
        if fingerprint is not None:
            self._prints.setdefault(producer, deque(maxlen=FINGERPRINTS)).append(fingerprint)
        if unit_rows is not None:
            self._units[producer] = unit_rows

    def check_unit(
        self, producer: str, batches: Sequence[pa.RecordBatch], sequences: Sequence[int]
    ) -> None:
        """Refuse a unit whose replay does not match what is stored.

        A unit is stored whole or not at all, so a replay finds every one of its sequences
        stored or none: some but not all means the stored ones are not this unit's (another
        writer's batches under the id). A replay of the newest stored unit must carry as
        many rows as it stored (it used to be skipped, whatever it held).
        """
        last = self._accepted.get(producer, -1)
        stored = [s for s in sequences if s <= last]
        if not stored:
            return
        if len(stored) != len(sequences):
            raise SequenceError(
                f"producer {producer!r} of topic '{self._topic}': its last stored sequence "
                f"{last} falls inside the unit {sequences[0]}..{sequences[-1]} (a unit is "
                "stored whole or not at all): the stored batches are not this unit's"
            )
        rows = sum(b.num_rows for b in batches)
        if epoch_of(last) == epoch_of(sequences[-1]):
            kept = self._units.get(producer)
            if kept is not None and kept != rows:
                raise SequenceError(
                    f"producer {producer!r} of topic '{self._topic}': unit "
                    f"{sequences[0]}..{sequences[-1]} replayed with {rows:,} rows, but "
                    f"{kept:,} are stored under it: refused (not the same data)"
                )

    def mark(self, producer: str) -> Mark:
        """What :meth:`take_back` restores: ``producer``'s state before a unit."""
        return self._accepted.get(producer), self._units.get(producer)

    def take_back(self, producer: str, mark: Mark) -> None:
        """Forget a unit appended after :meth:`mark` (it was not finished)."""
        accepted, unit = mark
        if unit is None:
            self._units.pop(producer, None)
        else:
            self._units[producer] = unit
        if accepted is None:
            self._accepted.pop(producer, None)
            self._seen.pop(producer, None)
        else:
            self._accepted[producer] = accepted

    def _check_resend(self, producer: str, sequence: int, fingerprint: int | None) -> None:
        """Refuse a batch sent again under ``sequence`` with other rows.

        A resend (a lost acknowledgement) carries the same rows and is acknowledged, not
        appended. Other rows under a sequence already taken (a producer that numbers afresh
        after losing its state, an id shared by two producers) used to be acknowledged and
        dropped. Each of a producer's last :data:`FINGERPRINTS` sequences keeps a CRC-32 of
        its buffers to tell them apart; an older sequence is acknowledged as a resend, as
        before.
        """
        prints = self._prints.get(producer)
        back = self._accepted.get(producer, -1) - sequence  # 0: the newest
        kept = prints[-1 - back] if prints is not None and 0 <= back < len(prints) else None
        if kept is not None and fingerprint is not None and kept != fingerprint:
            raise SequenceError(
                f"producer {producer!r} of topic '{self._topic}' sent sequence {sequence} "
                "again with other rows than the batch stored under it: refused (is the "
                "producer id used by two producers, or did one number its batches afresh?)"
            )

    def _make_room_for(self, producer: str) -> None:
        """Room for a new producer's sequence, or refuse it.

        At :data:`MAX_PRODUCERS`, the producer idle longest goes if it appended nothing for
        :data:`PRODUCER_IDLE_S` (its next commit stores it no more; if it comes back, its
        sequence starts afresh, as Kafka's expired producer ids do); otherwise the new one is
        refused by name.
        """
        if len(self._accepted) < MAX_PRODUCERS:
            return
        now = time.monotonic()
        oldest = min(self._accepted, key=lambda p: self._seen.get(p, now), default=None)
        if oldest is not None and now - self._seen.get(oldest, now) >= PRODUCER_IDLE_S:
            self._accepted.pop(oldest, None)
            self._stored.pop(oldest, None)
            self._prints.pop(oldest, None)
            self._seen.pop(oldest, None)
            self._stored_prints.pop(oldest, None)
            self._units.pop(oldest, None)
            self._stored_units.pop(oldest, None)
            return
        raise ResourceLimitError(
            f"durable topic '{self._topic}' keeps the sequences of {MAX_PRODUCERS:,} idempotent "
            f"producers already, each active within {PRODUCER_IDLE_S / 3600:g} h (every commit "
            f"stores them all): refused producer id {producer!r}; reuse a producer's id across "
            "its restarts rather than a new one each time"
        )

    # -- what is known ------------------------------------------------------------------

    def last(self, producer: str) -> int:
        """The last sequence number of ``producer`` appended (-1: none)."""
        return self._accepted.get(producer, -1)

    def last_stored(self, producer: str) -> int:
        """The last sequence number of ``producer`` a commit holds (-1: none)."""
        return self._stored.get(producer, -1)

    def stored(self) -> dict[str, int]:
        """Each producer's last sequence the newest commit holds."""
        return dict(self._stored)

    # -- commits ------------------------------------------------------------------------

    def stored_after(self, before: dict[str, int], entries: Iterable[Appended]) -> dict[str, int]:
        """The last sequences a commit of ``entries`` stores, after one that stored ``before``.

        The producers forgotten meanwhile (idle at the bound) are not stored again.
        """
        stored = {p: last for p, last in before.items() if p in self._accepted}
        for e in entries:
            if e.producer is not None:
                assert e.sequence is not None
                stored[e.producer] = e.sequence
        return stored

    def stamped_after(
        self, entries: Iterable[Appended]
    ) -> tuple[dict[str, list[int]], dict[str, int]]:
        """The fingerprints and unit rows a commit of ``entries`` stores.

        Those of the commit before, with ``entries``' appended (each producer's newest
        ``STORED_PRINTS``), for the producers the log still knows.
        """
        known = self._accepted
        prints = {p: list(v) for p, v in self._stored_prints.items() if p in known}
        units = {p: v for p, v in self._stored_units.items() if p in known}
        for e in entries:
            if e.producer is None:
                continue
            if e.fingerprint is not None:
                prints[e.producer] = [*prints.get(e.producer, []), e.fingerprint][-STORED_PRINTS:]
            if e.unit_rows is not None:
                units[e.producer] = e.unit_rows
        return prints, units

    def committed(self, stamp: Stamp) -> None:
        """A commit stamped ``stamp`` landed: what it stores is what is stored."""
        known = self._accepted
        self._stored = {p: last for p, last in stamp.producers.items() if p in known}
        self._stored_prints = {p: v for p, v in stamp.prints.items() if p in known}
        self._stored_units = {p: v for p, v in stamp.units.items() if p in known}

    def stamp(self, next_offset: int, consumers: dict[str, int], earliest: int) -> Stamp:
        """The stamp of the newest commit, with its offsets and consumers."""
        return Stamp(
            next_offset,
            dict(self._stored),
            consumers,
            earliest,
            dict(self._stored_prints),
            dict(self._stored_units),
        )
