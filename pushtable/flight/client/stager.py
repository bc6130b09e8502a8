"""The Spark bridge's producer: :class:`Stager` sends one task attempt's share of an epoch.

The server holds the share in its stage area until the driver publishes the epoch (see
:mod:`pushtable.spark.remote`).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import PushTableError
from pushtable.flight import protocol
from pushtable.flight.client.put_stream import PutStream
from pushtable.flight.client.transport import Transport

__all__ = ["Stager"]


class Stager:
    """One Spark task attempt's share of an epoch, sent to the server's stage area."""

    def __init__(self, transport: Transport, path: list[str], schema: pa.Schema) -> None:
        self._table = path[0]
        self._schema = schema
        self._wire_schema = protocol.wire_schema(schema)
        self._put = PutStream(transport, flight.FlightDescriptor.for_path(*path), self._wire_schema)

    def write(self, batch: pa.RecordBatch) -> None:
        """Send ``batch`` to the stage area, checked against the share's schema first."""
        batch = protocol.to_wire(self._table, self._schema, self._wire_schema, batch)
        try:
            self._put.send(batch)
        except PushTableError:
            self._put.finish(timeout=30.0)  # the server's reason, if it gave one
            raise

    def finish(self) -> None:
        """End the share; returns once the server holds all of it (raises its error)."""
        self._put.finish()
