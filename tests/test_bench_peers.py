"""The ``windows`` bench suite's side-by-side part, its own logic: the shared workload gives
verified windows in pushtable, and the table and plot name a peer that could not run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pushtable.bench import peer_workload, peers, plots
from pushtable.bench.windows import DENSE, close_latency, throughput


def test_the_shared_workload_closes_every_window_in_pushtable() -> None:
    result = throughput(30_000, 1000, peers.INTS)
    assert result["verified"]
    assert result["windows"] == 1  # 30,000 rows at 100,000 rows per event-time second
    latency = close_latency(10, samples=5, interval=0.005, workload=peers.INTS)
    assert latency["samples"] == 5  # every window arrived, each when the next batch came


def test_latency_batches_never_span_more_than_the_peers_watermark_delay() -> None:
    b = peer_workload.latency_batch(3, 100)
    ts = b.column("ts").to_pylist()
    assert min(ts) == 3000 + peer_workload.DELAY_MS
    assert max(ts) - min(ts) < peer_workload.DELAY_MS


def test_the_table_names_a_skipped_peer() -> None:
    ours = {
        "engine": "pushtable",
        "throughput": [{"rows": 10, "rows_per_s": 2e6, "verified": True}],
        "close_latency": [{"samples": 3, "p50_ms": 0.4, "p99_ms": 0.9}],
    }
    params = {"rows": 10, "batch_rows": 5, "runs": 1, "samples": 3, "latency_batch_rows": [1]}
    text = peers.table(
        {"params": params, "pushtable": ours, "laminardb": {"skipped": "no peers venv: offline"}}
    )
    assert "pushtable" in text
    assert "2.000 yes" in text
    assert "laminardb          skipped: no peers venv: offline" in text
    assert "pathway            skipped: not run" in text


def test_a_peer_that_cannot_run_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the peers venv the suite still runs pushtable and says why each peer did not."""
    monkeypatch.setenv("PUSHTABLE_PEERS_PYTHON", sys.executable)  # has no laminardb/pathway
    suite = peers.run(quick=True)
    assert suite["pushtable"]["throughput"][0]["verified"]
    for name in ("laminardb", "pathway"):
        assert "ModuleNotFoundError" in suite[name]["skipped"], suite[name]
    assert set(suite["shapes"]) == {"sliding", "session", "dense"}
    for shape, side in suite["shapes"].items():  # each shape side by side
        assert all(run["verified"] for run in side["pushtable"]["throughput"]), shape
        assert "ModuleNotFoundError" in side["pathway"]["skipped"], side
    text = peers.table(suite)
    assert "laminardb          skipped: laminardb run failed" in text
    assert "sliding windows side by side" in text
    assert "dense windows side by side" in text


def test_the_dense_shape_closes_a_window_every_1000_rows() -> None:
    """``ts`` is the row's number in ms: 20,000 rows are 20 one-second windows, in pushtable
    (timestamps) as in the peers' int64 form."""
    batches = peer_workload.dense_batches(20_000, 8192)
    ts = [t for b in batches for t in b.column("ts").to_pylist()]
    assert ts == list(range(20_000))
    result = throughput(20_000, 8192, DENSE)
    assert result["verified"]
    assert result["windows"] == 20


def test_busy_spins_processes_for_the_block_and_refuses_a_negative_count() -> None:
    import psutil

    from pushtable.bench import machine

    before = {p.pid for p in psutil.Process().children()}
    with machine.busy(2):
        spinning = [p for p in psutil.Process().children() if p.pid not in before]
        assert len(spinning) == 2
        assert all(p.is_running() for p in spinning)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spinning)
    with pytest.raises(ValueError, match=">= 0"), machine.busy(-1):
        pass


def test_the_windows_plot_draws_the_engines_that_ran(tmp_path: Path) -> None:
    ours = {
        "engine": "pushtable",
        "throughput": [{"rows": 10, "rows_per_s": 8e7, "verified": True}],
        "close_latency": [{"samples": 3, "p50_ms": 0.4, "p99_ms": 0.9}],
    }
    suite = {
        "peers": {
            "params": {"latency_batch_rows": [1]},
            "pushtable": ours,
            "laminardb": {**ours, "engine": "LaminarDB 0.17.0"},
            "pathway": {"skipped": "offline"},
        }
    }
    path = plots.windows(suite, tmp_path / "windows.png")
    assert path.stat().st_size > 0
