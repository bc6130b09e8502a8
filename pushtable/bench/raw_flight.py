"""A bare pyarrow Flight server: the wire's own speed, for the ``flight`` suite to compare with.

DoPut reads every chunk and drops it (what the wire and pyarrow's reader cost, nothing of
pushtable's). DoGet serves the batches a ``hold`` action made beforehand
(``{"rows": r, "batches": n}``: the same ``n`` distinct batches the suite writes into
pushtable's table, so that both ways out read as much memory), through pyarrow's own
``RecordBatchStream``. Run as ``python -m pushtable.bench.raw_flight``: it prints its location
and serves until killed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])


def batches(rows: int, count: int, seed: int) -> list[pa.RecordBatch]:
    """``count`` batches of ``rows`` rows: ``k`` = 0.. (one array shared), ``v`` random."""
    rng = np.random.default_rng(seed)
    k = pa.array(np.arange(rows, dtype=np.int64))
    return [pa.record_batch([k, pa.array(rng.random(rows))], schema=SCHEMA) for _ in range(count)]


class RawServer(flight.FlightServerBase):  # type: ignore[misc]
    """DoPut: read and drop; DoGet: the batches the last ``hold`` action made."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self._held: tuple[Any, list[pa.RecordBatch]] = (None, [])

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """Read every batch of the stream and drop it."""
        while True:
            try:
                reader.read_chunk()
            except StopIteration:
                return

    def do_action(self, context: Any, action: Any) -> Any:
        """The ``hold`` action: make the batches that DoGet then serves (``rows``, ``batches``)."""
        if action.type != "hold":
            raise flight.FlightServerError(f"unknown action {action.type!r}: only 'hold'")
        ask = json.loads(action.body.to_pybytes())
        rows, count = int(ask["rows"]), int(ask["batches"])
        self._held = (None, [])  # the old batches go before the new ones are made
        self._held = ((rows, count), batches(rows, count, 1))
        return []

    def do_get(self, context: Any, ticket: Any) -> Any:
        """The held batches, when the ticket asks for those the last ``hold`` made."""
        ask = json.loads(ticket.ticket)
        key, held = self._held
        if key != (int(ask["rows"]), int(ask["batches"])):
            raise flight.FlightServerError(f"no batches held for {ask}: call the 'hold' action")
        return flight.RecordBatchStream(pa.Table.from_batches(held, schema=SCHEMA))


def main() -> None:
    """Serve a bare Flight server on a free loopback port until stopped; print its address."""
    server = RawServer("grpc://127.0.0.1:0")
    print(f"raw flight: listening on grpc://127.0.0.1:{server.port}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
