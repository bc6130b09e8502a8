"""Smoke test of an installed pushtable wheel: register, write, query, join with Lance.

CI runs it in a fresh venv without Rust, from outside the clone, so the import below finds
the installed wheel and never the source tree: ``python tests/wheel_smoke.py``.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path


def main() -> None:
    import lance
    import pyarrow as pa

    import pushtable
    from pushtable import SessionContext

    where = Path(pushtable.__file__).resolve()
    assert "site-packages" in where.parts, f"pushtable imported from {where}, not the wheel"
    ctx = SessionContext()
    with tempfile.TemporaryDirectory() as tmp:
        names = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "name": ["a", "b", "c"]})
        dataset = lance.write_dataset(names, f"{tmp}/names.lance")
        ctx.register_table("names", lance.FFILanceTableProvider(dataset))
        schema = pa.schema([("id", pa.int64()), ("v", pa.float64())])
        sink = ctx.register_streaming_table("events", schema, capacity=2)

        def produce() -> None:
            with sink:
                for i in range(6):
                    sink.write(pa.record_batch({"id": [i % 3 + 1], "v": [float(i)]}, schema=schema))

        producer = threading.Thread(target=produce)
        producer.start()
        sql = "SELECT n.name, sum(e.v) AS total FROM events e JOIN names n ON e.id = n.id "
        got = ctx.sql(sql + "GROUP BY n.name ORDER BY n.name").to_pydict()
        producer.join(30)
        assert not producer.is_alive(), "producer still blocked"
    expected = {"name": ["a", "b", "c"], "total": [3.0, 5.0, 7.0]}
    assert got == expected, got
    from importlib import resources

    page = resources.files("pushtable.flight.server").joinpath("static").joinpath("index.html")
    assert page.is_file(), "the browser view's page is not in the wheel"
    print(f"wheel smoke test passed: pushtable {pushtable.__version__} from {where.parent}")


if __name__ == "__main__":
    main()
    sys.exit(0)
