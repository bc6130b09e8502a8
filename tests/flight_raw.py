"""Raw Flight messages for hostile-input tests: what pyarrow's own client refuses to send
(an IPC stream whose schema changes mid-stream, a batch that lies about its length, garbage
headers), sent with grpcio straight to ``FlightService/DoPut``."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence

import grpc  # type: ignore[import-untyped]
import pyarrow as pa

from pushtable.flight.server.sql import bytes_field, varint

DO_PUT = "/arrow.flight.protocol.FlightService/DoPut"


def path_descriptor(path: Iterable[bytes]) -> bytes:
    """``FlightDescriptor{type: PATH, path: [...]}``."""
    return varint(1 << 3) + varint(1) + b"".join(bytes_field(3, p) for p in path)


def flight_data(
    header: bytes = b"", body: bytes = b"", descriptor: bytes | None = None, metadata: bytes = b""
) -> bytes:
    """One ``FlightData`` message."""
    out = b"" if descriptor is None else bytes_field(1, descriptor)
    if header:
        out += bytes_field(2, header)
    if metadata:
        out += bytes_field(3, metadata)
    if body:
        out += bytes_field(1000, body)
    return out


def ipc_messages(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> list[tuple[bytes, bytes]]:
    """The IPC messages (flatbuffer header, body) of a stream: schema first, then batches."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for b in batches:
            writer.write_batch(b)
    reader = pa.ipc.MessageReader.open_stream(sink.getvalue())
    out = []
    for message in reader:
        body = message.body
        out.append((message.metadata.to_pybytes(), b"" if body is None else body.to_pybytes()))
    return out


def lie_about_length(header: bytes, true_rows: int, claimed_rows: int) -> bytes:
    """A record batch header whose row and node lengths claim ``claimed_rows``."""
    return header.replace(struct.pack("<q", true_rows), struct.pack("<q", claimed_rows))


def do_put(
    target: str,
    messages: Iterator[bytes],
    timeout: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> tuple[str, str]:
    """Send raw ``FlightData`` messages; returns (status code name, details), "OK" if none."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            DO_PUT, request_serializer=lambda m: m, response_deserializer=lambda m: m
        )
        try:
            for _ in call(messages, timeout=timeout, metadata=metadata):
                pass
        except grpc.RpcError as exc:
            return exc.code().name, str(exc.details())
    return "OK", ""
