"""End to end on the GPU with msModelSlim's W4A8 and W8A8 layouts (issue 50): the cuda backend in bf16 against
the reference backend on the same checkpoint (its exact integer arithmetic, ir/formats_int.py).

A tiny V2-Lite-style model (tests/gpu/test_e2e_fp8.py's widths) saved by transformers (fp32) and written by
`dsgraph quantize --to w4a8 | w8a8`: the decoder's linears int8 per channel (W8A8_DYNAMIC), the routed experts
packed int4 per channel (W4A8_DYNAMIC 1.0.0) or int8 (w8a8), kv_b, the router, norms and the head float.  Both engines load the
checkpoint as stored: decode runs the int8 skinny linears (linear_skinny wi8) and the int expert kernels
(moe_gate_up_silu / moe_down wi4 or wi8: a per-row int8 quantiser, then mma.sync s8, int4 unpacked in
registers); prefill the same up to 16 tokens, the exact int8 library call for the dense linears above, and
the int expert kernels at every T ("-wgmma": the experts on the int8 wgmma GEMM above 16 tokens,
Tuning.moe.int_wgmma_above).

- logits (prefill, and paged decode after 4 tokens): our error against the reference in fp32 is at most 1.5x
  the reference's own in bf16 (the same quantised weights, the same bf16 rounding points);
- greedy tokens: each token we choose is the fp32 reference's argmax over our own trajectory, or within our
  measured logit error of it (a near tie that bf16 -- or an activation's int8 rounding -- may flip).

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_e2e_w4a8.py
"""
from __future__ import annotations

import pytest
import torch

from test_e2e_fp8 import _rel, _report, v2_lite_fp8_cuda_config

pytestmark = pytest.mark.gpu
DEV = "cuda"
PROMPTS = [[3, 17, 5, 22, 9, 41, 7], [11], list(range(8, 30))]   # 7, 1 and 22 tokens (the exact call above 16)


def write_int_checkpoint(root, to: str = "w4a8", seed: int = 0):
    from runtime.cli import main as cli_main
    from tests.e2e import hf_tiny
    config = v2_lite_fp8_cuda_config()
    torch.manual_seed(seed)
    model = hf_tiny._model_class(config)(config).eval()
    model.save_pretrained(root / "fp32")
    assert cli_main(["quantize", "--to", to, str(root / "fp32"), str(root / to)]) == 0
    return root / to


@pytest.fixture(scope="module", params=["w4a8", "w8a8", "w4a8-quantisers", "w4a8-wgmma", "w8a8-wgmma"])
def w4a8_engines(request, tmp_path_factory):
    """(format, cuda bf16 engine, reference fp32 engine, reference bf16 engine), all on the checkpoint;
    the defaults have the norms write their int8 readers' rows (Tuning.linear.norm_int8) and the skinny int8
    linears quantise x in their prologue up to 4 tokens; "-quantisers": the cuda engine with both off (every int8
    reader's own quantiser launch); "-wgmma": the routed experts on the int8 wgmma GEMM above 16 tokens
    (Tuning.moe.int_wgmma_above: the 30-token prefill runs it)."""
    from codegen.tuning import LinearTuning, MoeTuning, Tuning
    from runtime import Engine
    fmt, _, variant = request.param.partition("-")
    path = write_int_checkpoint(tmp_path_factory.mktemp(fmt), fmt)
    kw = dict(device=DEV, block_size=5, num_blocks=64, max_seq_len=128)
    tuning = {"": None, "quantisers": Tuning(linear=LinearTuning(norm_int8=False, i8_prologue_upto=0)),
              "wgmma": Tuning(moe=MoeTuning(int_wgmma_above=16))}[variant]
    ours = Engine.from_pretrained(path, backend="cuda", dtype=torch.bfloat16, tuning=tuning, **kw)
    ref = Engine.from_pretrained(path, backend="reference", dtype=torch.float32, **kw)
    ref_bf16 = Engine.from_pretrained(path, backend="reference", dtype=torch.bfloat16, **kw)
    return request.param, ours, ref, ref_bf16


def test_the_cuda_backend_runs_the_int_kernels(w4a8_engines):
    to, ours, _, _ = w4a8_engines
    fmt, _, variant = to.partition("-")
    tag = "wi4" if fmt == "w4a8" else "wi8"
    for phase in ("decode", "prefill"):
        names = [getattr(s, "name", "") for s in ours.backend.plans[phase].steps]
        for part in (f"moe_gate_up_silu__bf16_{tag}__", f"moe_down__bf16_{tag}__", "linear_skinny__bf16_wi8__"):
            assert any(n.startswith(part) for n in names), (phase, part, names)
        norms = [n for n in names if "rms_norm__" in n and n.endswith("__qi8")]
        assert bool(norms) != (variant == "quantisers"), (phase, names)
        wgmma = [n for n in names if n.endswith("__wgmma_int")]
        assert len(wgmma) == (2 * 1 if variant == "wgmma" else 0), (phase, names)   # gate_up_silu, down: 1 MoE layer


def test_int_logits_within_the_references_own_bf16_error(w4a8_engines):
    to, ours, ref, ref_bf16 = w4a8_engines
    for decode_after in (None, 4):
        got = ours.logits(PROMPTS, decode_after=decode_after)
        want = ref.logits(PROMPTS, decode_after=decode_after)
        low = ref_bf16.logits(PROMPTS, decode_after=decode_after)
        for p, o, w, lo in zip(PROMPTS, got, want, low):
            e_ours, e_ref = _rel(o, w), _rel(lo, w)
            _report(f"{to}_v2_lite_len{len(p)}_after{decode_after}_rel_ours_vs_reference_bf16",
                    f"{e_ours:.4g} / {e_ref:.4g}")
            assert e_ours <= 1.5 * e_ref + 1e-3, f"len {len(p)}: ours {e_ours:.4g} vs reference bf16 {e_ref:.4g}"


def test_int_greedy_tokens_follow_the_reference_along_our_trajectory(w4a8_engines):
    from runtime import SamplingParams
    to, ours, ref, _ = w4a8_engines
    outs = ours.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for p, o in zip(PROMPTS, outs):
        full = p + o.token_ids
        want = ref.logits([full])[0].float()                       # fp32 over our own tokens
        got = ours.logits([full], decode_after=len(p))[0].float()  # ours over the same positions, decoded
        flips = 0
        for i, tok in enumerate(o.token_ids):
            row = len(p) - 1 + i                                   # the position that predicted token i
            best = int(want[row].argmax())
            if tok == best:
                continue
            gap = float(want[row, best] - want[row, tok])
            err = float((got[row] - want[row]).abs().max())
            assert gap <= 2 * err, f"prompt {p}: token {i} is {tok}, the reference's argmax {best} leads by " \
                                   f"{gap:.4g} (our logit error there {err:.4g})"
            flips += 1
        _report(f"{to}_v2_lite_len{len(p)}_near_tie_flips", flips)
