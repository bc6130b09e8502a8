"""The ``pushtable`` command: argument errors, the demo end to end, the quick benchmark."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pushtable.bench import SUITES
from pushtable.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["demo", "--epochs", "0"], "--epochs: must be at least 1"),
        (["demo", "--rows-per-epoch", "many"], "--rows-per-epoch: expected a whole number"),
        (["bench", "--suite", "gpu"], "--suite: invalid choice: 'gpu'"),
        (["serve", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["serve", "--port", "http"], "--port: invalid int value: 'http'"),
    ],
)
def test_argument_errors_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_a_non_empty_out_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not empty" in capsys.readouterr().err


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for option in ("--out", "--connect", "--epochs", "--rows-per-epoch", "--sql", "--capacity"):
        assert option in out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"tokens": [{"name": "ops", "secret_env": "PUSHTABLE_TEST_UNSET", "role": "admin"}]},
            "token 'ops': environment variable 'PUSHTABLE_TEST_UNSET' is not set",
        ),
        ({"tables": [{"name": "events"}]}, "each of 'tables' needs a 'name' and a 'schema'"),
        ({"tabels": []}, "unknown keys ['tabels']"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_a_config_mistake_is_one_line_not_a_traceback(
    config: object, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    os.environ.pop("PUSHTABLE_TEST_UNSET", None)
    assert main(["serve", "--port", "0", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pushtable serve: "), err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_busy_port_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """It used to say only gRPC's "Unknown error: Server did not start properly"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err == f"pushtable serve: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another server there?)"
    ), err


