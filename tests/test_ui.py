"""The browser view of ``pushtable serve --ui-port``: a real headless Chromium (Debian's
``chromium`` and ``chromium-driver``, which ``.ci/run`` installs) driven by Selenium sees rows
written after the page opened; the HTTP API behind it enforces the token like Flight does."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pushtable.flight import Server, connect, serve
from tests.conftest import WAIT

TS = pa.timestamp("ms", tz="UTC")
SCHEMA = pa.schema([("ts", TS), ("k", pa.int64()), ("v", pa.int64())])
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def rows(second: float, ks: list[int]) -> pa.RecordBatch:
    ts = [T0 + timedelta(seconds=second + i / 1000) for i in range(len(ks))]
    return pa.record_batch(
        [pa.array(ts, TS), pa.array(ks, pa.int64()), pa.array([1] * len(ks), pa.int64())],
        schema=SCHEMA,
    )


def _serve_with_tokens(tmp_path: Path) -> Server:
    config = tmp_path / "serve.json"
    tokens = [
        {"name": "dashboard", "secret": "reader-token", "role": "read"},
        {"name": "ingest", "secret": "writer-token", "role": "write"},
    ]
    config.write_text(json.dumps({"tokens": tokens}))
    return serve("127.0.0.1", 0, config=config, ui_port=0, block=False, say=lambda _: None)


def _post(url: str, body: str, token: str | None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=WAIT) as reply:
        return [json.loads(line) for line in reply.read().splitlines()]


def test_the_api_answers_only_what_the_token_allows(tmp_path: Path) -> None:
    server = _serve_with_tokens(tmp_path)
    try:
        assert server.ui_url is not None
        sink = server.create_table("events", SCHEMA, capacity=4, order_by="ts")
        sink.write(rows(0, [1, 2]))
        with pytest.raises(urllib.error.HTTPError) as no_token:
            urllib.request.urlopen(server.ui_url + "api/tables", timeout=WAIT)
        assert no_token.value.code == 401
        request = urllib.request.Request(
            server.ui_url + "api/tables", headers={"Authorization": "Bearer reader-token"}
        )
        with urllib.request.urlopen(request, timeout=WAIT) as reply:
            [table] = json.loads(reply.read())
        assert table["name"] == "events"
        assert table["stats"]["rows"] == 2  # the page's figures are the table's own stats
        assert table["stats"]["queued_batches"] == 1
        assert table["bound_batches"] == 4  # the queue fill: 1 of 4
        # A read token runs read-only SQL only: the server's own planning refuses the rest.
        refused = _post(server.ui_url + "api/query", "DROP TABLE events", "reader-token")
        assert "error" in refused[0], refused
        with connect(server.location, token="reader-token", timeout=WAIT) as client:
            assert [t["name"] for t in client.tables()] == ["events"]
        with pytest.raises(urllib.error.HTTPError) as no_token:  # metrics take the tokens too
            urllib.request.urlopen(server.ui_url + "metrics", timeout=WAIT)
        assert no_token.value.code == 401
        scrape = urllib.request.Request(
            server.ui_url + "metrics", headers={"Authorization": "Bearer reader-token"}
        )
        with urllib.request.urlopen(scrape, timeout=WAIT) as reply:
            assert b"pushtable_rows_written_total" in reply.read()
    finally:
        server.stop()


def _browser() -> Any:
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no Chromium here (apt-get install chromium chromium-driver; .ci/run installs them)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,1000")
    service = webdriver.ChromeService(executable_path=driver)
    return webdriver.Chrome(options=options, service=service)


@contextlib.contextmanager
def served_page(tmp_path: Path) -> Iterator[tuple[Server, Any, str]]:
    """A server with its browser view, a headless browser and the view's URL; both stopped
    after (the browser first)."""
    server = _serve_with_tokens(tmp_path)
    browser = None
    try:
        assert server.ui_url is not None
        browser = _browser()
        yield server, browser, server.ui_url
    finally:
        if browser is not None:
            browser.quit()
        server.stop()


def text_of(browser: Any, selector: str) -> str:
    """The text of the element ``selector`` names, read in one step inside the page ("" if
    absent). The page re-renders its lists as data arrives, so an element found first and read
    afterwards may be gone by then (Selenium's StaleElementReferenceException)."""
    text = browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", selector
    )
    return str(text)


