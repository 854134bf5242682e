"""`dsgraph explain` prints, per op and token count, the kernel the lowering runs and the dispatch
table row's reason; `--tune` moves it; a bad setting is one line.  And `dsgraph compile --tune`."""
from __future__ import annotations

import json

import pytest

import codegen.nvrtc as nvrtc
from runtime.cli import main
from tiny import ROOT, write_tiny_spec

LITE = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")


def _explain(capsys, *argv) -> str:
    assert main(["explain", LITE, *argv]) == 0
    return capsys.readouterr().out


def _block(out: str, head: str) -> str:
    """The lines of one phase / T section."""
    return out.split(head + " ", 1)[1].split("\n\n", 1)[0]


def test_explain_v2_lite_at_the_issues_token_counts(capsys):
    out = _explain(capsys, "--tokens", "1,48,300,16384")
    assert out.startswith("deepseek_v2_lite (") and "sm_90, bf16, tuning defaults" in out.splitlines()[0]
    for phase in ("prefill", "decode"):
        for T in (1, 48, 300, 16384):
            assert f"\n{phase}, T = {T} " in out, (phase, T)
    d1 = _block(out, "decode, T = 1")
    assert "moe_down__bf16__e66__d2048_m1408__wgmma_skinny_t1" in d1 and "down at one token" in d1
    assert "moe_gate_up_silu__bf16__e66_k8__m1408_d2048__sh2w__wgmma_skinny" in d1
    assert "moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256" in d1
    assert "linear_skinny__bf16__k2048__o3072_576" in d1 and "skinny [tokens 1..16]" in d1
    d48 = _block(out, "decode, T = 48")
    assert "moe_expert_ffn__bf16__e66_k8__m1408_d2048__st32__fused" in d48 and "fused [tokens 4..256]" in d48
    assert "library torch.nn.functional.linear" in d48 and "library [tokens 17..inf]: cuBLAS GEMM" in d48
    assert "mla_decode_attention__bf16__c512_r64__h16__page64" in d48
    p300 = _block(out, "prefill, T = 300")
    assert "moe_gate_up_silu__bf16__e66_k8__m1408_d2048__wgmma" in p300 and "wgmma [tokens 257..inf]" in p300
    assert "moe_route__bf16__e64_d2048__gemm" in p300 and "router_gemm [tokens 257..inf]" in p300
    assert "mla_prefill_attention__bf16__h16_n128_r64_v128__mma__v2_m64n64w16q" in p300
    p16k = _block(out, "prefill, T = 16384")
    assert "moe_route__e66__align_count" in p16k


def test_explain_follows_the_tuning(capsys):
    out = _explain(capsys, "--tokens", "48", "--phase", "decode", "--tune", "moe.expert_ffn_upto=32")
    assert "tuning moe.expert_ffn_upto=32" in out.splitlines()[0] and "prefill," not in out
    d48 = _block(out, "decode, T = 48")
    assert "st32__fused" not in d48 and "moe_gate_up_silu__bf16__e66_k8__m1408_d2048__sh2w__wgmma_skinny" in d48
    assert "two_launch [tokens 33..inf]" in d48


@pytest.mark.slow
def test_explain_with_w4a8_weights_and_the_int8_prologue(capsys):
    """`--weights w4a8` explains the spec the bench compiles with msModelSlim's formats; with
    linear.i8_prologue_upto=4 (the default) and the norms' rows off every int8 linear of V2-Lite (q + kv_a, o,
    the dense FFN, the shared experts) runs its prologue kernel alone at b=1, and the quantiser and the int8
    kernel at b=8."""
    out = _explain(capsys, "--tokens", "1,8", "--phase", "decode", "--weights", "w4a8",
                   "--tune", "linear.norm_int8=false")
    assert "--weights w4a8, tuning linear.norm_int8=False" in out.splitlines()[0]
    d1, d8 = _block(out, "decode, T = 1"), _block(out, "decode, T = 8")
    assert "linear_skinny__bf16_qi8" not in d1 and "skinny_wi8_xq [tokens 1..4]" in d1
    for name in ("k2048__o3072_576__xq4", "k2048__o2048__xq4", "k2048__silu2816__xq4", "k2816__o2048__xq4"):
        assert f"linear_skinny__bf16_wi8__{name}" in d1, name
    assert "linear_skinny__bf16_qi8__k2048, linear_skinny__bf16_wi8__k2048__o3072_576\n" in d8 and "xq4" not in d8
    assert "moe_down__bf16_qi8__k1408" in d8


