"""sha256 of `cuobjdump -sass` of every kernel built on gemm_ring.cuh (a script, not a test; CPU, NVRTC).

    python -m bench.sass_hashes_ring > after.txt      # from a checkout's root; again on the base, then diff

For refactors of gemm_ring.cuh / gemm_fp8.cuh / gemm_int8.cuh / moe_gemm_fp8.cuh that must leave the machine
code byte-identical: the FP8 x FP8 experts' three modes and the dense gemm_fp8 (linear, multi_linear,
gate_up_silu, a ceil K block; bf16 and fp16), each with moe.fp8_overlap off and on, and gemm_int8's same
shapes.  Split K is a run-time argument of the same kernels.
"""
from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "codegen"))

SHAPES = (("linear", 2048), ("multi_linear", 2048), ("gate_up_silu", 2048), ("linear", 2064))
EXPERTS = (("moe_gate_up_silu", 2048, 1408, 66, 8), ("moe_down", 1408, 2048, 66, 8), ("moe_gate_up", 720, 200, 8, 2))


def launches():
    """(tag, launch) of every kernel covered."""
    import test_linear_fp8
    import test_linear_int8
    from test_moe_gemm_fp8 import _gemm_launches

    from codegen.families import linear_skinny
    from codegen.kernel import Options
    from codegen.tuning import LinearTuning, MoeTuning, Tuning
    from ir.formats import FP8

    out = []
    for ovl in (False, True):
        tun = Tuning(linear=LinearTuning(fp8_chunks_upto=0), moe=MoeTuning(fp8_overlap=ovl))
        out += [(f"experts ovl={ovl}", la) for args in EXPERTS for la in _gemm_launches(*args, tun)]
        for dtype in ("bf16", "fp16"):
            for op, K in SHAPES:
                G, nid = test_linear_fp8._node(op, (FP8.name,) * (1 if op == "linear" else 2), K=K)
                steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tun))
                out += [(f"fp8 {dtype} ovl={ovl}", s) for s in steps if getattr(s, "stage", "") == "fp8_wgmma"]
    for dtype in ("bf16", "fp16"):
        for op, K in SHAPES:
            G, nid = test_linear_int8._node(op, (test_linear_int8.I8,) * (1 if op == "linear" else 2), K=K)
            steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=test_linear_int8.QUANT))
            out += [(f"int8 {dtype}", s) for s in steps if getattr(s, "stage", "") == "i8_wgmma"]
    return out


def _hash(item):
    from sass import _sass

    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch

    tag, la = item
    res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires))
    return f"{tag:20s} {la.name:70s} {hashlib.sha256(_sass(res.cubin).encode()).hexdigest()[:16]}"


def main():
    items = launches()
    with ProcessPoolExecutor(2) as ex:
        for line in ex.map(_hash, items):
            print(line, flush=True)
    print(f"{len(items)} kernels", file=sys.stderr)


if __name__ == "__main__":
    main()