def run_query_on_the_page(browser: Any, url: str, sql_text: str) -> Any:
    """Open the page, type the read token, wait for the table list, run ``sql_text``;
    returns the WebDriverWait for what comes next."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.set_page_load_timeout(WAIT)
    browser.get(url)
    wait = WebDriverWait(browser, WAIT)
    token = browser.find_element(By.ID, "token")
    token.send_keys("reader-token")
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", token)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#tables tr[data-table=events]"))
    sql = browser.find_element(By.ID, "sql")
    sql.clear()
    sql.send_keys(sql_text)
    browser.find_element(By.ID, "run").click()
    return wait


def test_rows_written_after_the_page_opened_appear_on_it(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with served_page(tmp_path) as (server, browser, ui_url):
        server.create_table("events", SCHEMA, order_by="ts")
        wait = run_query_on_the_page(
            browser,
            ui_url,
            "SELECT date_bin(INTERVAL '1 second', ts) AS second, count(*) AS n, sum(k) AS total "
            "FROM events GROUP BY 1",
        )
        wait.until(
            lambda b: (
                "row" in text_of(b, "#status") or b.find_elements(By.CSS_SELECTOR, "#grid thead th")
            )
        )
        # Now the page is open and its query runs: write, as a producer elsewhere would.
        with connect(server.location, token="writer-token", timeout=WAIT) as client:
            sink = client.sink("events")
            for second in range(4):  # each second's first row closes the second before it
                sink.write(rows(second, [4200 + second, 1, 1]), timeout=WAIT)
            sink.flush(timeout=WAIT)

            def grid(b: Any) -> str:
                return text_of(b, "#grid")

            # Seconds 0..2 are closed (second s totals 4202 + s): their 3 rows are on the page.
            wait.until(lambda b: "4204" in grid(b))
            assert "4202" in grid(browser)
            assert "4203" in grid(browser)
            assert "4205" not in grid(browser)  # second 3 is still open
            sink.write(rows(4, [7]), timeout=WAIT)
            sink.flush(timeout=WAIT)
            wait.until(lambda b: "4205" in grid(b))
            wait.until(
                lambda b: (
                    b.execute_script(
                        "return document.querySelectorAll('#chart .scatterlayer .trace').length"
                    )
                    == 2
                )
            )
            wait.until(lambda b: text_of(b, "#tables tr[data-table=events]").split()[2:3] == ["13"])
            shot = Path(os.environ.get("PUSHTABLE_UI_SCREENSHOT", tmp_path / "ui.png"))
            assert browser.save_screenshot(str(shot))
            sink.close()


LEVELS = pa.schema([("ts", TS), ("level", pa.string()), ("latency", pa.float64())])


def test_the_chart_draws_a_line_per_group_with_readable_numbers_and_whole_axes(
    tmp_path: Path,
) -> None:
    """``GROUP BY second, level``: one line per level (not one zig-zag through every group),
    numbers rounded for reading, and the axes' labels inside the chart (not clipped)."""
    from selenium.webdriver.common.by import By

    with served_page(tmp_path) as (server, browser, ui_url):
        sink = server.create_table("events", LEVELS, order_by="ts")
        wait = run_query_on_the_page(
            browser,
            ui_url,
            "SELECT date_bin(INTERVAL '1 second', ts) AS second, level, avg(latency) AS latency "
            "FROM events GROUP BY 1, 2",
        )
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#grid thead th"))
        for second in range(5):
            ts = [T0 + timedelta(seconds=second, milliseconds=i) for i in range(3)]
            sink.write(
                pa.record_batch(
                    [
                        pa.array(ts, TS),
                        pa.array(["info", "warn", "error"]),
                        pa.array([1 / 3 + second, 2 / 3 + second, 10 / 7 + second]),
                    ],
                    schema=LEVELS,
                ),
                timeout=WAIT,
            )
        names = (
            "return [...document.querySelectorAll('#chart .legendtext')].map(e => e.textContent)"
        )
        wait.until(lambda b: sorted(b.execute_script(names)) == ["error", "info", "warn"])
        traces = browser.execute_script(
            "return document.querySelectorAll('#chart .scatterlayer .trace').length"
        )
        assert traces == 3  # a line per level
        assert "per level" in text_of(browser, "#chart-note")
        grid = text_of(browser, "#grid")
        assert "0.3333" in grid
        assert "0.33333333" not in grid  # 4 decimals, not 16
        outside = browser.execute_script(
            """const box = document.getElementById('chart').getBoundingClientRect();
            return [...document.querySelectorAll('#chart .xtick text, #chart .ytick text')]
              .map(t => t.getBoundingClientRect())
              .filter(r => r.left < box.left - 1 || r.right > box.right + 1
                        || r.top < box.top - 1 || r.bottom > box.bottom + 1).length"""
        )
        assert outside == 0  # every tick label drawn inside the chart
        shot = Path(os.environ.get("PUSHTABLE_UI_SCREENSHOT_GROUPS", tmp_path / "groups.png"))
        assert browser.save_screenshot(str(shot))
        sink.close()


