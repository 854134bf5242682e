"""The FP8 linears' library call above the skinny kernel's token count where the FP8 GEMM cannot run
(no sm_90a, or K % 16 != 0; CPU): it takes the FP8 bytes and
their block scales (the companions "<weight>_scale_inv"), dequantises them to the activation dtype and
runs the GEMM, matching the op's reference on the dequantised weights (rounded where the call rounds)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import ir
from codegen.families import linear_skinny
from codegen.kernel import LibraryCall, Options
from ir.formats import FP8, companion_names, scale_shape
from ir.graph import node_view
from ir.ops import OPS, TType
from runtime.cuda_backend import CudaBackend

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402


def _quantized(rows: int, K: int, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, s float32 per 128 x 128 block, W = q * s in float64)."""
    sb = scale_shape((rows, K), FP8)
    q = (torch.randn((rows, K), generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.rand(sb, generator=gen) * 4 - 2) * K ** -0.5 / 64
    full = s.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :K]
    return q, s, q.double() * full


@pytest.mark.parametrize("op", ["linear", "gate_up_silu"])
def test_the_fp8_library_call_dequantises_its_weights(op):
    T, K, n = 20, 300, 130          # ceil blocks both ways
    roles = {"weight": "w"} if op == "linear" else {"gate": "wg", "up": "wu"}
    G, nid = single_op_graph(ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model, op,
                             {"out_dim": n}, {"x": TType(("T", K), "act")}, roles)
    for name in roles.values():
        G.graph["weights"][name] = dataclasses.replace(G.graph["weights"][name], format=FP8.name)
    # the fallback serves targets without sm_90a (there the FP8 GEMM takes these tokens: gemm_fp8)
    (call,) = [s for s in linear_skinny.lower(nid, G, Options(arch="sm_80")) if isinstance(s, LibraryCall)]
    assert call.attrs["weight_format"] == FP8.name
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((T, K), generator=gen) * 3).bfloat16()
    weights, ref = {}, {}
    for role, name in roles.items():
        q, s, w = _quantized(n, K, gen)
        weights[name], weights[companion_names(name, FP8)[0]] = q, s
        ref[role] = w.bfloat16().double()          # the call dequantises to the activation dtype
    backend = CudaBackend.__new__(CudaBackend)      # the library-call methods need only the weights
    backend.weights = weights
    env = {"x": x}
    (CudaBackend._linear if op == "linear" else CudaBackend._gate_up_silu)(backend, call, env)
    (expected,) = OPS[op].run(node_view(G, nid), [x.double()], ref, None)
    got = env[call.outputs[0]].double()
    assert float((got - expected).norm() / expected.norm()) < 5e-3
