"""An idempotent producer for a durable topic: :class:`IdempotentSink`.

Each batch gets the producer's next sequence number and stays in the sink until the server
acknowledges it, which on a durable topic means a Lance commit holds it. If the server
becomes unreachable (killed, restarting, the network cut), the sink reconnects and sends
every unacknowledged batch again, in order; the server stores a ``(producer, sequence)``
once, so a batch whose acknowledgement was lost is acknowledged again, not appended twice
(Kafka's idempotent producer, for one topic). ``retry`` bounds how long it keeps trying.
"""

from __future__ import annotations

import collections
import copy
import time
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import (
    ClientClosedError,
    CommitFailedError,
    PushTableError,
    ResourceLimitError,
    ServerUnavailableError,
    SinkClosedError,
    WriteTimeoutError,
)
from pushtable.flight import protocol
from pushtable.flight.client.outcome import Item, Sent, timed_out
from pushtable.flight.client.put_stream import PutStream
from pushtable.flight.client.remote_sink import WINDOW_BYTES, RemoteSink
from pushtable.flight.client.transport import Reopening, Transport
from pushtable.producer import arrow_batches, batch_bytes, check_timeout

__all__ = ["DURABLE_WINDOW", "DURABLE_WINDOW_BYTES", "IdempotentSink"]

#: A durable producer's default window: batches in flight... (wide enough that the next group
#: commits fill while one is written: with 32, a topic of 8,192-row batches over Flight
#: committed in groups of 32 and its encoder waited for them; docs/benchmarks.md)
DURABLE_WINDOW = 256
#: ...and their bytes (what each references: a slice its own rows), whichever bound comes first.
DURABLE_WINDOW_BYTES = WINDOW_BYTES


#: how long an idempotent sink's stream open may try, at least, once ``retry`` has run out
#: (an outage clock left running by an earlier call is stale once the server is back)
OPEN_CHANCE_S = 0.5


