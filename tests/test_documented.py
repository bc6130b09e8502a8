"""Documented behaviours that had no test: each one here as the docs state it.

- docs/semantics.md: ``fail()`` after the reader finished is ignored (``sink.error`` stays None);
  ``sql_with_options`` keeps pushtable's error classes.
- docs/network.md: ``pushtable serve`` takes its token from ``$PUSHTABLE_TOKEN``; a config
  file's ``"topics"`` declare durable topics with ``retention_seconds`` and
  ``commit_interval``.
- README / pushtable/cpu.py: ``PUSHTABLE_CPU_CHECK=0`` turns the CPU check off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa
import pytest

from pushtable import SessionContext, UnauthenticatedError, UnboundedQueryError
from pushtable.flight import connect
from tests.conftest import SCHEMA, batch, query, serve_process


def test_fail_after_the_reader_finished_is_ignored(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    reader = query(ctx, "SELECT count(*) AS n FROM t")
    sink.write(batch(3))
    sink.close()
    assert reader.join() == {"n": [3]}
    sink.fail(RuntimeError("too late"))  # the query has its whole answer already
    assert sink.error is None
    assert not sink.stats.failed


def test_sql_with_options_keeps_the_error_classes(ctx: SessionContext) -> None:
    ctx.register_streaming_table("t", SCHEMA, unbounded=True)
    options = datafusion.SQLOptions()
    refused = "SELECT k, count(*) FROM t GROUP BY k HAVING count(*) > 1"  # never final
    with pytest.raises(UnboundedQueryError, match="HAVING") as through_options:
        ctx.sql_with_options(refused, options)
    with pytest.raises(UnboundedQueryError) as through_sql:
        ctx.sql(refused)
    assert str(through_options.value) == str(through_sql.value)  # the same refusal


def test_serve_takes_its_token_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PUSHTABLE_TOKEN", "from-the-env")
    with serve_process({}, tmp_path) as (_, location):
        with pytest.raises(UnauthenticatedError), connect(location) as anonymous:
            anonymous.tables()
        with connect(location, token="from-the-env") as client:
            assert client.tables() == []


def test_a_config_files_topics_are_durable_with_their_retention_and_commit_interval(
    tmp_path: Path,
) -> None:
    config: dict[str, Any] = {
        "topics": [
            {
                "name": "ticks",
                "schema": {"k": "int64", "v": "double"},
                "durable": True,
                "retention_seconds": 3600,
                "commit_interval": 0.05,
            }
        ]
    }
    data = tmp_path / "data"
    with (
        serve_process(config, tmp_path, "--data-dir", str(data)) as (_, location),
        connect(location) as client,
    ):
        [ticks] = [t for t in client.tables() if t["name"] == "ticks"]
        assert ticks["durable"]
        assert ticks["topic"]
        sink = client.sink("ticks", producer_id="p")
        sink.write(pa.record_batch({"k": [1, 2], "v": [0.5, 1.5]}))
        sink.flush()
        assert client.offsets("ticks")["committed"] == 1
    from pushtable import Topic

    again = Topic.reopen(data / "ticks.lance", upkeep_interval=None)
    try:
        assert again.durable is not None
        assert again.durable.retention == timedelta(seconds=3600)  # stored with the topic
        assert again.durable.commit_interval == 0.05
        assert again.offsets()["committed"] == 1
    finally:
        again.close()


def test_the_cpu_check_is_turned_off_by_the_environment() -> None:
    """``PUSHTABLE_CPU_CHECK=0`` skips the check: with the check forced to find a CPU
    without AVX2, the import fails naming the switch, and passes with it set."""
    code = (
        "import pushtable.cpu as c; c.missing_features = lambda _: ['AVX2']; c.check(); "
        "print('imported')"
    )
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "lacks AVX2" in refused.stderr
    assert "PUSHTABLE_CPU_CHECK=0" in refused.stderr
    env = {**os.environ, "PUSHTABLE_CPU_CHECK": "0"}
    allowed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert allowed.stdout.strip() == "imported", allowed.stderr
