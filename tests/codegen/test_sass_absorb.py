"""The absorbed MLA projections of decode (mla_decode_query, mla_q_absorb, mla_v_up, and the query inside
mla_decode_prologue, which shares its grid with the cache write) compile to the
instructions they were written for, for every shipped spec (sm_90, NVRTC on the CPU): bf16 / fp16
take the tensor-core kernels (templates/include/mla_absorb.cuh: HMMA fed by 16-byte cp.async of
the token rows, the weights in registers from 8- / 16-byte loads), without register spills; fp32
takes the CUDA-core kernels (no HMMA)."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from harness import single_op_graph  # noqa: E402
from sass import _tools, cuobjdump, opcodes  # noqa: E402

import ir  # noqa: E402
from codegen.families import family_for_op  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.passes import run_pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "model_specs")) if f.endswith(".yaml"))
OPS = ("mla_decode_prologue", "mla_decode_query", "mla_q_absorb", "mla_v_up")
# griddepcontrol.wait per kernel: the prologue's two branches (query rows, cache-write row) wait each
WAITS = {"mla_decode_prologue": 2}
HMMA = {"bf16": "HMMA.16816.F32.BF16", "fp16": "HMMA.16816.F32"}


@functools.lru_cache(maxsize=None)
def _graphs(spec: str):
    """(graph, node) per absorbed-projection op of the spec: the decode graph's own nodes
    (mla_decode_prologue, mla_v_up, as the passes made them) and one-node mla_decode_query (the
    rope layout of the spec's prologue) and mla_q_absorb."""
    s = ir.load_spec(os.path.join(ROOT, "model_specs", f"{spec}.yaml"))
    G = run_pipeline(ir.build_graph(s, "decode"))
    found = {}
    for nid, data in G.nodes(data=True):
        if data["op"] in OPS and data["op"] not in found:
            found[data["op"]] = (G, nid)
    d = s.model.dims
    heads = lambda n: TType(("T", d["heads"], n), "act")   # noqa: E731
    rope = {k: G.nodes[found["mla_decode_prologue"][1]]["attrs"][k] for k in ("pairs", "output")}
    found["mla_decode_query"] = single_op_graph(s.model, "mla_decode_query", rope,
                                                {"q_nope": heads(d["qk_nope_head_dim"]),
                                                 "q_pe": heads(d["qk_rope_head_dim"])},
                                                {"kv_b": "kvb"}, phase="decode")
    found["mla_q_absorb"] = single_op_graph(s.model, "mla_q_absorb", {}, {"q_nope": heads(d["qk_nope_head_dim"])},
                                            {"kv_b": "kvb"}, phase="decode")
    assert set(found) == set(OPS), sorted(found)
    return found


def _sass_lines(cubin: bytes) -> list[str]:
    exe, dis = _tools()
    env = {**os.environ, "PATH": os.path.dirname(dis) + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([exe, "-sass", fh.name], capture_output=True, text=True, env=env,
                              check=True).stdout.splitlines()


def _compile(spec: str, op: str, dtype: str):
    G, nid = _graphs(spec)[op]
    launch = family_for_op(op).lower(nid, G, Options(dtype=dtype))[0]   # the prologue's second: the cache write's
    res = compile_cubin(render_launch(launch), launch.name, options=("--ptxas-options=-v",))
    return launch, res, opcodes(res.cubin)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("spec", SPECS)
def test_absorbed_projections_run_on_tensor_cores(spec, op, dtype):
    launch, res, ops = _compile(spec, op, dtype)
    assert launch.params["mma"] and "__mma_" in launch.name, launch.name
    assert ops[HMMA[dtype]] > 0, sorted(ops)
    assert ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, "token rows are staged with 16-byte cp.async"
    wide = "LDG.E.128.CONSTANT" if op == "mla_v_up" else "LDG.E.64.CONSTANT"
    assert ops[wide] > 0, f"the weight slice is loaded with {wide}"
    assert ops["ACQBULK"] == WAITS.get(op, 1), "one griddepcontrol.wait a branch (pdl.cuh)"
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    regs = int(re.search(r"Used (\d+) registers", res.log).group(1))
    assert regs * launch.block[0] <= 64 * 1024, f"{regs} registers x {launch.block[0]} threads"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("spec", SPECS)
def test_fp32_takes_the_cuda_core_kernels(spec, op):
    launch, res, ops = _compile(spec, op, "fp32")   # the prologue: its query's own kernel (no cache-write row)
    assert not launch.params["mma"] and "__mma_" not in launch.name
    assert not any(k.startswith("HMMA") for k in ops), sorted(ops)
    assert ops["ACQBULK"] == 1, "one griddepcontrol.wait (pdl.cuh)"


def test_the_weight_loads_are_issued_before_the_pdl_wait():
    """Every weight load of the tensor-core kernels comes before griddepcontrol.wait (ACQBULK),
    so the weight prefetch overlaps the previous kernel's tail; every activation copy after it.
    (mla_decode_prologue runs mla_decode_query's code behind a branch; test_sass_pdl.py follows
    both of its branches to their waits.)"""
    for op in ("mla_decode_query", "mla_q_absorb", "mla_v_up"):
        launch, res, _ = _compile("deepseek_v2_lite", op, "bf16")
        lines = _sass_lines(res.cubin)
        wait = next(i for i, l in enumerate(lines) if "ACQBULK" in l)
        p = launch.params
        # a thread's weight registers: 4 rows a k16 step of 8-byte runs (query), 2 rows a 32-column
        # chunk of 16-byte runs (v_up); mla_decode_query's i64 positions are 8-byte loads after the wait
        wide, n = ("LDG.E.128.CONSTANT", 2 * p["cps"]) if op == "mla_v_up" else ("LDG.E.64.CONSTANT", p["N"] // 4)
        before = sum(1 for l in lines[:wait] if wide in l)
        copies = [i for i, l in enumerate(lines) if "LDGSTS" in l]
        assert before >= n, f"{op}: {before} of the {n} weight loads before the PDL wait"
        assert copies and min(copies) > wait, f"{op}: an activation copy before the PDL wait"
