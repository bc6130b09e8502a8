"""The server a user would write instead of ``pushtable serve --data-dir``: a bench peer.

A pyarrow Flight server whose DoPut appends the stream to a Lance dataset named by the
descriptor's path (``<dir>/<name>.lance``): a committer thread takes every batch received
since its last commit, writes them with ``lance.fragment.write_fragments``, commits one
``Append`` and fsyncs both as a durable topic's commit is, then acknowledges the batches stored
so far on the stream's metadata (their count, as text). Receiving overlaps the commit in flight,
as a competent hand-rolled server would. Buffers the network left unaligned (Lance's writer
panics on them) are copied with the same copy-only-what-is-off helper a durable topic uses. It
validates nothing beyond what pyarrow's reader does, stamps nothing, sequences no producers and
serves no readers.

Run as ``python -m pushtable.bench.lance_flight --dir D [--storage-version 2.1]
[--storage-options JSON]``: it prints its location and serves until killed. ``D`` may be a
local folder or an object store's URI (``s3://bucket/prefix``, with the store's options).
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.flight as flight

from pushtable.lance_commits import sync_commit, sync_fragments
from pushtable.lance_epochs import aligned

#: batches the receiving side may hold ahead of the committer (then it waits)
QUEUED = 1024


def append_synced(
    ds: lance.LanceDataset, uri: str, data: Any, storage_options: dict[str, str] | None = None
) -> lance.LanceDataset:
    """Lance's own append of ``data`` (a table or a reader); the new version's dataset.

    ``write_fragments`` and one commit, each fsync'd as a durable topic's commit is (data
    files and directory, then the manifest, transaction and directories; on an object store,
    the puts of the commit are its durability).
    """
    fragments = lance.fragment.write_fragments(
        data, uri, schema=ds.schema, storage_options=storage_options
    )
    sync_fragments(uri, fragments)
    before = time.time_ns()
    op = lance.LanceOperation.Append(fragments)
    ds = lance.LanceDataset.commit(ds, lance.Transaction(ds.version, op))
    sync_commit(ds, before)
    return ds


class LanceFlightServer(flight.FlightServerBase):  # type: ignore[misc]
    """DoPut: group-commit the stream into a Lance dataset, acknowledging each commit."""

    def __init__(
        self,
        location: str,
        root: str,
        storage_version: str | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        super().__init__(location)
        self.root = root.rstrip("/")
        #: the Lance file version of the datasets it creates (None: Lance's default)
        self.storage_version = storage_version
        self.storage_options = storage_options

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """Append the stream to ``<root>/<path>.lance``; acknowledge after each commit."""
        uri = f"{self.root}/{descriptor.path[0].decode()}.lance"
        ds = lance.write_dataset(
            reader.schema.empty_table(),
            uri,
            mode="create",
            data_storage_version=self.storage_version,  # type: ignore[arg-type]
            storage_options=self.storage_options,
        )
        pending: queue.Queue[pa.RecordBatch | None] = queue.Queue(QUEUED)
        failed: list[BaseException] = []

        def commit_loop() -> None:
            nonlocal ds
            stored = 0
            end = False
            while not end:
                group = [pending.get()]
                while True:
                    try:
                        group.append(pending.get_nowait())
                    except queue.Empty:
                        break
                end = group[-1] is None
                batches = [b for b in group if b is not None]
                if not batches:
                    continue
                try:
                    table = aligned(pa.Table.from_batches(batches))
                    ds = append_synced(ds, uri, table, self.storage_options)
                except BaseException as exc:  # noqa: BLE001 (reported to the client below)
                    failed.append(exc)
                    return
                stored += len(batches)
                writer.write(pa.py_buffer(str(stored).encode()))

        committer = threading.Thread(target=commit_loop, daemon=True)
        committer.start()
        while not failed:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            pending.put(chunk.data)
        pending.put(None)
        committer.join()
        if failed:
            raise flight.FlightServerError(f"commit failed: {failed[0]}")


def put_timed(uri: str, schema: pa.Schema, batches: list[pa.RecordBatch]) -> float:
    """Seconds for one DoPut of ``batches`` to the server at ``uri``, to its last acknowledgement.

    Through pyarrow's own client, as a user of the hand-rolled server would send them.
    """
    client = flight.FlightClient(uri)
    started = time.perf_counter()
    writer, acks = client.do_put(flight.FlightDescriptor.for_path("t"), schema)
    for batch in batches:
        writer.write_batch(batch)
    writer.done_writing()
    stored = 0
    while stored < len(batches):
        buf = acks.read()
        if buf is None:
            raise RuntimeError(f"the peer acknowledged {stored} of {len(batches)} batches")
        stored = int(buf.to_pybytes())
    elapsed = time.perf_counter() - started
    writer.close()
    client.close()
    return elapsed


def main() -> None:
    """Serve on a free loopback port until stopped; print the address."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a folder or an object store's URI")
    parser.add_argument("--storage-version", help="Lance file version (default: Lance's)")
    parser.add_argument("--storage-options", help="the store's options, as a JSON object")
    args = parser.parse_args()
    if "://" not in args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    options = None if args.storage_options is None else json.loads(args.storage_options)
    server = LanceFlightServer("grpc://127.0.0.1:0", args.dir, args.storage_version, options)
    print(f"lance flight: listening on grpc://127.0.0.1:{server.port}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
