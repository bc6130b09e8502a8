"""What became of a producer's message: the one form both faces (sync and asyncio) report.

An :class:`Item` is a message a remote producer sends, kept until its outcome is known. It is
claimed for the wire before it is written (:meth:`Item.claim`), so a producer that stops
waiting for it either withdraws it for good (:meth:`Item.withdraw`: it is never sent) or learns
that it was sent already, never both. :class:`Sent` is what a stream did with one;
:func:`timed_out` is the timeout that says so.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

import pyarrow as pa

from pushtable.errors import WriteTimeoutError
from pushtable.producer import batch_bytes

__all__ = ["Item", "Sent", "timed_out"]

#: one lock for every item's claim/withdraw pair: held for a flag's read and write only
_CLAIMS = threading.Lock()


class Sent(enum.Enum):
    """What :meth:`PutStream.send` did with an item."""

    #: written: gRPC took it (its acknowledgement comes later)
    SENT = "sent"
    #: in flight: claimed and being written when the caller's deadline passed; it goes on
    PENDING = "pending"
    #: not sent: its writer withdrew it first (it never will be)
    WITHDRAWN = "withdrawn"
    #: not sent: an earlier write still held the stream at the caller's deadline
    BUSY = "busy"


def timed_out(message: str, written: int, kept: bool) -> WriteTimeoutError:
    """A write's timeout, saying exactly what became of its batches (one form for both faces).

    ``kept``: the call's last batch is on its way or kept by the sink (it is stored unless the
    stream fails, which a later call reports; do not write it again), and ``written`` counts
    it. Otherwise no batch of the call past ``written`` was sent, nor ever will be.
    """
    if kept:
        message += (
            "; the batch is on its way, kept by the sink: a later flush() reports its "
            "outcome (do not write it again)"
        )
    else:
        message += "; the batch was not sent, and never will be"
    error = WriteTimeoutError(message)
    error.batches_written = written
    error.kept = kept  # type: ignore[attr-defined]
    return error


class Item:
    """A message a producer sends (a batch, or an ``advance``), until its outcome is known.

    ``outcome`` (if any) is called once, from whichever thread learns it: with None when an
    acknowledgement covers the item, with the error when the server refused it or the stream
    ended with it unacknowledged and unsendable. Calls without a callback keep the error in
    :attr:`error` for the producer's next call to raise.
    """

    __slots__ = (
        "batch",
        "claimed",
        "error",
        "handed",
        "metadata",
        "nbytes",
        "outcome",
        "sequence",
        "settled",
        "withdrawn",
    )

    def __init__(
        self,
        batch: pa.RecordBatch,
        metadata: bytes | None = None,
        outcome: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.batch = batch
        self.metadata = metadata
        self.outcome = outcome
        self.error: BaseException | None = None
        self.settled = False
        #: an idempotent producer's number for it, once it has one
        self.sequence: int | None = None
        #: its writer stopped waiting for it before it was claimed: it is never sent
        self.withdrawn = False
        #: handed to a stream's wire at least once (a withdrawal no longer holds)
        self.claimed = False
        #: the bytes it references: what it weighs in a window bounded in bytes
        self.nbytes = batch_bytes(batch)
        #: its writer was told it is kept (:meth:`hand_over`): told once
        self.handed = False

    def withdraw(self) -> bool:
        """Its writer stops waiting: True if it is never sent, False if it was sent already."""
        with _CLAIMS:
            if not self.claimed:
                self.withdrawn = True
            return self.withdrawn

    def claim(self) -> bool:
        """Take it for the wire: False if its writer withdrew it (it must not be sent)."""
        with _CLAIMS:
            if not self.withdrawn:
                self.claimed = True
            return self.claimed

    def hand_over(self, outcome: Callable[[BaseException | None], None]) -> None:
        """Its writer was told it is kept (settled): its final outcome goes to ``outcome``."""
        self.handed = True
        self.settled = False
        self.error = None
        self.outcome = outcome

    def settle(self, error: BaseException | None) -> None:
        """Record the item's outcome and tell its callback (once)."""
        if self.settled:
            return
        self.settled = True
        self.error = error
        if self.outcome is not None:
            self.outcome(error)
