"""The import-time CPU check (our logic alone: the CPU itself cannot be swapped in a test)."""

from __future__ import annotations

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
