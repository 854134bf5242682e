"""Shared plumbing for the dense / MLA kernel-family tests: test models, one-node runs,
and the per-family example counter ("EXAMPLES <family> <n> worst_err ...")."""
from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import torch

import ir
from codegen.families import family_for_op
from codegen.kernel import Options
from harness import (TORCH_DTYPES, assert_close, assert_strict, kernel_test, poison, single_op_graph, tiny_model,
                     tolerance)
from ir.graph import node_view
from ir.ops import OPS, TType

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bf16", "fp16", "fp32")
MODEL_NAMES = ("lite", "odd", "odd2", "mid")


@functools.lru_cache(maxsize=None)
def model(name: str):
    """lite: DeepSeek-V2-Lite's dims; odd: small odd dims (H 3, C 20, R 8, N 10, V 12, D 40);
    odd2: every width odd that may be (H 3, C 21, R 6, N 11, V 13, D 41, I 37, M 15): no row is a
    whole number of 16-byte vectors, and views split at odd offsets; mid: H 5, C 64, R 16, N 24, V 32, D 96."""
    if name == "lite":
        return ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    if name == "odd":
        return tiny_model(hidden=40, heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=10,
                          v_head_dim=12, intermediate=30, moe_intermediate=30)
    if name == "odd2":
        return tiny_model(hidden=41, heads=3, kv_lora_rank=21, qk_rope_head_dim=6, qk_nope_head_dim=11,
                          v_head_dim=13, intermediate=37, moe_intermediate=15, vocab=127)
    if name == "mid":
        return tiny_model(hidden=96, heads=5, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=24,
                          v_head_dim=32, intermediate=72, moe_intermediate=40)
    raise KeyError(name)


def act(*inner) -> TType:
    return TType(("T", *inner), "act")


@functools.lru_cache(maxsize=None)
def _runner(templates_dir: str | None):
    from runtime.launcher import KernelRunner
    return KernelRunner(templates_dir=templates_dir)


_TEMPLATES: list[str] = []   # innermost templates folder in force (tests/gpu/test_mutants.py), if any


def templates_dir() -> str | None:
    """The templates folder `templates_from` put in force (a mutant's), or None: templates/."""
    return _TEMPLATES[-1] if _TEMPLATES else None


def runner():
    """The KernelRunner of the tests: over templates/, or the folder `templates_from` put in force."""
    return _runner(templates_dir())


@contextlib.contextmanager
def templates_from(folder):
    """Compile the kernels of the tests run inside from another templates folder (a mutant)."""
    _TEMPLATES.append(str(folder))
    try:
        yield runner()
    finally:
        _TEMPLATES.pop()


def rand(shape, dtype: str, *, scale: float = 1.0, gen=None) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to("cuda", TORCH_DTYPES[dtype])


def strided_view(rows: int, n: int, dtype: str, extra: int, offset: int, gen) -> torch.Tensor:
    """A [rows, n] view into a wider parent (row stride n + extra, starting at `offset`)."""
    offset = min(offset, extra)
    parent = rand((rows, n + extra), dtype, gen=gen)
    return parent[:, offset:offset + n]


def empty_out(shape, dtype: str) -> torch.Tensor:
    return poison(torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="cuda"))


def lower(G, nid, dtype: str, block_size: int = 64):
    opts = Options(dtype=dtype, block_size=block_size)
    return family_for_op(G.nodes[nid]["op"]).lower(nid, G, opts)


def run_kernel(G, nid, dtype: str, *, values, weights=None, ctx=None, sizes, block_size: int = 64):
    launches = lower(G, nid, dtype, block_size)
    runner().run_all(launches, values=values, weights=weights or {}, ctx=ctx or {}, sizes=sizes)
    torch.cuda.synchronize()
    return launches


def reference(G, nid, inputs, weights=None, step=None):
    """The op's reference semantics on float64 copies of the kernel's inputs."""
    ins = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    ws = {role: weights[name].double() for role, name in G.nodes[nid]["weights"].items()} if weights else {}
    return OPS[G.nodes[nid]["op"]].run(node_view(G, nid), ins, ws, step)


def representable(t: torch.Tensor, dtype: str) -> bool:
    """Whether every element of a (float64) reference lies inside the activation type's range: fp16
    stops at 65504, and an example whose true values overflow it tests its inputs, not the kernel."""
    return bool((t.abs() <= torch.finfo(TORCH_DTYPES[dtype]).max).all())


class Recorder:
    """Counts examples and the worst errors per dtype (largest absolute, norm-wise relative);
    prints one line at the end."""

    def __init__(self, family: str):
        self.family = family
        self.n = 0
        self.worst: dict[str, float] = {}
        self.worst_rel: dict[str, float] = {}

    def check(self, actual: torch.Tensor, expected: torch.Tensor, dtype: str, msg: str = "",
              slack: torch.Tensor | None = None) -> None:
        """Element-wise within tolerance(dtype) (catches a wrong element anywhere) and norm-wise
        within STRICT[dtype] (catches a small systematic error everywhere).  `slack` (per element,
        float64): an error bound the hardware documents on top of the 16-bit tolerance (FP8 tensor
        cores' accumulation: tests/gpu/test_kernels_gemm_fp8.py), added to the element-wise one; the
        norm-wise check then measures each element's error beyond its slack (on a few hundred
        outputs, one element's accumulation error within the bound reached the bf16 norm-wise one)."""
        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        slack = None if slack is None else slack.detach().double().cpu()
        err = float((a - e).abs().max()) if a.numel() else 0.0
        if err != err:  # NaN: an element was not written
            err = float("inf")
        self.worst[dtype] = max(self.worst.get(dtype, 0.0), err)
        if slack is None:
            assert_close(actual, expected, dtype, msg)
        else:
            rtol, atol = tolerance(dtype)
            over = (a - e).abs() > atol + rtol * e.abs() + slack
            over |= a.isnan()
            assert not over.any(), (f"{msg}: {int(over.sum())} of {a.numel()} elements beyond the tolerance and "
                                    f"the accumulation slack, first at {over.nonzero()[0].tolist()}")
        if slack is not None:   # the error beyond the slack, of the error's sign
            d = a - e
            actual = e + d.sign() * (d.abs() - slack).clamp(min=0)
            actual[a.isnan()] = float("nan")
        rel = assert_strict(actual, expected, dtype, f"{self.family} {msg}".strip())
        self.worst_rel[dtype] = max(self.worst_rel.get(dtype, 0.0), rel)

    def example(self) -> None:
        self.n += 1

    def report(self) -> None:
        worst = " ".join(f"{k}:{v:.3g}" for k, v in sorted(self.worst.items()))
        rel = " ".join(f"{k}:{v:.3g}" for k, v in sorted(self.worst_rel.items()))
        print(f"\nEXAMPLES {self.family} {self.n} worst_err {worst} worst_rel {rel}")
        path = os.environ.get("DSGRAPH_TEST_REPORT")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"family": self.family, "examples": self.n, "worst_err": self.worst,
                                    "worst_rel": self.worst_rel}) + "\n")


__all__ = ["DTYPES", "MODEL_NAMES", "model", "act", "rand", "strided_view", "empty_out", "lower", "run_kernel",
           "reference", "representable", "Recorder", "kernel_test", "runner", "templates_from", "single_op_graph", "tolerance", "TORCH_DTYPES", "poison", "TType"]
