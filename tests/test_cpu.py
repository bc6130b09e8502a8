"""The import-time checks: the CPU (our logic alone: the CPU itself cannot be swapped in a test)
and a native core that was never built."""

from __future__ import annotations

from pathlib import Path

from pushtable.cpu import X86_64_V3, missing_features

HASWELL = "flags\t\t: fpu " + " ".join(X86_64_V3) + " aes\n"


def test_a_cpu_with_every_v3_feature_passes() -> None:
    assert missing_features("processor\t: 0\n" + HASWELL) == []


def test_an_older_cpu_is_told_what_it_lacks() -> None:
    sandy_bridge = HASWELL.replace(" avx2", "").replace(" bmi2", "").replace(" fma", "")
    assert missing_features(sandy_bridge) == ["AVX2", "BMI2", "FMA"]


def test_only_the_first_flags_line_counts_and_none_means_no_verdict() -> None:
    assert missing_features(HASWELL + "flags : fpu\n") == []
    assert missing_features("processor : 0\n") == []


def test_a_checkout_without_the_built_core_says_to_build_it(tmp_path: Path) -> None:
    """From sources whose native core was never built, what needs the core names it and the
    command that builds it (it once failed with a misleading "circular import"); the remote
    client, which needs no core, imports."""
    import shutil
    import subprocess
    import sys

    import pushtable

    source = Path(pushtable.__file__).parent
    shutil.copytree(source, tmp_path / "pushtable", ignore=shutil.ignore_patterns("_native*.so"))

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,  # first on sys.path: the copy without the core
            capture_output=True,
            text=True,
            timeout=60,
        )

    for code in ("from pushtable import SessionContext", "import pushtable.sink"):
        done = run(code)
        assert done.returncode != 0, code
        assert "native core (pushtable/_native.abi3.so) is not built: run `make setup`" in (
            done.stderr
        ), done.stderr
        assert "circular import" not in done.stderr
    done = run("from pushtable.flight.client.client import connect; print(connect.__name__)")
    assert (done.returncode, done.stdout.strip()) == (0, "connect"), done.stderr


def test_the_remote_client_loads_neither_datafusion_nor_the_native_core() -> None:
    """A Spark executor's remote producer (or an asyncio service) imports the client only:
    the engine stays out."""
    import subprocess
    import sys

    code = (
        "import sys, pushtable.flight.client.client as c, pushtable.flight.client.idempotent;"
        "import pushtable.flight.client.aio;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('datafusion', 'lance')"
        " or m == 'pushtable._native'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
