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
