"""NVRTC compiles generated CUDA to a CUBIN without a GPU, and a failure names
its kernel, template and graph nodes and says where source and log were saved."""
import os
from pathlib import Path

import pytest

from codegen.nvrtc import (CompileResult, KernelCompileError, compile_cubin, include_dirs,
                           nvrtc_version, parse_arch)

GOOD = r"""
#include <cuda_bf16.h>
#include <math_constants.h>

extern "C" __global__ void tiny_max(const __nv_bfloat16* x, float* out, int n) {
    float m = -CUDART_INF_F;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, __bfloat162float(x[i]));
    out[threadIdx.x] = m;
}
"""

BAD = r"""
extern "C" __global__ void broken(float* out) {
    out[0] = 1.0f   // missing semicolon
}
"""


def test_version_and_include_dirs():
    major, minor = nvrtc_version()
    assert major >= 12 and minor >= 0
    dirs = include_dirs()
    # Only the toolkit's headers are on the include path; dsgraph's reach NVRTC in memory.
    assert len(dirs) == 1 and os.path.isfile(os.path.join(dirs[0], "cuda_bf16.h"))


def test_dsgraph_headers_reach_nvrtc_only_as_given():
    src = '#include "probe.cuh"\nextern "C" __global__ void k(float* o) { o[0] = PROBE; }\n'
    compile_cubin(src, "probe_ok", headers={"probe.cuh": "#pragma once\n#define PROBE 1.0f\n"})
    with pytest.raises(KernelCompileError):
        compile_cubin(src, "probe_missing", headers={})


def test_compiles_to_cubin_for_sm90():
    result = compile_cubin(GOOD, "tiny_max", arch="sm_90")
    assert isinstance(result, CompileResult)
    assert result.cubin[:4] == b"\x7fELF"
    assert "\0" not in result.log


def test_compile_error_names_kernel_template_nodes_and_saved_files(tmp_path):
    with pytest.raises(KernelCompileError) as info:
        compile_cubin(BAD, "broken", template="rms_norm.cu.j2", nodes=("n3", "n7"),
                      log_dir=str(tmp_path))
    err = info.value
    msg = str(err)
    assert "broken" in msg and "rms_norm.cu.j2" in msg and "n3, n7" in msg
    assert any("broken.cu(" in e and "error" in e for e in err.errors)
    assert err.errors[0] in msg
    assert err.source_path in msg and err.log_path in msg
    assert os.path.isfile(err.source_path) and os.path.isfile(err.log_path)
    assert Path(err.source_path).read_text() == BAD
    assert "error" in Path(err.log_path).read_text()
    assert (err.kernel, err.template, err.nodes) == ("broken", "rms_norm.cu.j2", ("n3", "n7"))


def test_compile_error_without_log_dir_uses_a_fresh_temp_dir():
    with pytest.raises(KernelCompileError) as info:
        compile_cubin(BAD, "broken")
    assert "dsgraph-nvrtc-" in info.value.source_path
    assert os.path.isfile(info.value.log_path)


@pytest.mark.parametrize("arch", ["sm90", "compute_90", "90", "sm_90b", "SM_90", ""])
def test_bad_arch_is_value_error(arch):
    with pytest.raises(ValueError):
        compile_cubin(GOOD, "tiny_max", arch=arch)


def test_parse_arch():
    assert parse_arch("sm_90") == 90
    assert parse_arch("sm_90a") == 90
    assert parse_arch("sm_100a") == 100
    with pytest.raises(ValueError):
        parse_arch("sm_x")