def test_an_updating_aggregate_is_a_table_that_updates_in_place(tmp_path: Path) -> None:
    """``GROUP BY level`` over an unbounded table: one grid row per level, whose values change
    where the row stands as batches arrive (the changes keyed by the server's upsert key)."""
    from selenium.webdriver.common.by import By

    with served_page(tmp_path) as (server, browser, ui_url):
        sink = server.create_table("events", LEVELS, unbounded=True)
        wait = run_query_on_the_page(
            browser,
            ui_url,
            "SELECT level, count(*) AS n FROM events GROUP BY level",
        )
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#grid thead th"))

        def grid_rows(b: Any) -> list[str]:
            return list(
                b.execute_script(
                    "return [...document.querySelectorAll('#grid tbody tr')].map(r => r.innerText)"
                )
            )

        for batch_number in range(1, 4):
            sink.write(
                pa.record_batch(
                    [
                        pa.array([T0] * 3, TS),
                        pa.array(["info", "warn", "info"]),
                        pa.array([1.0, 2.0, 3.0]),
                    ],
                    schema=LEVELS,
                ),
                timeout=WAIT,
            )
            infos = 2 * batch_number
            wait.until(
                lambda b, n=infos: (
                    sorted(r.split() for r in grid_rows(b))
                    == [["info", str(n)], ["warn", str(n // 2)]]
                )
            )
        assert len(grid_rows(browser)) == 2  # two groups, updated in place: never appended
        assert "updated in place" in text_of(browser, "#status")
        sink.close()


def test_stop_ends_the_page_s_query_on_the_server(tmp_path: Path) -> None:
    """The page's Stop aborts its request, and the server's query ends with it (no remote
    query left running for a page nobody reads); the page says where it stopped."""
    from selenium.webdriver.common.by import By

    from tests.conftest import wait_until

    with served_page(tmp_path) as (server, browser, ui_url):
        sink = server.create_table("events", SCHEMA, capacity=4)
        sink.write(rows(0, [1, 2, 3]))
        wait = run_query_on_the_page(browser, ui_url, "SELECT k FROM events")
        wait.until(lambda b: "3 row(s) so far" in text_of(b, "#status"))
        assert server.metrics_report().queries == 1
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: "stopped after 3 row(s)" in text_of(b, "#status"))
        wait_until(lambda: server.metrics_report().queries == 0, "the server's query to end")
        assert browser.find_element(By.ID, "run").is_enabled()
        assert not browser.find_element(By.ID, "stop").is_enabled()


def test_the_page_draws_a_window_by_its_start_and_nested_values_as_text() -> None:
    """What the page receives for Spark's window struct, decimals, times, lists and structs
    (the browser tests need Chromium; this is the server's half, always run)."""
    from datetime import datetime, timezone
    from decimal import Decimal

    import pyarrow as pa

    from pushtable.flight.server.ui import _display_type, _json_value

    t0 = datetime(2026, 11, 26, 12, tzinfo=timezone.utc)
    window = pa.struct(
        [("start", pa.timestamp("us", tz="UTC")), ("end", pa.timestamp("us", tz="UTC"))]
    )
    assert _display_type(window) == "timestamp[us, tz=UTC]"
    assert _display_type(pa.decimal128(10, 2)) == "double"
    assert _json_value({"start": t0, "end": t0}) == "2026-11-26T12:00:00+00:00"
    assert _json_value(Decimal("2.25")) == 2.25
    assert _json_value({"a": 1, "b": None}) == "{a: 1, b: None}"
    assert _json_value([1, None]) == "[1, None]"


def test_the_table_list_answers_while_a_subscription_exists() -> None:
    """``GET /api/tables`` with a subscription registered: it answered 502 ("no table named
    …": the list named the subscription, its stats did not). It lists the subscription as
    one of its topic, with its own counters, and drops it once its query ended."""
    server = serve("127.0.0.1", 0, ui_port=0, block=False, say=lambda _: None)
    try:
        with connect(server.location, timeout=WAIT) as client:
            client.create_topic("ev", SCHEMA)
            client.subscribe("ev", "panel", capacity=4)
            with urllib.request.urlopen(f"{server.ui_url}api/tables", timeout=WAIT) as reply:
                listed = {t["name"]: t for t in json.loads(reply.read())}
            assert set(listed) == {"ev", "panel"}
            assert listed["ev"]["stats"]["subscribers"] == 1
            panel = listed["panel"]["stats"]
            assert panel["subscription_of"] == "ev"
            assert panel["state"] == "waiting for a query"
            client.unsubscribe("panel")
            with urllib.request.urlopen(f"{server.ui_url}api/tables", timeout=WAIT) as reply:
                listed = {t["name"]: t for t in json.loads(reply.read())}
            assert set(listed) == {"ev"}
            assert listed["ev"]["stats"]["subscribers"] == 0
    finally:
        server.stop()
