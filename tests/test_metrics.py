"""Prometheus metrics: ``pushtable serve --metrics-port`` scraped during a load, checked
against the tables' own ``stats``; the in-process registry for embedders."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pushtable import ResourceLimitError, SessionContext, SinkStats, metrics
from pushtable.flight import Limits, Server, connect, serve
from tests.conftest import SCHEMA, WAIT, Background, batch, wait_until


def scrape(
    url: str, token: str | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=WAIT) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_scraped_during_a_load_match_the_tables_stats() -> None:
    server = serve("127.0.0.1", 0, metrics_port=0, block=False, say=lambda _: None)
    try:
        url = server.metrics_url
        assert url is not None
        sink = server.create_table("events", SCHEMA, capacity=2)
        with connect(server.location, timeout=WAIT) as client:
            result = client.sql("SELECT count(*) AS n FROM events")
            producer = client.sink("events", window=4)
            for i in range(20):
                producer.write(batch(100, start=i * 100), timeout=WAIT)
            producer.flush(timeout=WAIT)
            wait_until(lambda: sink.stats.batches == 20, "the 20 batches queued")
            got = scrape(url)
            stats = sink.stats
            table = (("session", server.ctx.session_id()), ("table", "events"))
            assert got[("pushtable_rows_written_total", table)] == stats.rows == 2000
            assert got[("pushtable_batches_written_total", table)] == stats.batches
            assert got[("pushtable_bytes_written_total", table)] == stats.bytes
            assert got[("pushtable_queue_bound_batches", table)] == 2
            where = (("server", server.location),)
            assert got[("pushtable_server_active_queries", where)] == 1
            assert got[("pushtable_server_active_streams", where)] == 2  # the DoGet and the DoPut
            acks = got[("pushtable_write_ack_seconds_count", ())]
            assert acks >= 20 // 2  # a window of 4 asks for one every 2nd batch
            calls = ("pushtable_server_calls_total", (("action", "do_put"), ("outcome", "ok")))
            before = got.get(calls, 0.0)
            producer.close()
            assert result.read_all().to_pydict() == {"n": [2000]}
            after = scrape(url)
            assert after[calls] >= before + 1  # the DoPut call ended and was counted
            first = after[("pushtable_query_first_result_seconds_count", ())]
            assert first >= 1
    finally:
        server.stop()


def test_refusals_are_counted_by_reason() -> None:
    server = Server(limits=Limits(max_capacity=4))
    try:
        with connect(server.location, timeout=WAIT) as client:
            refused = Background(lambda: client.create_table("t", SCHEMA, capacity=5)).join_error()
            assert isinstance(refused, ResourceLimitError), refused
            assert "max_capacity" in str(refused)
        from prometheus_client import generate_latest

        text = generate_latest(metrics.REGISTRY).decode()
        refusals = {
            tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "pushtable_server_refusals_total"
        }
        assert refusals[(("reason", "table_options"), ("server", server.location))] == 1
    finally:
        server.stop()


def test_embedders_read_the_same_registry() -> None:
    from prometheus_client import generate_latest

    ctx = SessionContext()
    sink = ctx.register_streaming_table("embedded_metrics_t", pa.schema([("v", pa.int64())]))
    sink.write(pa.record_batch([pa.array([1, 2, 3])], names=["v"]))
    text = generate_latest(metrics.REGISTRY).decode()
    labels = f'session="{ctx.session_id()}",table="embedded_metrics_t"'
    assert f"pushtable_rows_written_total{{{labels}}} 3.0" in text
    assert f"pushtable_queued_batches{{{labels}}} 1.0" in text
    # Another session's table of the same name is another series.
    other = SessionContext()
    kept = other.register_streaming_table("embedded_metrics_t", pa.schema([("v", pa.int64())]))
    again = generate_latest(metrics.REGISTRY).decode()
    assert f"pushtable_rows_written_total{{{labels}}} 3.0" in again
    assert f'session="{other.session_id()}",table="embedded_metrics_t"}} 0.0' in again
    assert kept.stats.rows == 0


def test_bytes_copied_to_align_a_batch_are_counted_in_stats_and_metrics() -> None:
    """A batch built in memory is never copied; one whose int64 buffer starts one byte off (as
    data read from the wire or an IPC file can) is, and the copy is counted."""
    schema = pa.schema([("v", pa.int64()), ("s", pa.string())])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("aligned", schema, capacity=8)
    sink.write(pa.record_batch({"v": [1, 2, 3], "s": ["a", None, "c"]}, schema=schema))
    assert (sink.stats.realigned_batches, sink.stats.realigned_bytes) == (0, 0)
    raw = pa.py_buffer(b"\0" + b"".join(i.to_bytes(8, "little") for i in (4, 5, 6))).slice(1)
    assert raw.address % 8 != 0
    off = pa.Array.from_buffers(pa.int64(), 3, [None, raw])
    sink.write(pa.record_batch([off, pa.array(["d", "e", None])], schema=schema))
    assert (sink.stats.realigned_batches, sink.stats.realigned_bytes) == (1, 24)
    from prometheus_client import generate_latest

    text = generate_latest(metrics.REGISTRY).decode()
    labels = f'session="{ctx.session_id()}",table="aligned"'
    assert f"pushtable_realigned_bytes_total{{{labels}}} 24.0" in text
    sink.close()
    assert ctx.sql("SELECT sum(v) AS v FROM aligned").to_pydict() == {"v": [21]}


def test_a_client_keeps_the_counters_it_knows_of_a_newer_servers_stats() -> None:
    counters = dict(vars(SessionContext().register_streaming_table("t", SCHEMA).stats))
    counters["counted_by_a_newer_server"] = 7
    assert SinkStats.known(counters) == SinkStats(
        **{k: v for k, v in counters.items() if k != "counted_by_a_newer_server"}
    )


def test_metrics_take_the_servers_tokens_and_show_each_only_its_tables(tmp_path: Path) -> None:
    """``/metrics`` (its own port and the browser view's) answered anyone, with every table and
    topic name; on a server with tokens it now takes a bearer token, and a scoped token sees
    only the samples of its own tables (a real server started by ``serve``)."""
    config = tmp_path / "serve.json"
    config.write_text(
        json.dumps(
            {
                "tokens": [
                    {"name": "ops", "secret": "ops-secret", "role": "admin"},
                    {
                        "name": "alerts",
                        "secret": "alerts-secret",
                        "role": "read",
                        "tables": ["al*"],
                    },
                ],
                "tables": [
                    {"name": "alerts", "schema": {"k": "int64"}},
                    {"name": "payroll_secret", "schema": {"k": "int64"}},
                    # a label cut at its first "}" was never seen: shown to every token
                    {"name": "payroll}2026", "schema": {"k": "int64"}},
                ],
            }
        )
    )
    server = serve(
        "127.0.0.1", 0, config=config, metrics_port=0, ui_port=0, block=False, say=lambda _: None
    )
    try:
        assert server.metrics_url is not None
        assert server.ui_url is not None
        for url in (server.metrics_url, server.ui_url + "metrics"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=WAIT)
            assert refused.value.code == 401
            wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(wrong, timeout=WAIT)
            everything = scrape(url, "ops-secret")
            tables = {dict(labels).get("table") for _, labels in everything}
            assert {"alerts", "payroll_secret", "payroll}2026"} <= tables
            scoped = scrape(url, "alerts-secret")
            seen = {dict(labels).get("table") for _, labels in scoped} - {None}
            assert seen == {"alerts"}, seen
            assert ("pushtable_rows_written_total", ()) not in scoped
            text = raw(url, "alerts-secret")
            assert "payroll_secret" not in text
            assert "payroll}2026" not in text
    finally:
        server.stop()


def raw(url: str, token: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=WAIT) as response:
        return str(response.read().decode())


def test_idle_connections_on_the_http_ports_are_bounded_before_any_token(tmp_path: Path) -> None:
    """1,011 idle connections on the metrics port held a thread and a descriptor each, with
    no read timeout and no bound, until another tenant's call failed with EMFILE. Past
    ``MAX_HTTP_CONNECTIONS`` a connection is closed before it is read, and an idle one is
    closed after ``HTTP_TIMEOUT_S``: 100 idle sockets add at most that many threads, and a
    scrape still answers once they are let go."""
    import contextlib
    import socket
    import threading

    from pushtable.flight.server import ui

    server = serve("127.0.0.1", 0, metrics_port=0, block=False, say=lambda _: None)
    assert server.metrics_url is not None
    idle: list[socket.socket] = []
    try:
        assert server.metrics_url is not None
        port = int(server.metrics_url.rsplit(":", 1)[1].split("/")[0])
        before = threading.active_count()
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
        wait_until(
            lambda: threading.active_count() - before >= ui.MAX_HTTP_CONNECTIONS // 2,
            "the idle connections to take their threads",
        )
        assert threading.active_count() - before <= ui.MAX_HTTP_CONNECTIONS + 2
        refused = 0
        for conn in idle:  # those past the bound were closed at once
            conn.settimeout(0.05)
            with contextlib.suppress(TimeoutError):
                refused += conn.recv(1) == b""
        assert refused >= 100 - ui.MAX_HTTP_CONNECTIONS - 2, refused
    finally:
        for conn in idle:
            conn.close()
    url = server.metrics_url
    try:
        wait_until(lambda: bool(scrape(url)), "a scrape once they are gone")
    finally:
        server.stop()
