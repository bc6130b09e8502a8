"""A live table and a persisted Lance dataset in one SQL statement (same DataFusion FFI major)."""

from __future__ import annotations

from pathlib import Path

import lance
import pyarrow as pa

from pushtable import SessionContext
from tests.conftest import SCHEMA, batch, query


def test_live_table_joins_a_lance_dataset(tmp_path: Path) -> None:
    names = pa.table({"k": pa.array([0, 1, 2], pa.int32()), "name": ["zero", "one", "two"]})
    dataset = lance.write_dataset(names, str(tmp_path / "names.lance"))
    ctx = SessionContext()
    ctx.register_table("names", lance.FFILanceTableProvider(dataset))
    sink = ctx.register_streaming_table("live", SCHEMA)
    reader = query(
        ctx,
        "SELECT n.name, sum(l.v) AS total FROM live l JOIN names n ON l.k = n.k "
        "GROUP BY n.name ORDER BY n.name",
    )
    sink.write(batch(3))
    sink.write(batch(3))
    sink.close()
    assert reader.join() == {"name": ["one", "two", "zero"], "total": [0.2, 0.4, 0.0]}


def test_a_lance_dataset_registers_as_it_is(tmp_path: Path) -> None:
    """A plain LanceDataset goes through Lance's own provider: read at rest, and joined by the
    live engine (an unbounded ordered window query runs nowhere else)."""
    names = pa.table({"k": pa.array([0, 1], pa.int32()), "name": ["zero", "one"]})
    dataset = lance.write_dataset(names, str(tmp_path / "names.lance"))
    ctx = SessionContext()
    ctx.register_table("names", dataset)
    assert ctx.sql("SELECT name FROM names ORDER BY k").to_pydict() == {"name": ["zero", "one"]}
    schema = pa.schema([("ts", pa.int64()), ("k", pa.int32())])
    sink = ctx.register_streaming_table("t", schema, order_by="ts", unbounded=True)
    reader = query(
        ctx,
        "SELECT t.ts / 10 AS w, n.name, count(*) AS c FROM t JOIN names n ON t.k = n.k "
        "GROUP BY 1, 2 ORDER BY 1, 2",
    )
    sink.write(
        pa.record_batch(
            [pa.array([1, 2, 3, 11]), pa.array([0, 1, 0, 1], pa.int32())], schema=schema
        )
    )
    sink.close()
    assert reader.join() == {"w": [0, 0, 1], "name": ["one", "zero", "one"], "c": [1, 2, 1]}
