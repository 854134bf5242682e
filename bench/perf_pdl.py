"""What programmatic dependent launch saves at a kernel boundary (a script, not a test).

    python3 -m bench.perf_pdl [--tokens 1,8,32,128] [--layers 26]

Times the MoE decode chain of tests/gpu/test_pdl.py at DeepSeek-V2-Lite's dims (D 2048, E 64,
K 6, M 1408; bf16): rms_norm -> router GEMV -> top-k -> align -> gate_up_silu -> down ->
combine_residual, `layers` times back to back in one captured CUDA graph (as a decode step's MoE
layers follow each other), with every launch PDL and with none.  Prints us per chain both ways and
the difference per kernel boundary (every launch of a chain, the last one's included, is followed
by a PDL launch: 7 a chain at T <= 8, where one of each expert kernel's two launches is empty).

Prediction (issue 14): 0.5-1 us a boundary, i.e. 3.5-7 us of a ~50 us chain at T = 1 (the expert
GEMVs read 6 experts' 3 x 5.8 MB in ~38 us, PERF_NOTES v1), plus the router's gate (L2-prefetched
before its wait). The bench's A/B (`dsgraph bench --quick` against `--quick --no-pdl`) gives the
whole step's.
"""
from __future__ import annotations

import argparse

import torch

from runtime.timing import graph_us
from tests.gpu.test_pdl import LITE, _launches, _outputs, _run

from codegen import sizes as size_exprs
from runtime.launcher import KernelRunner

DEV = "cuda"


def weights(D, E, K, M) -> dict:
    """Random bf16 experts made on the GPU (3 x 370 MB at V2-Lite's dims), a fp32 router whose
    picks stand well apart."""
    g = torch.Generator(device=DEV).manual_seed(0)
    bf = torch.bfloat16
    return {"norm.w": (1 + 0.1 * torch.randn(D, generator=g, device=DEV)).to(bf),
            "router.w": torch.randn(E, D, generator=g, device=DEV) / D ** 0.5 * 2,
            "e.*.gate": (torch.randn(E, M, D, generator=g, device=DEV) / D ** 0.5).to(bf),
            "e.*.up": (torch.randn(E, M, D, generator=g, device=DEV) / D ** 0.5).to(bf),
            "e.*.down": (torch.randn(E, D, M, generator=g, device=DEV) / M ** 0.5).to(bf)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,128", help="decode batch sizes (tokens a step)")
    ap.add_argument("--layers", type=int, default=26, help="chains a graph (V2-Lite has 26 MoE layers)")
    a = ap.parse_args()
    runner = KernelRunner()
    D, E, K, M = (LITE[k] for k in "DEKM")
    w = weights(D, E, K, M)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"MoE decode chain, V2-Lite dims, bf16, {a.layers} chains a graph ({torch.cuda.get_device_name(0)})")
    print(f"{'T':>5} {'launches':>9} {'plain us':>10} {'PDL us':>10} {'saved us':>9} {'per boundary':>13}")
    for T in (int(t) for t in a.tokens.split(",")):
        values = {"x": torch.randn(T, D, device=DEV).to(torch.bfloat16), **_outputs(T, "bf16", **LITE)}
        us = {}
        for pdl in (False, True):
            launches = _launches("bf16", pdl, **LITE)
            us[pdl] = graph_us(lambda: [_run(runner, launches, values, w, T, K=K) for _ in range(a.layers)], iters=1) \
                / a.layers
        n = sum(0 not in [size_exprs.evaluate(g, {"T": T, "NP": T * K, "SMS": sms}) for g in la.grid]
                for la in _launches("bf16", True, **LITE))
        saved = us[False] - us[True]
        print(f"{T:>5} {n:>9} {us[False]:>10.2f} {us[True]:>10.2f} {saved:>9.2f} {saved / n:>12.2f}")


if __name__ == "__main__":
    main()