def test_explain_weights_that_the_spec_does_not_declare_is_one_line(capsys):
    seed = str(ROOT / "model_specs" / "deepseek_v3_1_w4a8_seed.yaml")
    assert main(["explain", seed, "--weights", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsgraph: error: ") and "--weights fp8" in err and err.count("\n") == 1, err


def test_explain_lists_the_knobs(capsys):
    assert main(["explain", "--knobs", "--tune", "route.fused_upto=8"]) == 0
    out = capsys.readouterr().out
    assert "moe.expert_ffn_upto" in out and "route.fused_upto" in out and "(set: 8)" in out


def test_a_bad_tune_is_one_line(capsys):
    assert main(["explain", LITE, "--tune", "moe.expert_ffn_uptoo=128"]) == 2
    err = capsys.readouterr().err
    assert err == ("dsgraph: error: unknown tuning knob 'moe.expert_ffn_uptoo' "
                   "(did you mean moe.expert_ffn_upto?)\n")


def test_compile_with_tune_is_another_bundle_that_records_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    spec = write_tiny_spec(tmp_path / "t.yaml")
    args = ["compile", str(spec), "--allow-unlowered", "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "-o", str(tmp_path / "a")]) == 0
    plain = capsys.readouterr().out
    assert main([*args, "-o", str(tmp_path / "b"), "--tune", "route.fused_upto=8"]) == 0
    tuned = capsys.readouterr().out
    assert "miss" in tuned and "tuning   route.fused_upto=8" in tuned and "tuning " not in plain
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["options"]["tuning"] == {"route.fused_upto": 8} and m["tuning"]["route"]["fused_upto"] == 8


@pytest.mark.slow
def test_explain_with_fp8_weights_and_the_norms_fp8_rows(capsys):
    """`--weights fp8` (linear.norm_fp8 on by default) on V2-Lite's prefill: at T = 1 the norms' plain launches
    and the skinny kernels; at T = 128 (above the FP8 skinny kernel's 16-token chunks and the experts' weight-only
    tiles, moe.fp8_activations_above) the input norms write the e4m3 rows and q + kv_a's GEMMs read them (no
    quantiser), o_proj keeps its quantiser, the MoE input norms write them too and the experts' gate_up reads them,
    down keeps its quantiser; the same at T = 16384.  Every FP8 x FP8 GEMM is the overlapped one (moe.fp8_overlap)."""
    out = _explain(capsys, "--tokens", "1,128,16384", "--phase", "prefill", "--weights", "fp8")
    assert "--weights fp8, tuning defaults" in out.splitlines()[0]
    p1, p128, p16k = (_block(out, f"prefill, T = {T}") for T in (1, 128, 16384))
    assert "__qf8" not in p1 and "e4m3 rows" not in p1 and "quant_x" not in p1
    assert "rms_norm__bf16__d2048__qf8" in p128 and "moe_combine_residual_rms_norm__bf16__k8_d2048__shared2__qf8" in p128
    assert "runs   gemm_fp8__bf16_wfp8__k2048__o3072__ovl__ew, gemm_fp8__bf16_wfp8__k2048__o576__ovl__ew\n" in p128
    assert "x's e4m3 rows and scales come from the RMSNorm that makes x (linear.norm_fp8)" in p128
    assert "the RMSNorm also writes its output's e4m3 rows and scales (linear.norm_fp8)" in p128
    assert "gemm_fp8__bf16__k2048__quant_x, gemm_fp8__bf16_wfp8__k2048__o2048__ovl__ew\n" in p128      # o_proj
    for p in (p128, p16k):
        assert "runs   moe_gate_up_silu__bf16_wfp8_afp8__e66_k8__m1408_d2048__ovl__wgmma_fp8\n" in p
        assert "gemm_fp8__bf16__k1408__quant_x, moe_down__bf16_wfp8_afp8__e66__d2048_m1408__ovl__wgmma_fp8" in p
        assert "fused_add_rms_norm__bf16__d2048__qf8" in p and "fused_add_rms_norm__bf16__d2048\n" not in p