def _pushtable(
    *args: str, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pushtable", *args],
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.spark
@pytest.mark.timeout(270)  # the command's own bound (240 s) applies, not the suite's 120 s
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    done = _pushtable(
        "demo",
        "--epochs",
        "10",
        "--rows-per-epoch",
        "200",
        "--out",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.strip() for line in done.stdout.splitlines()]
    # The status line ends on a line of its own; the check's title is whole, on the next.
    assert any(line.startswith("epochs 10/10 ·") for line in lines), done.stdout
    title = "what the live query returned vs the persisted Lance dataset (one SQL statement)"
    assert title in lines, done.stdout
    said = " ".join(done.stdout.split())
    # What the live query returned matches Lance, level by level.
    assert "counts match: 2,000 rows live, 2,000 rows" in said
    assert "live_query" in said
    # Results came while Spark ran: the first before the last epoch was committed (how soon
    # is a latency figure, the benchmarks' business, not a pass/fail line under load).
    first = re.search(r"first live result after (\d+) of 10 epochs", said)
    assert first is not None, said
    assert int(first.group(1)) < 10, said
    assert (tmp_path / "run" / "events.lance").is_dir()
    # A quiet first run: no third-party warnings a user can do nothing about.
    for noise in ("WARN", "fork-safe", "NativeCodeLoader", "loopback address"):
        assert noise not in done.stdout + done.stderr, done.stderr


@pytest.mark.spark
@pytest.mark.timeout(330)  # the command's own bound (300 s) applies
def test_demo_over_spark_connect(tmp_path: Path) -> None:
    """``demo --connect`` as a new user runs it: more epochs than the table's queue holds
    (it hung at the 4th epoch when the live query could not run), a live result per epoch
    while Spark runs, the same level-by-level check as the local demo, and a quiet terminal."""
    done = _pushtable(
        "demo",
        "--connect",
        "--epochs",
        "6",
        "--rows-per-epoch",
        "500",
        "--capacity",
        "2",
        "--out",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=300,
        env={"SPARK_TESTING": "1"},  # an ephemeral Spark Connect port (SPARK-42272)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = " ".join(done.stdout.split())
    assert "counts match: 3,000 rows live on the server, 3,000 rows" in said
    assert "live_query" in said  # the level-by-level comparison ran on what the query returned
    first = re.search(r"first live result after (\d+) of 6 epochs", said)
    assert first is not None, said
    assert int(first.group(1)) < 6, said  # an epoch's result came while Spark ran
    assert said.count("live result (remote)") >= 6, said  # one result per epoch at least
    for noise in ("WARN", "Warning", "fork-safe", "NativeCodeLoader", "loopback address"):
        assert noise not in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.spark
@pytest.mark.slow  # a Spark Connect server of its own (44 s); the demo over Connect stays default
@pytest.mark.timeout(330)
def test_demo_over_spark_connect_stops_at_once_when_the_live_query_fails(tmp_path: Path) -> None:
    """A live query that cannot run (a column the table lacks) ends the demo with its error
    while Spark still has epochs to send, instead of a hang behind a full queue."""
    done = _pushtable(
        "demo",
        "--connect",
        "--epochs",
        "30",
        "--rows-per-epoch",
        "100",
        "--capacity",
        "1",
        "--sql",
        "SELECT shard, count(*) FROM events GROUP BY shard",
        "--out",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=300,
        env={"SPARK_TESTING": "1"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pushtable demo: the live query failed" in done.stderr, done.stderr
    assert "shard" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


#: the suites of ``bench --quick`` that run in one process in seconds; the Spark, Flight and
#: durable suites (about two minutes more) run in the ``-m slow`` test below
IN_PROCESS = ("core", "latency", "windows", "updating", "joins", "fanout", "memory", "bandwidth")


def _quick_bench(tmp_path: Path, suites: tuple[str, ...]) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    done = _pushtable(
        "bench",
        "--quick",
        "--no-peers",  # LaminarDB and Pathway need a venv of their own (tests/test_bench_peers.py)
        *(arg for suite in suites for arg in ("--suite", suite)),
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "img"),
        cwd=tmp_path,
        timeout=480,  # every suite alone: 247 s on 2 cores on 2026-11-27; more beside a build
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    assert set(suites) <= set(data)
    assert data["machine"]["cores"] >= 1
    assert {"results", "ratios", "reader_gone"} <= set(data["core"])
    assert {r["engine"] for r in data["core"]["results"]} == {"pushtable", "duckdb", "python"}
    assert {"capacity_bound", "max_bytes_bound"} == set(data["memory"])
    assert data["windows"]["throughput"]["verified"]
    assert [c["batch_rows"] for c in data["windows"]["close_latency"]] == [1, 100, 8192]
    assert "peers" not in data["windows"]
    assert [t["keys"] for t in data["updating"]["throughput"]] == [1_000, 100_000]
    assert all(t["rows_per_s"] > 0 for t in data["updating"]["throughput"])
    assert all(lat["samples"] > 0 for lat in data["updating"]["latency"])
    assert data["joins"]["throughput"]["verified"]
    assert data["joins"]["long"]["verified"]
    assert data["bandwidth"]["copy_gb_per_s_median"] > 0
    assert set(data["fanout"]) == {"1", "4", "16"}
    assert all(r["rows_per_s_total"] > 0 for r in data["fanout"].values())
    assert (tmp_path / "img" / "fanout.png").stat().st_size > 0
    assert (tmp_path / "img" / "core_throughput.png").stat().st_size > 0
    return data


@pytest.mark.slow  # 54 s; the slow run's quick bench of every suite covers these too
@pytest.mark.timeout(510)  # the command's own bound (480 s) applies, not the suite's 120 s default
def test_quick_bench_of_the_in_process_suites_writes_json(tmp_path: Path) -> None:
    _quick_bench(tmp_path, IN_PROCESS)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(510)  # the command's own bound (480 s) applies
def test_quick_bench_writes_json_with_every_suite(tmp_path: Path) -> None:
    data = _quick_bench(tmp_path, SUITES)
    assert {"to_arrow_alone", "driver_path", "executor_path", "dedupe"} <= set(data["spark"])
    assert [(r["batch_rows"], r["producers"]) for r in data["flight"]["write"]] == [
        (8_192, 1),
        (8_192, 4),
        (65_536, 1),
        (65_536, 4),
    ]
    assert all(r["remote_rows_per_s"] > 0 for r in data["flight"]["write"])
    assert all(r["raw_rows_per_s"] > 0 for r in data["flight"]["write"])  # the bare wire
    sql = {s["batch_rows"]: s for s in data["flight"]["sql"]}
    assert sorted(sql) == [8_192, 65_536]
    assert all(s["raw_rows_per_s"] > 0 for s in sql.values())
    assert all(s["filled_rows_per_s"] > 0 for s in sql.values())  # SQL out of a table written first
    assert data["flight"]["spark"]["executors_vs_driver"] > 0
    assert 0 < data["flight"]["latency"]["p50_ms"] <= data["flight"]["latency"]["max_ms"]
    assert (tmp_path / "img" / "flight.png").stat().st_size > 0
    assert (tmp_path / "img" / "spark_epoch_split.png").stat().st_size > 0
