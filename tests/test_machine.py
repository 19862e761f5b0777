"""What a benchmark prints beside its figures says which CPU of its name it ran on: cloud machines
give several generations one name ("AMD EPYC"), and the same code's figures differ between them."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from s2s_flow.machine import cpu_label, hardware


def _lscpu() -> dict[str, str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30).stdout
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in out.splitlines())}


@pytest.mark.skipif(not shutil.which("lscpu") or platform.machine() != "x86_64", reason="lscpu on an x86 Linux")
def test_the_cpu_is_named_with_its_family_model_and_widest_vector_unit():
    lscpu, hw = _lscpu(), hardware()
    assert hw["cpu"] == lscpu["Model name"]
    assert hw["cpu_id"] == f"family {lscpu['CPU family']} model {lscpu['Model']}"
    flags = lscpu["Flags"].split()
    assert hw["simd"] == ("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    assert cpu_label() == f"{lscpu['Model name']} ({hw['cpu_id']}, {hw['simd']}, {hw['cores_usable']} cores)"
