"""The live engine's runtime is sized from the machine (or ``PUSHTABLE_ENGINE_THREADS``), and
a runtime that cannot start is an error for the query that needs it, never a crash.

The runtime belongs to the process, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WAIT

CHILD = textwrap.dedent(
    """
    import json, os, pyarrow as pa
    from pushtable import SessionContext
    from pushtable.engine import engine_threads

    out = {"cores": len(os.sched_getaffinity(0))}
    try:
        out["threads"] = engine_threads()
    except ValueError as exc:
        out["threads_error"] = str(exc)
    ctx = SessionContext()
    schema = pa.schema([("t", pa.int64()), ("v", pa.int64())])
    sink = ctx.register_streaming_table("e", schema, order_by="t")
    try:
        # A window over the table's order: only the live engine answers it as windows close.
        df = ctx.sql("SELECT t / 10 AS w, sum(v) AS s FROM e GROUP BY t / 10")
        stream = df.execute_stream()
        sink.write(pa.record_batch({"t": [1, 2, 11, 12, 25], "v": [1, 2, 3, 4, 5]}))
        sink.close()
        got = [r for b in stream for r in b.to_pyarrow().to_pylist()]
        out["result"] = sorted((r["w"], r["s"]) for r in got)
        out["engine_threads_alive"] = sum(
            1
            for task in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{task}/comm").read().startswith("pushtable-engi")
        )
    except Exception as exc:
        out["query_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    """
)


def run_child(threads: str | None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("PUSHTABLE_ENGINE_THREADS", None)
    if threads is not None:
        env["PUSHTABLE_ENGINE_THREADS"] = threads
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=WAIT * 4,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_engine_takes_the_cores_this_process_may_use() -> None:
    out = run_child(None)
    assert out["threads"] == out["cores"]
    assert out["result"] == [[0, 3], [1, 7], [2, 5]]
    assert out["engine_threads_alive"] == out["cores"]


def test_the_setting_overrides_the_core_count() -> None:
    out = run_child("3")
    assert out["threads"] == 3
    assert out["result"] == [[0, 3], [1, 7], [2, 5]]
    assert out["engine_threads_alive"] == 3


@pytest.mark.parametrize("bad", ["0", "many", "-2"])
def test_a_bad_setting_is_an_error_for_the_live_query_not_a_crash(bad: str) -> None:
    out = run_child(bad)
    message = f"PUSHTABLE_ENGINE_THREADS={bad!r}: expected a whole number of threads >= 1"
    assert out["threads_error"] == message.replace("'", '"')
    assert out["query_error"] == "ValueError: " + message.replace("'", '"')
