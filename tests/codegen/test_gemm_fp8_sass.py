"""gemm_fp8's machine code is pinned: the sha256 of `cuobjdump -sass` of its GEMM cubins (sm_90a, NVRTC on
the CPU) for V2-Lite's q + kv_a, dense gate + up and a long-K fp16 o_proj equal the recorded ones
(gemm_fp8_sass.json), so a change to the headers it shares with gemm_int8 (gemm_split.cuh, tickets.cuh)
cannot move the FP8 GEMM unnoticed.  Recorded for one NVRTC version; under another the test skips.
A deliberate change to the FP8 GEMM's code refreshes the record:

    python tests/codegen/test_gemm_fp8_sass.py
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from sass import _sass, cuobjdump  # noqa: E402

RECORD = os.path.join(HERE, "gemm_fp8_sass.json")
SHAPES = [("multi_linear", 2048, "bf16"), ("gate_up_silu", 2048, "bf16"), ("linear", 10944, "fp16")]


def sass_hashes() -> dict[str, str]:
    """Kernel name -> sha256 of its SASS, for every GEMM launch of SHAPES."""
    from test_linear_fp8 import _node

    from codegen.arch import kernel_target
    from codegen.families import gemm_fp8, linear_skinny
    from codegen.kernel import KernelLaunch, Options
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    from ir.formats import FP8
    out = {}
    for op, K, dtype in SHAPES:
        G, nid = _node(op, (FP8.name, FP8.name), K=K)
        for la in linear_skinny.lower(nid, G, Options(dtype=dtype)):
            if isinstance(la, KernelLaunch) and la.stage == "fp8_wgmma":
                cubin = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires)).cubin
                out[la.name] = hashlib.sha256(_sass(cubin).encode()).hexdigest()
    return out


def _version() -> str:
    from codegen.nvrtc import nvrtc_version
    return ".".join(map(str, nvrtc_version()))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
def test_the_fp8_gemms_sass_is_the_recorded_one():
    with open(RECORD) as fh:
        record = json.load(fh)
    if record["nvrtc"] != _version():
        pytest.skip(f"recorded with NVRTC {record['nvrtc']}, this is {_version()}")
    got = sass_hashes()
    changed = sorted(k for k in record["sass_sha256"] if got.get(k) != record["sass_sha256"][k])
    assert set(got) == set(record["sass_sha256"]) and not changed, \
        f"gemm_fp8's SASS changed for {changed or sorted(set(got) ^ set(record['sass_sha256']))}; " \
        "if on purpose, refresh with: python tests/codegen/test_gemm_fp8_sass.py"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    with open(RECORD, "w") as fh:
        json.dump({"nvrtc": _version(), "sass_sha256": sass_hashes()}, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {RECORD}")
