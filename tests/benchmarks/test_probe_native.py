"""The CUDA kernel's probe tool stays in step with the kernel's source: every variant's text is found."""

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


@pytest.fixture(scope="module")
def probe():
    sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]
    try:
        import probe_native_gpu
        yield probe_native_gpu
    finally:
        del sys.path[:2]


def test_every_variant_applies_to_the_kernel_source(probe):
    source = probe.native.SOURCE.read_text()
    for name, substitutions in probe.VARIANTS.items():
        for old, new in substitutions + probe.ONLY_BF16_128:
            assert old in source, f"variant {name}: {old!r} is no longer in {probe.native.SOURCE.name}"
            assert new != old
