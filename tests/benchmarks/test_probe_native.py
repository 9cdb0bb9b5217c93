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
        for old, new in substitutions:
            assert old in source, f"variant {name}: {old!r} is no longer in {probe.native.SOURCE.name}"
            assert new != old


@pytest.mark.parametrize("fmt", ["nvfp4", "ternary", "int2", "kivi2"])
def test_the_probe_compiles_one_kernel_of_the_format_asked_for(probe, fmt):
    """The launchers keep one kernel: ``fmt``'s at head dim 128 with bf16 queries, which the source defines."""
    import re

    reduced = probe.only(probe.native.SOURCE.read_text(), fmt)
    name = fmt.upper()
    assert not re.findall(r"KVC_(LAUNCH|RESIDENT)\(\w+, \d+\)", reduced)  # no dispatch to any other kernel
    assert f"launch<{name}, 128, __nv_bfloat16>(q, part" in reduced
    assert f"return resident<{name}, 128, __nv_bfloat16>();" in reduced
    assert f" {name} = " in reduced  # a format constant of the source


@pytest.mark.parametrize("formats", [["ternary"], ["nvfp4", "int2"]])
def test_a_decode_stand_in_is_refused_on_formats_it_does_not_change(probe, formats, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--format", *formats, "--variants", "base", "no_decode"])
    assert ("variant no_decode stands in for the decode of nvfp4 pools; give --format among them (got --format "
            f"{' '.join(formats)})") in capsys.readouterr().err


@pytest.fixture
def compile_tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import native_compile

    return native_compile


def test_the_compile_tool_instantiates_every_kernel_the_launcher_dispatches_to(compile_tool):
    from kvcompose.ops.paged_attention import native

    source = compile_tool.SOURCE.read_text()
    assert set(compile_tool.KERNELS) == compile_tool.dispatched(source)
    codes = compile_tool.format_codes(source)
    assert {name.lower(): code for name, code in codes.items()} == native.FORMATS  # the host's fmt codes
    device = compile_tool.device_source(source)
    assert "torch/extension.h" not in device and device.count("packed_partial_kernel<") == len(compile_tool.KERNELS)


def test_the_compile_tool_builds_the_kernels_where_nvcc_is_installed(compile_tool):
    nvcc = compile_tool.find_tool("nvcc", None)
    if nvcc is None:
        pytest.skip("no nvcc (CUDA_HOME or PATH): benchmarks/tools/native_compile.py --nvcc compiles the kernels")
    lines = compile_tool.compile_kernels(nvcc, [])
    assert len(lines) == len(compile_tool.KERNELS) and all("registers" in line for line in lines)


def test_the_head_major_stand_ins_are_refused_on_head_major_pools(probe, capsys):
    """They read slot-major pools at head-major addresses: on head-major pools they would time nothing real."""
    with pytest.raises(SystemExit):
        probe.main(["--layout", "head", "--variants", "base", "head_major_copy"])
    assert "variants head_major_copy read slot-major pools at head-major addresses; give --layout slot" in (
        capsys.readouterr().err)


def test_the_compile_tool_counts_the_tile_loop_of_each_kernel(compile_tool):
    """The loop is the backward branch's span with the most HMMA: an earlier, shorter loop without products
    (the prologue's) and the code after the loop are not counted."""
    sass = """
        Function : _ZN12_GLOBAL__N_121packed_partial_kernelILi3ELi128E13__nv_bfloat16EEvPKT1_
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   LOP3.LUT R4, R4, 0x30003, R9, 0xea, !PT ;
        /*0040*/                   HADD2 R4, R4, -1024, -1024 ;
        /*0050*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0060*/              @!P1 BRA 0x30 ;
        /*0070*/                   EXIT ;
"""
    counts = compile_tool.loop_counts(sass)
    assert list(counts) == ["INT2 D=128 __nv_bfloat16"]
    assert counts["INT2 D=128 __nv_bfloat16"] == {"LOP3": 1, "HADD2": 1, "HMMA": 1, "BRA": 1}


def test_the_compile_tool_finds_a_cuda_tool_given_or_under_cuda_home(compile_tool, monkeypatch, tmp_path):
    assert compile_tool.find_tool("cuobjdump", "/opt/cuda/bin/cuobjdump") == "/opt/cuda/bin/cuobjdump"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cuobjdump").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert compile_tool.find_tool("cuobjdump", None) == str(tmp_path / "bin" / "cuobjdump")