class IdempotentSink(RemoteSink):
    """A :class:`RemoteSink` that numbers its batches and rides out server outages.

    ``write`` returns once the batch is sent with at most ``window`` batches, and at most
    ``window_bytes`` of them, unacknowledged (it keeps them to send again); ``flush`` returns
    once all are stored. A durable topic acknowledges a batch once a group commit holds it
    (about ``commit_interval`` later), so the window is wider than a table's: enough
    batches in flight to fill the next commit while one is being written. While the server is
    unreachable, either call reconnects and resends for up to ``retry`` seconds, then raises
    :class:`~pushtable.ServerUnavailableError` naming the sequences not acknowledged (they
    stay in the sink: a later call tries again). Made again with the same ``producer_id``
    (e.g. after the producer restarted), it continues after the last sequence stored.

    Example:
        >>> import tempfile, pyarrow as pa
        >>> from pushtable.flight import Server, connect
        >>> server = Server(data_dir=tempfile.mkdtemp())
        >>> client = connect(server.location)
        >>> client.create_topic("t", pa.schema([("v", pa.int64())]), durable=True)
        >>> sink = client.sink("t", producer_id="sensor-7")
        >>> sink.write(pa.record_batch({"v": [1, 2]}))
        >>> sink.flush()  # stored in the topic's Lance dataset
        >>> client.offsets("t")["committed"]
        1
        >>> server.stop()
        0
    """

    def __init__(
        self,
        transport: Transport,
        name: str,
        schema: pa.Schema,
        producer_id: str,
        *,
        window: int = DURABLE_WINDOW,
        window_bytes: int = DURABLE_WINDOW_BYTES,
        retry: float = 60.0,
    ) -> None:
        super().__init__(transport, name, schema, window=window, window_bytes=window_bytes)
        self._reopening = Reopening(f"remote topic '{name}'")
        if not isinstance(producer_id, str) or not producer_id:
            raise ValueError(f"producer_id must be a non-empty string, got {producer_id!r}")
        self.producer_id = producer_id
        self.retry = check_timeout(retry)
        last = transport.action("producer", {"name": name, "producer_id": producer_id})
        self._next_sequence = int(last["sequence"]) + 1
        #: (sequence, batch, its bytes), oldest first; ``_unacked_bytes`` is their total
        self._unacked: collections.deque[tuple[int, pa.RecordBatch, int]] = collections.deque()
        self._unacked_bytes = 0
        #: the items of an asyncio producer, by sequence: settled as acknowledgements cover them
        self._items: dict[int, Item] = {}
        self._first = 0  # the sequence of the open stream's first batch
        self._sent_upto = -1  # the last sequence sent on the open stream
        #: the last sequence any stream carried: those above were never sent (and may go)
        self._claimed_upto = self._next_sequence - 1
        #: when the outage under way began (None: the server answers), across calls: an
        #: asyncio producer's writer calls in steps, and ``retry`` bounds the whole outage
        self._outage_since: float | None = None

    def __repr__(self) -> str:
        return f"IdempotentSink(name={self.name!r}, producer_id={self.producer_id!r})"

    @property
    def unacknowledged(self) -> int:
        """Batches sent (or to send) that the server has not acknowledged yet."""
        with self._lock:
            self._trim()
            return len(self._unacked)

    def _stream(self, deadline: float | None = None) -> PutStream:
        if self._put is not None and self._put.idle:
            self._end_stream_locked()
        if self._put is None:
            self._first = self._unacked[0][0] if self._unacked else self._next_sequence
            self._sent_upto = self._first - 1
            path = [self.name, protocol.PRODUCER, self.producer_id, str(self._first)]
            descriptor = flight.FlightDescriptor.for_path(*path)
            self._open(descriptor, deadline)
        assert self._put is not None
        return self._put

    def _trim(self) -> None:
        """Forget the batches the open stream's acknowledgements cover."""
        if self._put is not None:
            done = self._first + self._put.acked
            while self._unacked and self._unacked[0][0] < done:
                sequence, _, size = self._unacked.popleft()
                self._unacked_bytes -= size
                if (item := self._items.pop(sequence, None)) is not None:
                    item.settle(None)

    def _take_back(self, sequence: int) -> None:
        """Forget the newest batch (``sequence``), never sent: its number is free again."""
        if self._unacked and self._unacked[-1][0] == sequence:
            _, _, size = self._unacked.pop()
            self._unacked_bytes -= size
            self._next_sequence -= 1
            self._items.pop(sequence, None)

    def _drop_withdrawn(self) -> None:
        """Forget the batches whose writers withdrew them before any stream carried them.

        A withdrawn batch was never claimed for the wire, so neither was any batch after it
        (they go in order): those take the numbers from the first withdrawn one's on. Any
        batch's writer may withdraw it, whatever its place in the window.
        """
        kept: collections.deque[tuple[int, pa.RecordBatch, int]] = collections.deque()
        items: dict[int, Item] = {}
        renumber: int | None = None  # the next number, once a withdrawn batch was dropped
        for sequence, batch, size in self._unacked:
            item = self._items.get(sequence)
            if item is not None and item.withdrawn:
                self._unacked_bytes -= size
                item.sequence = None
                renumber = sequence if renumber is None else renumber
                continue
            new = sequence if renumber is None else renumber
            if renumber is not None:
                renumber += 1
            kept.append((new, batch, size))
            if item is not None:
                item.sequence = new
                items[new] = item
        if renumber is not None:
            self._unacked, self._items, self._next_sequence = kept, items, renumber

    def _unsent(self) -> list[tuple[int, pa.RecordBatch, int]]:
        """The batches the open stream has not carried yet (the newest), oldest first.

        O(unsent), not O(window): a write sends one.
        """
        out = []
        for item in reversed(self._unacked):
            if item[0] <= self._sent_upto:
                break
            out.append(item)
        out.reverse()
        return out

    def _pump(self, most_unacked: int | None, deadline: float | None) -> None:
        """Send what the open stream has not carried yet, then wait for acknowledgements.

        It reconnects when the server is unreachable, then waits until at most
        ``most_unacked`` are unacknowledged.
        """
        pause = 0.05
        while True:
            try:
                self._refuse_left()
                put = self._opened_within(deadline)
                for sequence, batch, size in self._unsent():
                    if not put.wait(self.window - 1, deadline, self.window_bytes - size):
                        raise self._reopening.timed_out(
                            f"write to remote topic '{self.name}' timed out with "
                            f"{put.sent - put.acked} batch(es) unacknowledged"
                        )
                    self._trim()
                    item = self._items.get(sequence) or Item(batch)
                    sent = put.send(item, max(1, self.window // 2), deadline)
                    if sent is Sent.WITHDRAWN:
                        self._drop_withdrawn()  # those after it take its number: not sent yet
                        break
                    if sent is Sent.BUSY:
                        raise self._reopening.timed_out(
                            f"write to remote topic '{self.name}' timed out while gRPC was "
                            "still taking an earlier batch"
                        )
                    self._sent_upto = sequence
                    self._claimed_upto = max(self._claimed_upto, sequence)
                    if sent is Sent.PENDING:
                        raise self._reopening.timed_out(
                            f"write to remote topic '{self.name}' timed out while gRPC was "
                            "taking a batch"
                        )
                else:
                    if most_unacked == 0 and put.sent > put.acked:
                        put.sync(deadline)  # a flush: the server commits what is pending now
                    if most_unacked is not None and not put.wait(most_unacked, deadline):
                        flush = f"flush of remote topic '{self.name}' timed out"
                        raise self._reopening.timed_out(flush)
                    if put.acked:
                        self._reopening.reset()  # the stream was taken
                    self._outage_since = None
                    self._trim()
                    return
            except PushTableError as exc:
                if isinstance(exc, WriteTimeoutError) or getattr(exc, "gave_up", False):
                    raise  # every batch stays kept; the next call goes on
                first = self._first  # the open stream's first sequence, before it is dropped
                open_put = self._put
                # A refusal ends the stream (gRPC's write may raise it before the reader has
                # seen the end): dropped at once, so no later wait on it meets the refusal
                # again and lets go of the batch that took the refused one's number.
                dead = open_put is not None and (open_put.error is not None or open_put.finished)
                if open_put is not None and (dead or not protocol.retriable(exc)):
                    self._drop_stream()
                if protocol.reopens(exc):  # refused as it opened: took nothing, all go again
                    try:
                        self._reopening.wait(exc, deadline)
                    except WriteTimeoutError:
                        raise
                    except PushTableError as refusal:
                        raise self._unavailable(refusal) from refusal
                    continue
                if not protocol.retriable(exc):
                    if self._let_go_refused(exc, first):
                        continue  # its own writer is told; the others go on the next stream
                    raise
                now = time.monotonic()
                if self._outage_since is None:
                    self._outage_since = now
                give_up = None if self.retry is None else self._outage_since + self.retry
                if give_up is not None and now >= give_up:
                    self._outage_since = None  # told: the next call tries anew
                    raise self._unavailable(exc) from exc
                if deadline is not None and now >= deadline:  # the call's own bound came first
                    raise self._reopening.timed_out(
                        f"{'flush' if most_unacked == 0 else 'write'} of remote topic "
                        f"'{self.name}' timed out while the server was unreachable ({exc}); "
                        f"{len(self._unacked)} batch(es) kept, sent again by the next call"
                    ) from exc
                # the pause never outlasts the call's deadline, nor the retry window
                ends = [t for t in (deadline, give_up) if t is not None]
                time.sleep(min([pause, *(t - now for t in ends)]))
                pause = min(1.0, pause * 2)

    def _opened_within(self, deadline: float | None) -> PutStream:
        """The open stream, opened within the call's deadline and the retry window.

        gRPC's open waits for its connection without a bound (a paused server, a restarted
        one in its backoff): bounded by ``deadline`` alone, a write with no timeout waited
        for it past ``retry`` and then said the server was unreachable for ``retry``
        seconds. An open that outlasts the retry window (counted from the outage's start, or
        from now) gives up as an outage does.
        """
        now = time.monotonic()
        since = now if self._outage_since is None else self._outage_since
        give_up = None if self.retry is None else since + self.retry
        # Every open gets a moment, even past the window: an outage clock an earlier call
        # left running (its own timeout came first) is stale once the server is back, and a
        # bound in the past gave up at once against a server that answers.
        chance = None if give_up is None else max(give_up, now + OPEN_CHANCE_S)
        bound = min((t for t in (deadline, chance) if t is not None), default=None)
        try:
            return self._stream(bound)
        except WriteTimeoutError as exc:
            # An open that does not answer is an outage: its clock starts here, so calls in
            # steps (the asyncio face's writer thread, 0.2 s a step) give up within ``retry``
            # too (they kept stepping, the clock never started, for as long as the server
            # stayed away).
            if self._outage_since is None:
                self._outage_since = since
            own = deadline is not None and (give_up is None or deadline < give_up)
            if own or bound is None or time.monotonic() < bound:
                raise  # the call's own timeout: its batches stay kept
            self._outage_since = None  # told: the next call tries anew
            raise self._unavailable(exc) from exc

    def _let_go_refused(self, exc: PushTableError, first: int) -> bool:
        """Forget the batch the server refused (its data), numbering those after it anew.

        The server took every batch before it and none after (the stream ended there): the
        later ones take the numbers from the refused one's on, and go on the next stream. It
        used to be kept and sent again with every call, refused each time, and nothing
        written after it was ever stored. Returns whether the refusal reached its own writer
        (an asyncio producer's item): no other call raises it then.
        """
        refused = getattr(exc, "refused_message", None)
        if refused is None:
            return False
        sequence = first + refused - 1
        kept = [entry for entry in self._unacked if entry[0] != sequence]
        if len(kept) == len(self._unacked):
            return False  # not one of ours (acknowledged meanwhile, or already let go)
        told = False
        if (item := self._items.pop(sequence, None)) is not None:
            item.settle(exc)
            told = item.outcome is not None
        renumbered: collections.deque[tuple[int, pa.RecordBatch, int]] = collections.deque()
        items: dict[int, Item] = {}
        for seq, batch, size in kept:
            new = seq - 1 if seq > sequence else seq
            renumbered.append((new, batch, size))
            if (item := self._items.get(seq)) is not None:
                item.sequence = new
                items[new] = item
        self._unacked_bytes -= sum(size for seq, _, size in self._unacked if seq == sequence)
        self._unacked, self._items = renumbered, items
        self._next_sequence -= 1
        if self._claimed_upto >= sequence:
            self._claimed_upto -= 1
        exc.refused_sequence = sequence  # type: ignore[attr-defined]
        return told

    def gave_up(self, item: Item, exc: BaseException) -> None:
        """Tell ``item``'s writer the outage outlasted ``retry``: its batch is kept (once).

        Its own error says so (``kept=True``, ``batches_written=1``: its batch is the one
        kept); a later error of its batch (a refusal once the server is back) goes to the
        next ``flush`` or ``close``, as no task waits for it any more.
        """
        if item.handed:
            return  # told already, at an earlier give-up
        if item.sequence is None:  # it found no room: never kept, never sent
            own = copy.copy(exc)
            own.batches_written = 0  # type: ignore[attr-defined]
            own.kept = False  # type: ignore[attr-defined]
            item.settle(own)
            return
        own = copy.copy(exc)
        own.batches_written = 1  # type: ignore[attr-defined]
        item.settle(own)
        item.hand_over(self._orphaned)

    def _orphaned(self, error: BaseException | None) -> None:
        # A batch's final outcome only: an outage is none here (the batch stays kept and
        # goes again), so it takes no slot a later refusal of the batch would need.
        if error is None or protocol.retriable(error) or getattr(error, "gave_up", False):
            return
        super()._orphaned(error)

    def _drop_stream(self) -> None:
        self._trim()
        super()._drop_stream()

    def _unavailable(self, exc: BaseException) -> ServerUnavailableError | ResourceLimitError:
        """Why this producer stopped trying; its batches are kept.

        An outage, or a server that refused its streams as they opened for ``REOPEN_FOR_S``
        since it last took one (still marked so).
        """
        seqs = [s for s, _, _ in self._unacked]
        what = f"sequences {seqs[0]}..{seqs[-1]}" if seqs else "nothing"
        kept = (
            f"{len(seqs)} batch(es) not acknowledged ({what}): they are kept and sent again by "
            "the next write or flush"
        )
        if protocol.reopens(exc):
            refused = ResourceLimitError(
                f"producer {self.producer_id!r} of topic '{self.name}': the server kept "
                f"refusing its streams as they opened ({exc}); {kept}"
            )
            return protocol.reopening(refused)
        gave_up = ServerUnavailableError(
            f"producer {self.producer_id!r} of topic '{self.name}': the server stayed "
            f"unreachable for {self.retry}s ({exc}); {kept}"
        )
        gave_up.gave_up = True  # type: ignore[attr-defined]  # past ``retry``: its items hear it
        gave_up.kept = True  # type: ignore[attr-defined]
        return gave_up

    def _fresh_outage(self) -> None:
        """A call of the producer's own starts a retry window of its own (holding the lock).

        An outage clock an earlier call left running past ``retry`` is stale: a write after
        the server came back gave up at once, "unreachable for ``retry``" (the asyncio face's
        writer steps its calls: its steps do not reset it).
        """
        since, retry = self._outage_since, self.retry
        if since is not None and retry is not None and time.monotonic() - since >= retry:
            self._outage_since = None

    def write(self, data: Any, timeout: float | None = None) -> None:
        """Number each batch and send it; it is kept, and sent again if need be, until stored."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held(deadline, "write"):
            self._refuse_closed()
            self._fresh_outage()
            for written, data_batch in enumerate(arrow_batches(data)):
                batch = protocol.to_wire(self.name, self.schema, self._wire_schema, data_batch)
                size = batch_bytes(batch)
                try:
                    self._room_for(size, deadline)
                except PushTableError as exc:  # not taken: this batch was not kept
                    raise self._not_kept(exc, written) from exc
                self._unacked.append((self._next_sequence, batch, size))
                self._unacked_bytes += size
                self._next_sequence += 1
                try:
                    self._pump(None, deadline)
                except CommitFailedError as exc:
                    raise self._kept(exc, written + 1) from exc
                except PushTableError as exc:
                    # This call's batch counts as written whenever the sink keeps it (its next
                    # write or flush sends it, stored once): after a refusal of an earlier
                    # batch, a timeout, an outage, streams refused as they opened. Only a batch
                    # the server refused is not. (A timeout said "not written" while the batch
                    # was kept and stored later: a producer that wrote it again stored it twice.)
                    sequence = next((q for q, b, _ in reversed(self._unacked) if b is batch), None)
                    if (
                        sequence is not None
                        and sequence > self._claimed_upto
                        and isinstance(exc, (SinkClosedError, ClientClosedError))
                    ):
                        self._take_back(sequence)  # never sent: the sink is left, it never goes
                        sequence = None
                    if sequence is None:
                        exc.batches_written = written
                        raise
                    if isinstance(exc, WriteTimeoutError):
                        said = timed_out(
                            f"{exc}. Producer {self.producer_id!r} keeps this batch (sequence "
                            f"{sequence}) and sends it again with its next write or flush",
                            written + 1,
                            kept=True,
                        )
                        raise said from exc
                    exc.batches_written = written + 1
                    exc.kept = True  # type: ignore[attr-defined]
                    raise

    def _room_for(self, size: int, deadline: float | None) -> None:
        """Wait (until ``deadline``) until what is kept leaves room for a batch of ``size``.

        The kept batches stay within ``window`` and ``window_bytes``: during an outage every
        write that timed out kept its batch, and the sink grew past both (20 batches, 7.6
        MiB for a window of 2 and 1 MiB). One batch always fits an empty sink.
        """
        self._trim()
        while self._unacked and (
            len(self._unacked) >= self.window or self._unacked_bytes + size > self.window_bytes
        ):
            self._pump(len(self._unacked) - 1, deadline)
            self._trim()

    def _not_kept(self, exc: PushTableError, written: int) -> PushTableError:
        """``exc`` of a write whose batch found no room: it is not kept, nor ever sent."""
        if isinstance(exc, WriteTimeoutError):
            return timed_out(
                f"{exc}; the sink keeps {len(self._unacked)} batch(es) unacknowledged (its "
                "window is full)",
                written,
                kept=False,
            )
        own = copy.copy(exc)
        own.batches_written = written
        own.kept = False  # type: ignore[attr-defined]
        return own

    def _kept(self, exc: CommitFailedError, taken: int) -> CommitFailedError:
        """``exc`` saying what became of the batches: this sink keeps them, numbered.

        ``taken`` batches of the call are counted as written: they are sent again (same
        sequence numbers, stored once) by the next write or flush, so the producer must not
        write them again.
        """
        seqs = [s for s, _, _ in self._unacked]
        what = f"sequences {seqs[0]}..{seqs[-1]}" if seqs else "nothing"
        if taken:
            what += ", this call's included"
        kept = CommitFailedError(
            f"{exc}. Producer {self.producer_id!r} keeps its {len(seqs)} unacknowledged "
            f"batch(es) ({what}) and sends them again with its next write or flush: each is "
            "stored once; do not write them again"
        )
        kept.batches_written = taken
        kept.kept = True  # type: ignore[attr-defined]
        return kept

    def submit(self, item: Item, deadline: float | None) -> None:
        """As :meth:`RemoteSink.submit`, numbered: kept, and sent again, until stored.

        Submitting an item again (after a timeout) only goes on sending what is kept: it is
        numbered once.
        """
        if item.metadata is not None:
            raise NotImplementedError("advance() is not sent by an idempotent producer")
        with self._lock:
            self._refuse_closed()
            if item.sequence is None:
                size = batch_bytes(item.batch)
                self._room_for(size, deadline)  # a timeout: not taken yet, the next step tries
                item.sequence = self._next_sequence
                self._unacked.append((item.sequence, item.batch, size))
                self._unacked_bytes += size
                self._next_sequence += 1
                self._items[item.sequence] = item
            try:
                self._pump(None, deadline)
            except CommitFailedError as exc:  # kept, sent again: said as the sync face says it
                raise self._kept(exc, 1) from exc

    def tend(self, deadline: float | None) -> None:
        """Forget what is stored, and go on sending what is kept (reconnecting if need be).

        A stream that ended is asked why first: a refused batch's item is told, and the
        others go again on the next stream; another error that is not an outage is told to
        every item still waiting for its outcome.
        """
        with self._lock:
            self._trim()
            if not self._unacked:
                return
            put = self._put
            ended = put is not None and (put.finished or put.error is not None)
            try:
                self._pump(0 if ended else None, deadline)
            except PushTableError as exc:
                if getattr(exc, "gave_up", False):  # past ``retry``: every item hears it
                    for item in list(self._items.values()):
                        self.gave_up(item, exc)
                    raise
                if protocol.retriable(exc) or isinstance(exc, WriteTimeoutError):
                    raise
                if protocol.reopens(exc):
                    raise  # its streams were refused as they opened: every item is kept
                if getattr(exc, "refused_sequence", None) is not None:
                    raise  # the refused item is told; the others are kept, sent next time
                told: BaseException = exc
                if isinstance(exc, CommitFailedError):  # kept, sent again: not "not written"
                    told = self._kept(exc, 1)
                items, self._items = list(self._items.values()), {}
                for item in items:
                    item.settle(told)
                raise

    def flush(self, timeout: float | None = None) -> None:
        """Return once every batch written is stored; reconnects and resends as needed."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held(deadline, "flush"):
            self._fresh_outage()
            if self._closed:  # stored by its close, or failed: no new stream for it
                self._raise_unreported()
                return
            while True:
                try:
                    self._pump(0, deadline)
                except CommitFailedError as exc:
                    raise self._kept(exc, 0) from exc
                if not self._unacked:
                    self._raise_unreported()  # a batch no call waits for any more failed
                    return

    def close(self, timeout: float | None = None) -> None:
        """Flush, end this producer's stream, and close the topic (end of stream).

        ``timeout`` bounds the whole call, as :meth:`RemoteSink.close`'s does.
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._closed:
            return  # closed already: no stream is opened for it again
        self.flush(timeout)
        super().close(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def advance(self, ts: Any, timeout: float | None = None) -> None:
        """Not supported: an idempotent producer does not send ``advance()``."""
        raise NotImplementedError("advance() is not sent by an idempotent producer")
