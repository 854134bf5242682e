"""Planted mutants: the kernel property tests must be strict enough to catch a 1% bug.

Each mutant copies templates/ to a temporary folder, changes one constant or one line by 1%
(a softmax scale, an eps, a routing weight, the rope attention factor), and runs one fixed
example of the family's own property test (its Hypothesis body, `inner_test`) with kernels
compiled from the mutated folder.  The unmutated kernel must pass that example and the mutant
must fail it.  A mutation site that no longer matches exactly once fails the test with the
site, so a template change cannot silently turn a mutant into a no-op.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import test_kernels_combine_stream as combine_stream
import test_kernels_dense as dense
import test_kernels_gemm_fp8 as gemm_fp8
import test_kernels_gemm_int8 as gemm_int8
import test_kernels_gemm_multi as gemm_multi
import test_kernels_int4_unpack as int4_unpack
import test_kernels_linear as linear
import test_kernels_linear_fp8 as linear_fp8
import test_kernels_linear_fp8_chunks as linear_fp8_chunks
import test_kernels_linear_int8 as linear_int8
import test_kernels_linear_int8_chunks as linear_int8_chunks
import test_kernels_mla as mla
import test_kernels_mla_fp8 as mla_fp8
import test_kernels_moe as moe
import test_kernels_moe_expert_ffn as moe_ffn
import test_kernels_moe_fp8 as moe_fp8
import test_kernels_moe_gemm_fp8 as moe_gemm_fp8
import test_kernels_moe_gemm_int as moe_gemm_int
import test_kernels_moe_int as moe_int
import test_kernels_moe_wgmma as moe_wgmma
import test_kernels_moe_wgmma_skinny as moe_wgmma_skinny
import test_kernels_norm_fp8 as norm_fp8
import test_kernels_norm_int8 as norm_int8
import test_kernels_persistent as persistent
import test_kernels_v_up_fp8 as v_up_fp8
from harness import GPU_MARKS
from kernel_cases import templates_from

pytestmark = GPU_MARKS
TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str                 # under templates/
    old: str                  # must occur exactly once
    new: str
    test: object              # a Hypothesis property test of tests/gpu
    example: dict = field(default_factory=dict)
    uses_runner: bool = False  # the MoE tests take the KernelRunner as an argument


# a segment member's waits and the barrier after them (templates/segment.cu.j2)
SEGMENT_WAITS = ("{% for w in m.waits %}\n        dsg::seg::wait_member(counters, {{ w }}, (unsigned)tasks[{{ w }}]);\n"
                 "{% endfor %}\n        dsg::seg::waited();")

# the last member skips its waits, the member before it made slow (100 us a task)
SEGMENT_WAIT = "        dsg::seg::wait_member(counters, {{ w }}, (unsigned)tasks[{{ w }}]);"
SEGMENT_LAST_SKIPS = ("        if ({{ j }} + 1 < MEMBERS) "
                      "dsg::seg::wait_member(counters, {{ w }}, (unsigned)tasks[{{ w }}]);\n"
                      "        if ({{ j }} + 2 == MEMBERS) __nanosleep(100000);")


def segment_first_reader_skips() -> str:
    """SEGMENT_WAITS with member 1's waits left out and member 0's tasks slowed by 100 us (so that
    member 1 reads member 0's outputs before they are written on any grid of more than one CTA)."""
    return SEGMENT_WAITS.replace("        dsg::seg::wait_member", "        if ({{ j }} != 1) dsg::seg::wait_member") \
        .replace("        dsg::seg::waited();", "        if ({{ j }} == 0) __nanosleep(100000);\n        dsg::seg::waited();")


# gemm_fp8.cuh's K loop, shared by the dense FP8 GEMM and the FP8 x FP8 experts: a K block's four scales
SCALES_SITE = "const float xa = r.sxa[kb], xb = r.sxb[kb], wg = r.swg[kb], wu = r.swu[kb];"
FIRST_BLOCK_XA_FROM_XB = ("const float xa = kb == 0 ? r.sxb[kb] : r.sxa[kb], xb = r.sxb[kb], wg = r.swg[kb], "
                          "wu = r.swu[kb];")
# gemm_ring.cuh's producer (linear.gemm_weights_early): the first box of a stage the AHEAD part issues (before
# the wait) forgets its split's first K block, so a split z > 0 gets split 0's weights in its early stages.
# (Issuing a step more early than AFTER_AHEAD skips is no wrong value but a trap: the second TMA completes its
# bytes on a barrier phase already done, an unspecified launch failure the harness does not count as caught.)
EARLY_BOX = "tma::load_2d(b, w0, k0, n0, &full[s]);"
EARLY_BOX_SPLIT_0 = "tma::load_2d(b, w0, PART == AHEAD ? (kb - kr.first) * BK : k0, n0, &full[s]);"
# gemm_fp8.cu.j2 / gemm_int8.cu.j2, linear.gemm_multi: the weight, scales and output a part's GEMM is called with
MULTI_SCALES = "&w{{ loop.index0 }}, sw{{ loop.index0 }}, nullptr, nullptr, y{{ loop.index0 }},"
MULTI_SCALES_OF_PART_0 = "&w{{ loop.index0 }}, sw0, nullptr, nullptr, y{{ loop.index0 }},"
SCALES_RETURN = "return {xa, xb, wg, wu};"
FIRST_BLOCK_UNPROMOTED = "return {kb == 0 ? 0.f : xa, kb == 0 ? 0.f : xb, wg, wu};"

def _lite_decode():
    """bf16 decode at V2-Lite's widths (the tensor-core split): 3 sequences, two of them long."""
    return (64, [1, 1, 1], [700, 65, 1300])


def _prologue_case(**kw) -> dict:
    """A fixed example of the int8 prologue kernel's test: V2-Lite's o_proj at its b=4, unless kw says otherwise."""
    return {**dict(dtype="bf16", T=4, n=4, K=2048, rows=[2048], silu=False, variant=linear_int8.VARIANTS[0], extra=0,
                   offset=0, shift="none", kind="random"), **kw}


MUTANTS = [
    Mutant("decode attention softmax scale x1.01 (tensor cores)", "mla_decode_attention.cu.j2",
           "constexpr float SCALE = {{ scale }};", "constexpr float SCALE = {{ scale }} * 1.01f;",
           mla.test_mla_decode_attention, dict(name="lite", dtype="bf16", batch=_lite_decode(), lead=0, seed=3)),
    Mutant("decode attention softmax scale x1.01 (CUDA cores, fp32)", "mla_decode_attention.cu.j2",
           "constexpr float SCALE = {{ scale }};", "constexpr float SCALE = {{ scale }} * 1.01f;",
           mla.test_mla_decode_attention, dict(name="odd2", dtype="fp32", batch=(16, [1, 1], [33, 300]), lead=1, seed=4)),
    Mutant("decode attention level-2 merge x1.01 (clusters of 8, two an item)", "include/mla_decode.cuh",
           "const float inv = W > 0.f ? 1.f / W : 0.f;", "const float inv = W > 0.f ? 1.01f / W : 0.f;",
           mla.test_mla_decode_attention, dict(name="lite", dtype="bf16", batch=_lite_decode(), lead=0, seed=6)),
    Mutant("decode attention reads the cache rows of this step before its PDL wait", "include/mla_decode.cuh",
           "fresh = sp.valid ? sp.fresh_from(positions) : 0;",
           "fresh = sp.valid ? sp.r_end : 0;",
           mla.test_mla_decode_attention_reads_this_steps_rows_after_its_wait, dict(ctx_lens=[512], qlen=1, seed=11)),
    Mutant("prefill attention softmax scale x1.01", "mla_prefill_attention.cu.j2",
           "constexpr float SCALE = {{ scale }};", "constexpr float SCALE = {{ scale }} * 1.01f;",
           mla.test_mla_prefill_attention, dict(name="lite", dtype="bf16", qlens=[65, 130], lead=0, seed=5)),
    Mutant("prefill attention over a cached prefix sees one key too many", "include/mla_prefill_tc2.cuh",
           "const i64 pos0 = positions[qs] - (Lk - L);", "const i64 pos0 = positions[qs] - (Lk - L) - 1;",
           mla.test_mla_prefill_attention_over_a_cached_prefix,
           dict(name="lite", dtype="bf16", qlens=[65, 3], prefixes=[64, 5, 0, 0], lead=0, seed=5)),
    Mutant("rope attention factor x1.01 (q)", "rope_q.cu.j2",
           "constexpr float kAttentionFactor = {{ rope_attention_factor }};",
           "constexpr float kAttentionFactor = {{ rope_attention_factor }} * 1.01f;",
           mla.test_rope_q, dict(name="lite", dtype="bf16", bs=64, lens=[40, 3], layout=("adjacent", "interleaved"),
                                 lead=0, seed=6)),
    Mutant("decode query's rope reads its pair swapped (q_pe loaded beside the position)", "mla_decode_query.cu.j2",
           "dsg::rope_rotate<act_t>(x1, x2, c * kAttentionFactor, s * kAttentionFactor, y[oa], y[ob]);",
           "dsg::rope_rotate<act_t>(x2, x1, c * kAttentionFactor, s * kAttentionFactor, y[oa], y[ob]);",
           mla.test_mla_decode_prologue, dict(name="lite", dtype="bf16", lens=[1], bs=64,
                                              layout=("adjacent", "interleaved"), lead=0, seed=13)),
    Mutant("cache write's rope x1.01 (k_pe loaded with the token's other inputs)", "include/mla_kv_write.cuh",
           "rope_rotate<T>(x1[j], x2[j], cs[2 * i], cs[2 * i + 1], ya, yb);",
           "rope_rotate<T>(x1[j] * 1.01f, x2[j] * 1.01f, cs[2 * i], cs[2 * i + 1], ya, yb);",
           mla.test_mla_decode_prologue, dict(name="lite", dtype="bf16", lens=[1], bs=64,
                                              layout=("adjacent", "interleaved"), lead=0, seed=13)),
    Mutant("rms_norm eps x1.01 (fp32, rows whose mean square is ~eps)", "rms_norm.cu.j2",
           "constexpr float EPS = {{ eps }};", "constexpr float EPS = {{ eps }} * 1.01f;",
           dense.test_rms_norm, dict(name="lite", dtype="fp32", T=9, which="kv_lora_rank", extra=0, offset=0,
                                     shift=False, magnitude=1e-3, seed=7)),
    Mutant("routed scaling factor x1.01 (routing weights)", "moe_topk.cu.j2",
           "{{ scaling }},", "{{ scaling }} * 1.01f,",
           moe.test_moe_topk, dict(case={
               "dtype": "fp32", "T": 33, "D": 64, "E": 64, "K": 6, "bias": True, "misalign": "none", "seed": 8,
               "attrs": {"scoring": "sigmoid", "method": "noaux_tc", "groups": 8, "topk_groups": 4,
                         "norm_topk_prob": True, "routed_scaling_factor": 2.5}}), uses_runner=True),
    Mutant("routed scaling factor x1.01 (the fused route, T <= route.fused_upto)", "moe_route.cu.j2",
           "constexpr float kScaling = {{ scaling }};", "constexpr float kScaling = {{ scaling }} * 1.01f;",
           moe.test_moe_route_fused, dict(case=moe._shape_case("v3", "bf16", 9)), uses_runner=True),
    Mutant("fused route tickets never reset (a second run or graph replay routes nothing)", "include/tickets.cuh",
           '"st.relaxed.gpu.global.u32 [%0], 0;\\n"', '""',
           moe.test_moe_route_fused_runs_again_and_replays_in_a_graph,
           dict(case=moe._shape_case("v2_lite", "bf16", 9)), uses_runner=True),
    Mutant("router GEMM logits x1.01 (prefill sizes)", "include/router_gemm.cuh",
           "logits[(i64)t * E + e] = acc[i][j];", "logits[(i64)t * E + e] = acc[i][j] * 1.01f;",
           moe.test_moe_route_gemm, dict(case=moe._gemm_case("v2_lite", "bf16", 1000)), uses_runner=True),
    Mutant("router GEMM split sum leaves out the last CTA's own partial", "include/router_gemm.cuh",
           "sum[i][j] += acc[i][j];", "sum[i][j] += 0.f;",
           moe.test_moe_route_gemm, dict(case=moe._gemm_case("odd_e", "fp32", 1000, sms=4096)), uses_runner=True),
    Mutant("router GEMM split tickets never reset (a second run or graph replay writes no logits)",
           "include/tickets.cuh", '"st.relaxed.gpu.global.u32 [%0], 0;\\n"', '""',
           moe.test_moe_route_gemm_runs_again_and_replays_in_a_graph,
           dict(case=moe._gemm_case("v2_lite", "bf16", 1000, sms=4096)), uses_runner=True),
    Mutant("combine routing weight x1.01", "include/moe_combine.cuh",
           "const float wk = w[(i64)t * K + k];\n    // a pair of weight 0",
           "const float wk = w[(i64)t * K + k] * 1.01f;\n    // a pair of weight 0",
           moe.test_moe_combine, dict(case={"dtype": "bf16", "T": 33, "K": 6, "D": 2048, "misalign": "none", "seed": 9}),
           uses_runner=True),
    Mutant("decode combine's sum x1.01 (every row of the token loaded before the first sum)",
           "include/moe_combine.cuh",
           "v[i] = plus_residual<T>(plus_shared<T>(v[i], es[0][i]), res[i]);",
           "v[i] = plus_residual<T>(plus_shared<T>(v[i], es[0][i]), res[i]) * 1.01f;",
           moe.test_moe_combine_residual_rms_norm, dict(case=moe._combine_case("bf16", 1, 8, 2048, S=2)),
           uses_runner=True),
    Mutant("streamed combine + norm: the next token's copies read the current token's rows",
           "moe_combine_residual_rms_norm_stream.cu.j2",
           "Stream::issue(eo, w, sh, residual, t + gridDim.x, stage, wk);",
           "Stream::issue(eo, w, sh, residual, t, stage, wk);",
           combine_stream.test_streamed_combine_is_bit_equal_to_the_plain_kernel,
           dict(case=combine_stream._case(1001, 2048, 8, 2, None, sms=3))),
    Mutant("streamed combine + norm: the sums read the stage without waiting for the copies",
           "include/moe_combine_stream.cuh", "    mma::cp_async_wait<0>();\n", "",
           combine_stream.test_streamed_combine_is_bit_equal_to_the_plain_kernel,
           dict(case=combine_stream._case(1001, 2048, 8, 2, "fp8", sms=3))),
    Mutant("shared experts' pair weight x1.01 (the fused route, fuse_shared_experts)", "include/moe_router.cuh",
           "weights[lane] = 1.f;", "weights[lane] = 1.01f;",
           moe.test_moe_route_fused, dict(case=moe._shape_case("v2_lite", "bf16", 9)), uses_runner=True),
    Mutant("the fused route's one-tile ids in shared memory point one expert off (b=1's alignment)",
           "include/moe_router.cuh",
           "id_copy[lane] = lane < K ? my_id + S : lane - K;", "id_copy[lane] = lane < K ? my_id + S + 1 : lane - K;",
           moe.test_moe_route_fused, dict(case=moe._shape_case("v2_lite", "bf16", 1)), uses_runner=True),
    Mutant("shared experts' output x1.01 (residual combine summing the shared pairs)", "include/moe_combine.cuh",
           "for (int v = 0; v < N; ++v) sh[v] = round_to<T>(sh[v]);",
           "for (int v = 0; v < N; ++v) sh[v] = round_to<T>(sh[v] * 1.01f);",
           moe.test_moe_combine_residual, dict(case=moe._combine_case("fp32", 33, 8, 2048, S=2)), uses_runner=True),
    Mutant("swapped expert tile output x1.01 (down, few pairs per expert)", "include/moe_grouped.cuh",
           "if (col < N) o0[col] = from_float<T>(acc[j][c]);", "if (col < N) o0[col] = from_float<T>(acc[j][c] * 1.01f);",
           moe.test_moe_down_pair_counts, dict(case={
               "dtype": "fp16", "T": 122, "E": 4, "K": 1, "counts": [16, 33, 64, 9], "D": 256, "M": 200,
               "misalign": "none", "seed": 10}), uses_runner=True),
    Mutant("light expert output x1.01 (gate_up_silu, CUDA-core slots of the one-grid launch)", "include/moe_grouped.cuh",
           "out0[o] = from_float<T>(s * u);", "out0[o] = from_float<T>(s * u * 1.01f);",
           moe.test_moe_gate_up_silu_pair_counts, dict(case={
               "dtype": "fp16", "T": 15, "E": 6, "K": 1, "counts": [1, 2, 2, 1, 9, 0], "D": 256, "M": 200,
               "misalign": "none", "seed": 12}), uses_runner=True),
    Mutant("wgmma expert tile output x1.01 (gate_up_silu, sm_90a, many pairs per expert)", "include/moe_wgmma.cuh",
           "v[c] = round_to<T>(__fdividef(gr, 1.f + __expf(-gr))) * ur;",
           "v[c] = round_to<T>(__fdividef(gr, 1.f + __expf(-gr))) * ur * 1.01f;",
           moe_wgmma.test_moe_gate_up_silu_wgmma, dict(case={
               "dtype": "bf16", "T": 452, "E": 6, "K": 1, "counts": [130, 64, 1, 0, 129, 128], "KD": 136, "N": 200,
               "misalign": "none", "seed": 13}), uses_runner=True),
    Mutant("decode wgmma expert tile output x1.01 (gate_up_silu, sm_90a, few pairs per expert)",
           "include/moe_wgmma_skinny.cuh",
           "st(out0 + orow + col, round_to<T>(gr / (1.f + expf(-gr))) * ur);",
           "st(out0 + orow + col, round_to<T>(gr / (1.f + expf(-gr))) * ur * 1.01f);",
           moe_wgmma_skinny.test_moe_gate_up_silu_wgmma_skinny, dict(case={
               "dtype": "bf16", "T": 72, "E": 6, "K": 2, "counts": [15, 16, 17, 31, 32, 33], "KD": 136, "N": 200,
               "misalign": "none", "seed": 16}), uses_runner=True),
    Mutant("decode wgmma expert tile output x1.01 (down, the second 64-row box)", "include/moe_wgmma_skinny.cuh",
           "if (col + WS_BOX < N) st(out0 + orow + col + WS_BOX, acc1[i]);",
           "if (col + WS_BOX < N) st(out0 + orow + col + WS_BOX, acc1[i] * 1.01f);",
           moe_wgmma_skinny.test_moe_down_wgmma_skinny, dict(case={
               "dtype": "fp16", "T": 25, "E": 4, "K": 1, "counts": [9, 8, 7, 1], "KD": 64, "N": 200,
               "misalign": "none", "seed": 17}), uses_runner=True),
    Mutant("decode wgmma down's early weight slices one K slice off (issued before the PDL wait)",
           "include/moe_wgmma_skinny.cuh",
           "s * WS_BK, n0, e, &full[s]);",
           "(s + 1) * WS_BK, n0, e, &full[s]);",
           moe_wgmma_skinny.test_moe_down_wgmma_skinny, dict(case={
               "dtype": "bf16", "T": 25, "E": 4, "K": 1, "counts": [9, 8, 7, 1], "KD": 136, "N": 200,
               "misalign": "none", "seed": 18}), uses_runner=True),
    Mutant("decode wgmma down's one-token launch: its 8 early slices one K slice off (before the PDL wait)",
           "include/moe_wgmma_skinny.cuh",
           "s * WS_BK, n0, e, &full[s]);",
           "(s + 1) * WS_BK, n0, e, &full[s]);",
           moe_wgmma_skinny.test_moe_down_one_token_launch,
           dict(case=moe_wgmma_skinny._one("bf16", 66, (0, 1, 5, 17, 30, 41, 50, 65), 1408, 2048, seed=25)),
           uses_runner=True),
    Mutant("decode wgmma gate_up_silu's shared-expert slices one K slice off (issued before the PDL wait)",
           "include/moe_wgmma_skinny.cuh",
           "s * WS_BK, n0, e, &full[s]);",
           "(s + 1) * WS_BK, n0, e, &full[s]);",
           moe_ffn.test_moe_expert_ffn_shared_experts_start_before_the_wait,
           dict(case={**moe_ffn._case("bf16", [1] * 8 + [0] * 58, 8, 2048, 1408, seed=24), "shared": 2}),
           uses_runner=True),
    Mutant("decode wgmma gate_up_silu's shared tile before the PDL wait: every shared expert takes the first one's pairs",
           "include/moe_wgmma_skinny.cuh",
           "shared_order[threadIdx.x] = (rt * WS_BP + threadIdx.x) * K + K - SH + tl.e;",
           "shared_order[threadIdx.x] = (rt * WS_BP + threadIdx.x) * K + K - SH;",
           moe_ffn.test_moe_expert_ffn_shared_experts_start_before_the_wait,
           dict(case={**moe_ffn._case("bf16", moe_ffn._lite(3), 8, 2048, 1408, seed=26), "shared": 2}),
           uses_runner=True),
    Mutant("expert FFN's staged epilogue x1.01 (gate_up_silu's a, tiles of 32+ pairs)", "include/moe_wgmma_skinny.cuh",
           "put(r, col, round_to<T>(gr / (1.f + expf(-gr))) * ur);",
           "put(r, col, round_to<T>(gr / (1.f + expf(-gr))) * ur * 1.01f);",
           moe_ffn.test_moe_expert_ffn_fused, dict(case=moe_ffn._case("bf16", (40, 33, 7), 2, 136, 200, seed=22)),
           uses_runner=True),
    Mutant("expert FFN's staged epilogue x1.01 (down's second 64-row box, tiles of 32+ pairs)",
           "include/moe_wgmma_skinny.cuh", "put(r, col + WS_BOX, acc1[i]);", "put(r, col + WS_BOX, acc1[i] * 1.01f);",
           moe_ffn.test_moe_expert_ffn_fused, dict(case=moe_ffn._case("fp16", (40, 33, 7), 2, 136, 200, seed=23)),
           uses_runner=True),
    Mutant("expert FFN's down tiles never wait for their row tile (read a before gate_up_silu writes it)",
           "include/moe_expert_ffn.cuh",
           "if (ld_acquire_gpu(ready + rt) < (unsigned)NCT_GU) {",
           "if (false) {",
           moe_ffn.test_moe_expert_ffn_fused, dict(case=moe_ffn._case("bf16", [1] * 8, 8, 136, 200, seed=19)),
           uses_runner=True),
    Mutant("expert FFN's row-tile counters never reset (the next launch's down tiles do not wait)",
           "include/moe_expert_ffn.cuh", "atomicExch(ready + rt, 0u);", "(void)rt;",
           moe_ffn.test_moe_expert_ffn_fused, dict(case=moe_ffn._case("bf16", [1] * 8, 8, 136, 200, seed=20)),
           uses_runner=True),
    Mutant("expert FFN's walk counter never reset (the next launch finds every tile taken)",
           "include/moe_expert_ffn.cuh", "atomicExch(walk, 0u);", "(void)walk;",
           moe_ffn.test_moe_expert_ffn_fused, dict(case=moe_ffn._case("bf16", [1] * 8, 8, 136, 200, seed=21)),
           uses_runner=True),
    Mutant("skinny linear output x1.01 (tensor cores, two stacked weights)", "include/skinny.cuh",
           "if (tok < ntok) store_out<T, ROWS...>(m, row, tok, s);",
           "if (tok < ntok) store_out<T, ROWS...>(m, row, tok, s * 1.01f);",
           linear.test_linear_skinny, dict(dtype="bf16", T=5, K=512, rows=[100, 50], extra=0, offset=0, shift="none",
                                           variant=linear.VARIANTS[0], seed=13)),
    Mutant("skinny linear output x1.01 (fp32, CUDA cores)", "include/skinny.cuh",
           "store_out<float, ROWS...>(m, row0 + i / MAX_TOKENS, tok, s);",
           "store_out<float, ROWS...>(m, row0 + i / MAX_TOKENS, tok, s * 1.01f);",
           linear.test_linear_skinny, dict(dtype="fp32", T=3, K=300, rows=[40], extra=0, offset=0, shift="none",
                                           variant=linear.VARIANTS[0], seed=14)),
    Mutant("SwiGLU epilogue of the fused gate + up x1.01 (skinny linear)", "include/skinny.cuh",
           "m.y[0][(i64)tok * N + col] = from_float<T>(s * u);", "m.y[0][(i64)tok * N + col] = from_float<T>(s * u * 1.01f);",
           linear.test_gate_up_silu, dict(dtype="bf16", T=3, K=256, n=40, extra=0, offset=0, shift="none",
                                          variant=linear.VARIANTS[0], seed=15)),
    # the producer's tasks made slow (100 us each) so that the skipped wait loses the race on any grid of
    # more than one CTA: without the sleep the last tiles of gate_up_silu land before down reads them
    Mutant("persistent segment: the last member skips its wait (down reads gate_up_silu's output early)",
           "segment.cu.j2", SEGMENT_WAIT, SEGMENT_LAST_SKIPS,
           persistent.test_segment_equals_the_launches_it_replaces, dict(ctas=1, case=("mlp", "bf16", "lite"), T=1,
                                                                         seed=50)),
    # the same at two CTAs an SM (persistent.ctas_per_sm=2: its launch bounds, 264 CTAs among the grids)
    Mutant("persistent segment, two CTAs an SM: the last member skips its wait (down reads gate_up_silu's output "
           "early)",
           "segment.cu.j2", SEGMENT_WAIT, SEGMENT_LAST_SKIPS,
           persistent.test_segment_equals_the_launches_it_replaces, dict(ctas=2, case=("mlp", "bf16", "lite"), T=1,
                                                                         seed=53)),
    # member 1 skips its waits on member 0, its producer, whose tasks are made slow as above (100 us each)
    Mutant("persistent segment: q skips its wait on the combine + norm (it reads h before the combine writes it)",
           "segment.cu.j2", SEGMENT_WAITS, segment_first_reader_skips(),
           persistent.test_segment_equals_the_launches_it_replaces, dict(ctas=1, case=("combine_q", "bf16", "lite"),
                                                                         T=1, seed=51)),
    Mutant("persistent segment: o_proj skips its wait on the V up-projection (it reads o before v_up writes it)",
           "segment.cu.j2", SEGMENT_WAITS, segment_first_reader_skips(),
           persistent.test_segment_equals_the_launches_it_replaces, dict(ctas=1, case=("vup_o", "bf16", "lite"), T=1,
                                                                         seed=52)),
    Mutant("FP8 experts: a K slice scaled by the next K block's scale (gate)", "include/moe_fp8.cuh",
           "return __ldg(sc0 + kt * WF_BK / WF_BLOCK);",
           "return __ldg(sc0 + min(kt * WF_BK / WF_BLOCK + 1, KB - 1));",
           moe_fp8.test_moe_gate_up_silu_fp8, dict(case=moe_fp8.case_of("bf16", (15, 16, 17, 31, 32, 33), 2, 272, 200,
                                                                         seed=41)), uses_runner=True),
    Mutant("FP8 experts: the ceil row block dropped from the scale layout (down, N = 200)", "include/moe_fp8.cuh",
           "RB = (N + WF_BLOCK - 1) / WF_BLOCK;", "RB = N / WF_BLOCK;",
           moe_fp8.test_moe_down_fp8, dict(case=moe_fp8.case_of("bf16", (9, 8, 7, 1), 1, 144, 200, seed=42)),
           uses_runner=True),
    Mutant("FP8 experts: the gate and up scales swapped", "include/moe_fp8.cuh",
           "sc0 = s0 + srow;\n    sc1 = (MODE == DOWN ? s0 : s1) + srow;",
           "sc0 = (MODE == DOWN ? s0 : s1) + srow;\n    sc1 = s0 + srow;",
           moe_fp8.test_moe_gate_up_fp8, dict(case=moe_fp8.case_of("bf16", (17, 64, 0, 33), 1, 272, 200, seed=43)),
           uses_runner=True),
    Mutant("FP8 experts: one-pair tiles' K slices read one k16 step off (T = 1, the fragment layout)",
           "include/moe_fp8.cuh", "const uint4 v = lds128(row + ((j ^ sw) << 4));",
           "const uint4 v = lds128(row + ((((j + 1) & 3) ^ sw) << 4));",
           moe_fp8.test_moe_down_fp8, dict(case=moe_fp8.case_of("bf16", moe_fp8.one_token(8, (1, 6, 7)), 3, 144, 136,
                                                                 seed=44)), uses_runner=True),
    Mutant("FP8 experts, down's one-token launch: its 16 early slices one K slice off (before the PDL wait)",
           "include/moe_fp8.cuh", "w0, w1, s * WF_BK, n0, e,", "w0, w1, (s + 1) * WF_BK, n0, e,",
           moe_fp8.test_moe_down_fp8_one_token_launch,
           dict(case=moe_fp8.case_of("bf16", moe_fp8.one_token(66, (0, 1, 5, 17, 30, 41, 50, 65)), 8, 1408, 2048,
                                     seed=45)), uses_runner=True),
    Mutant("FP8 experts, gate_up_silu's shared tile before the PDL wait reads the route's ids (not yet written)",
           "include/moe_fp8.cuh", "  tl.pbeg = 0;\n  const i32* pairs = sorder;",
           "  tl.pbeg = tl.e * tokens;\n  const i32* pairs = order;",
           moe_fp8.test_moe_gate_up_silu_fp8_shared_tile_before_the_wait_of_a_running_route,
           dict(case={"T": 9, "S": 2, "dtype": "bf16", "seed": 52}), uses_runner=True),
    Mutant("FP8 experts, down's one-token launch: a tile's block scales from the neighbouring 128-row block",
           "include/moe_fp8.cuh", "const i64 srow = ((i64)tl.e * RB + tl.n0 / WF_BLOCK) * KB;",
           "const i64 srow = ((i64)tl.e * RB + min(tl.n0 / WF_BLOCK + 1, RB - 1)) * KB;",
           moe_fp8.test_moe_down_fp8_one_token_launch,
           dict(case=moe_fp8.case_of("bf16", moe_fp8.one_token(66, (0, 1, 5, 17, 30, 41, 50, 65)), 8, 1408, 2048,
                                     seed=46)), uses_runner=True),
    Mutant("FP8 experts, widen ahead: the next slice's first box widened from this slice's stage",
           "include/moe_fp8.cuh", "fp8_box_fragments<T>(ring + (it + 1) % ST * WF_STAGE_BYTES, next0);",
           "fp8_box_fragments<T>(ring + it % ST * WF_STAGE_BYTES, next0);",
           moe_fp8.test_moe_fp8_widen_ahead,
           dict(case={**moe_fp8.case_of("bf16", moe_fp8.one_token(64, (0, 3, 9, 17, 40, 63)), 6, 2048, 1408, seed=47),
                      "op": "moe_gate_up_silu"}), uses_runner=True),
    Mutant("FP8 experts, widen ahead: down's second 64 rows scaled by the next 128-K block's scale (one-token launch)",
           "include/moe_fp8.cuh", "return __ldg(sc1 + kt * WF_BK / WF_BLOCK);",
           "return __ldg(sc1 + min(kt * WF_BK / WF_BLOCK + 1, KB - 1));",
           moe_fp8.test_moe_down_fp8_one_token_launch_widen_ahead,
           dict(case=moe_fp8.case_of("bf16", moe_fp8.one_token(66, (0, 1, 5, 17, 30, 41, 50, 65)), 8, 1408, 2048,
                                     seed=48)), uses_runner=True),
    Mutant("FP8 kv_b query: a column block's scale swapped with its neighbour's (V2-Lite, C = 512)",
           "include/mla_absorb_fp8.cuh", "wt.s_lo = __ldg(kv_b.s + rb * KB + col / FP8_BLOCK);",
           "wt.s_lo = __ldg(kv_b.s + rb * KB + (col / FP8_BLOCK ^ 1));",
           mla_fp8.test_mla_decode_query_fp8, dict(name="lite", dtype="bf16", absorb=True, lens=[3, 2],
                                                   layout=("adjacent", "interleaved"), lead=0, misaligned=False,
                                                   seed=21)),
    Mutant("FP8 kv_b query: rows past a head's row-block edge on the block before (N = 128, 168 rows a head)",
           "include/mla_absorb_fp8.cuh", "const float sc = 16 * s + 4 * c + i < wt.nb ? wt.s_lo : wt.s_hi;",
           "const float sc = wt.s_lo;",
           mla_fp8.test_mla_decode_query_fp8, dict(name="x128", dtype="bf16", absorb=False, lens=[4, 3],
                                                   layout=("halves", "halves"), lead=0, misaligned=False, seed=22)),
    Mutant("FP8 kv_b query: the ceil column block dropped from the scale layout (C = 160)",
           "include/mla_absorb_fp8.cuh",
           "static constexpr int KB = (C + FP8_BLOCK - 1) / FP8_BLOCK;   // scale columns (the last one partial)",
           "static constexpr int KB = C / FP8_BLOCK;   // scale columns (the last one partial)",
           mla_fp8.test_mla_decode_query_fp8, dict(name="tc16", dtype="bf16", absorb=True, lens=[6],
                                                   layout=("halves", "halves"), lead=0, misaligned=False, seed=23)),
    Mutant("FP8 kv_b v_up: a column block's scale swapped with its neighbour's (V2-Lite, C = 512)",
           "include/mla_absorb_fp8.cuh", "sc = __ldg(kv_b.s + (r / FP8_BLOCK) * KB + k / FP8_BLOCK);",
           "sc = __ldg(kv_b.s + (r / FP8_BLOCK) * KB + (k / FP8_BLOCK ^ 1));",
           mla_fp8.test_mla_v_up_fp8, dict(name="lite", dtype="bf16", T=5, lead=0, misaligned=False, seed=24)),
    Mutant("FP8 kv_b v_up: the ceil column block's weights dropped (C = 160: its last 32 columns)",
           "include/mla_absorb_fp8.cuh", "if (v < V && k < C) {", "if (v < V && k < C / FP8_BLOCK * FP8_BLOCK) {",
           mla_fp8.test_mla_v_up_fp8, dict(name="tc16", dtype="bf16", T=9, lead=0, misaligned=False, seed=25)),
    Mutant("FP8 skinny linear: a row block's last tile takes the next block's scales", "include/fp8.cuh",
           "s = m.s[i] + (i64)((r - off) / FP8_BLOCK) * KB;", "s = m.s[i] + (i64)((r - off + TILE) / FP8_BLOCK) * KB;",
           linear_fp8.test_linear_skinny_fp8, dict(dtype="bf16", T=5, K=512, rows=[576], extra=0, offset=0,
                                                   shift="none", variant=linear_fp8.VARIANTS[0], seed=16)),
    Mutant("FP8 skinny linear: the last K block unscaled", "include/fp8.cuh",
           "return (s != nullptr && k < K) ? __ldg(s + k / FP8_BLOCK) : 0.f;",
           "return (s != nullptr && k < K) ? (k / FP8_BLOCK == (K - 1) / FP8_BLOCK ? 1.f : __ldg(s + k / FP8_BLOCK)) : 0.f;",
           linear_fp8.test_linear_skinny_fp8, dict(dtype="bf16", T=9, K=2048, rows=[256], extra=0, offset=0,
                                                   shift="none", variant=linear_fp8.VARIANTS[0], seed=17)),
    Mutant("FP8 skinny linear: the ceil K block dropped (K = 2064: 16 columns past the last whole block)",
           "include/fp8.cuh", "if (k < K) v = ld_weight16(row + k);",
           "if (k < K / FP8_BLOCK * FP8_BLOCK) v = ld_weight16(row + k);",
           linear_fp8.test_linear_skinny_fp8, dict(dtype="bf16", T=2, K=2064, rows=[200], extra=0, offset=0,
                                                   shift="none", variant=linear_fp8.VARIANTS[0], seed=18)),
    Mutant("FP8 skinny linear: the ceil row block dropped (kv_a's 576 rows: the last 64)", "include/fp8.cuh",
           "if (r >= off && r < off + rows[i]) {", "if (r >= off && r < off + rows[i] / FP8_BLOCK * FP8_BLOCK) {",
           linear_fp8.test_linear_skinny_fp8, dict(dtype="bf16", T=1, K=2048, rows=[3072, 576], extra=0, offset=0,
                                                   shift="none", variant=linear_fp8.VARIANTS[0], seed=19)),
    Mutant("FP8 skinny linear: the rolling pipeline reloads its slots one step late (K = 10944: 6 batches a warp)",
           "include/fp8.cuh", "if constexpr (ROLLING) load_step(next, u);", "if constexpr (ROLLING) load_step(next + 1, u);",
           linear_fp8.test_linear_skinny_fp8, dict(dtype="bf16", T=3, K=10944, rows=[256], extra=0, offset=0,
                                                   shift="none", variant=linear_fp8.VARIANTS[0], seed=21)),
    Mutant("FP8 skinny linear in 16-token chunks: a chunk's output one row late (o_proj at b=40: 3 chunks)",
           "include/fp8_chunks.cuh", "(out, mine, rows, t0);", "(out, mine, rows, t0 + 1);",
           linear_fp8_chunks.test_linear_skinny_fp8_chunks,
           dict(dtype="bf16", T=40, K=2048, rows=[2048], silu=False, extra=0, offset=0, shift="none",
                variant=linear_fp8.VARIANTS[0], seed=50)),
    Mutant("FP8 skinny linear in 16-token chunks: the last chunk's tokens not clipped at T (T = 33: 1 token)",
           "include/fp8_chunks.cuh", "chunk_tokens = min(MAX_TOKENS, ntok - t0);", "chunk_tokens = MAX_TOKENS;",
           linear_fp8_chunks.test_linear_skinny_fp8_chunks,
           dict(dtype="bf16", T=33, K=512, rows=[200, 72], silu=False, extra=0, offset=0, shift="none",
                variant=linear_fp8.VARIANTS[0], seed=51)),
    Mutant("FP8 gate_up_silu: the up rows scaled with their gate's scales (batch pipeline)", "include/fp8.cuh",
           "acc[rt][nt][2] = fmaf(p[2], sc[rt][1], acc[rt][nt][2]);",
           "acc[rt][nt][2] = fmaf(p[2], sc[rt][0], acc[rt][nt][2]);",
           linear_fp8.test_gate_up_silu_fp8, dict(dtype="bf16", T=4, K=512, n=136, extra=0, offset=0, shift="none",
                                                  variant=linear_fp8.VARIANTS[0], seed=20)),
    Mutant("FP8 GEMM: the first K block of a consumer's upper rows takes the x scale of the token 8 rows on",
           "include/gemm_fp8.cuh", SCALES_SITE, FIRST_BLOCK_XA_FROM_XB,
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=200, K=512, rows=[256], extra=0, offset=0, zero_rows=0,
                                               shift=False, seed=22)),
    Mutant("FP8 GEMM: the ceil K block dropped (K = 2064: 16 columns past the last whole block)",
           "include/gemm_ring.cuh", "const bool ok = m0 + r < num_tokens && kc < K;",
           "const bool ok = m0 + r < num_tokens && kc < K / BK * BK;",
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=40, K=2064, rows=[576], extra=0, offset=0, zero_rows=0,
                                               shift=False, seed=23)),
    Mutant("FP8 GEMM: the promotion skipped for the first K block", "include/gemm_fp8.cuh",
           SCALES_RETURN, FIRST_BLOCK_UNPROMOTED,
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=300, K=2048, rows=[2048], extra=0, offset=0,
                                               zero_rows=0, shift=False, seed=24)),
    Mutant("FP8 GEMM: the up rows scaled with their gate's block scales (gate_up_silu)", "include/gemm_fp8.cuh",
           "const float* swu = MODE == SILU ? sw1 + (n0 / BLOCK) * KB : swg;", "const float* swu = swg;",
           gemm_fp8.test_gate_up_silu_fp8_gemm, dict(dtype="bf16", T=100, K=512, n=200, extra=0, offset=0,
                                                     shift=False, seed=25)),
    Mutant("FP8 activation quantiser: the scale x1.01", "include/quant_fp8.cuh",
           "const float sc = amax / E4M3_MAX;", "const float sc = amax / E4M3_MAX * 1.01f;",
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=50, K=256, rows=[128], extra=0, offset=0, zero_rows=0,
                                               shift=False, seed=26)),
    Mutant("FP8 GEMM split K: the tickets never reset (a second run or graph replay writes nothing)",
           "include/tickets.cuh", '"st.relaxed.gpu.global.u32 [%0], 0;\\n"', '""',
           gemm_fp8.test_split_gemm_runs_again_the_same, dict(dtype="bf16", T=32, shape=gemm_fp8.SPLIT_SHAPES[1],
                                                               seed=41)),
    Mutant("FP8 GEMM split K: the last split's partial left out of the sum", "include/gemm_split.cuh",
           "for (int z = 0; z < splits; ++z) {", "for (int z = 0; z < splits - 1; ++z) {",
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=32, K=2048, rows=[2048], extra=0, offset=0,
                                               zero_rows=0, shift=False, seed=42)),
    # linear.gemm_weights_early: the issue before the wait covers one ring step more than the producer skips
    # after it -- step ST's weights land in stage 0 over step 0's (and its barrier takes an extra arrival);
    # 16 K blocks a CTA (T = 1000: 128 tiles, no split).  Fewer (a stage whose weights never come) would hang.
    Mutant("GEMM weights early (FP8): the boxes issued before the wait take split 0's K blocks (o_proj, T = 32)",
           "include/gemm_ring.cuh", EARLY_BOX, EARLY_BOX_SPLIT_0,
           gemm_fp8.test_fp8_gemm_weights_early, dict(dtype="bf16", T=32, shape=gemm_fp8.SPLIT_SHAPES[1],
                                                      overlap=False, seed=71)),
    Mutant("GEMM weights early (int8): the boxes issued before the wait take split 0's K blocks (o_proj, T = 32)",
           "include/gemm_ring.cuh", EARLY_BOX, EARLY_BOX_SPLIT_0,
           gemm_int8.test_int8_gemm_weights_early, dict(dtype="bf16", T=32, shape=gemm_int8.SPLIT_SHAPES[1],
                                                        seed=72)),
    # linear.gemm_multi: part 1's tiles (kv_a) scaled by part 0's (q's) weight scales -- wrong values, read in
    # bounds (q's scales are the larger), not a trap; V2-Lite's q + kv_a at the decode batch of 128
    Mutant("GEMM multi (FP8): part 1's tiles take part 0's weight scales (q + kv_a, T = 128)",
           "gemm_fp8.cu.j2", MULTI_SCALES, MULTI_SCALES_OF_PART_0,
           gemm_multi.test_fp8_gemm_multi, dict(dtype="bf16", T=128, K=2048, rows=gemm_multi.LITE, min_kb=4,
                                                early=True, overlap=True, zero_rows=0, shift=False, seed=81)),
    Mutant("GEMM multi (int8): part 1's tiles take part 0's weight scales (q + kv_a, T = 128)",
           "gemm_int8.cu.j2", MULTI_SCALES, MULTI_SCALES_OF_PART_0,
           gemm_multi.test_int8_gemm_multi, dict(dtype="bf16", T=128, K=2048, rows=gemm_multi.LITE, min_kb=4,
                                                 early=True, kind="random", shift=False, seed=82)),
    Mutant("FP8 GEMM split K: each split's K range one block short", "include/gemm_split.cuh",
           "return {z * kb / splits, (z + 1) * kb / splits};",
           "return {z * kb / splits, (z + 1) * kb / splits - (splits > 1)};",
           gemm_fp8.test_linear_fp8_gemm, dict(dtype="bf16", T=32, K=2048, rows=[3072, 576], extra=0, offset=0,
                                               zero_rows=0, shift=False, seed=43)),
    Mutant("FP8 x FP8 experts: the first K block of a consumer's upper rows takes the scale of the pair 8 rows on",
           "include/gemm_fp8.cuh", SCALES_SITE, FIRST_BLOCK_XA_FROM_XB,
           moe_gemm_fp8.test_moe_gate_up_silu_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 256, 200, routing="skewed", seed=27))),
    Mutant("FP8 x FP8 experts: the ceil K block dropped (KD = 272: 16 columns past the last whole block)",
           "include/moe_gemm_fp8.cuh", "const bool ok = src[i] >= 0 && kc < KD;",
           "const bool ok = src[i] >= 0 && kc < KD / f8::BK * f8::BK;",
           moe_gemm_fp8.test_moe_down_fp8x, dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 272, 200, seed=28))),
    Mutant("FP8 x FP8 experts: the promotion skipped for the first K block", "include/gemm_fp8.cuh",
           SCALES_RETURN, FIRST_BLOCK_UNPROMOTED,
           moe_gemm_fp8.test_moe_down_fp8x, dict(case=moe_gemm_fp8.case_of("bf16", 400, 8, 3, 1408, 264, seed=29))),
    Mutant("FP8 x FP8 experts: the gate and up scales swapped", "include/gemm_fp8.cuh",
           "const float ga = sc.xa * sc.wg, gb = sc.xb * sc.wg, ua = sc.xa * sc.wu, ub = sc.xb * sc.wu;",
           "const float ga = sc.xa * sc.wu, gb = sc.xb * sc.wu, ua = sc.xa * sc.wg, ub = sc.xb * sc.wg;",
           moe_gemm_fp8.test_moe_gate_up_silu_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 528, 200, routing="uniform", seed=30))),
    Mutant("FP8 x FP8 experts, overlapped K loop: an even block promotes the other fp32 tile (the next block's)",
           "include/gemm_fp8.cuh", "    retire_block<HALVES, ST, MC>(acc, p0, s0, empty, it0 + kb, lane);\n    s0 =",
           "    retire_block<HALVES, ST, MC>(acc, p1, s0, empty, it0 + kb, lane);\n    s0 =",
           moe_gemm_fp8.test_moe_down_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 1408, 200, seed=32, overlap=True))),
    Mutant("FP8 x FP8 experts, overlapped K loop: the last of 6 K blocks (KD = 720) promoted with the 5th's scales",
           "include/gemm_fp8.cuh",
           "// two blocks left: kb in flight, then kb + 1\n    const BlockScales s1 = block_scales(r, kb + 1);",
           "// two blocks left: kb in flight, then kb + 1\n    const BlockScales s1 = s0;",
           moe_gemm_fp8.test_moe_gate_up_silu_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 720, 200, routing="skewed", seed=33, overlap=True))),
    # moe.fp8_multicast: value mutants only -- a dropped peer release or a mask without rank 1 (0b01) would hang the
    # cluster (the full barrier waits for bytes that never come), which a mutant run cannot tell from a slow kernel
    Mutant("FP8 x FP8 experts, multicast: rank 1 takes rank 0's row tile (the item's second tile never stored)",
           "include/moe_gemm_fp8.cuh", "tl.pbeg += r * f8::BM;", "tl.pbeg += 0 * f8::BM;",
           moe_gemm_fp8.test_moe_down_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 64, 6, 1408, 2048, counts=moe_gemm_fp8.lite_counts(300, 6),
                                          seed=34, multicast=True))),
    Mutant("FP8 x FP8 experts, multicast: rank 1's weight box lands on box 0's half (box 1's rows never written)",
           "include/moe_gemm_fp8.cuh", "tma::load_3d_multicast(b + f8::BOX * f8::ROW_BYTES, MODE == DOWN ? w0 : w1, k0,",
           "tma::load_3d_multicast(b, MODE == DOWN ? w0 : w1, k0,",
           moe_gemm_fp8.test_moe_down_fp8x,
           dict(case=moe_gemm_fp8.case_of("bf16", 300, 64, 6, 1408, 2048, counts=moe_gemm_fp8.lite_counts(300, 6),
                                          seed=35, overlap=True, multicast=True))),
    Mutant("FP8 x FP8 experts: down's rows read as gate_up's (a pair's token row, not its own)",
           "include/moe_gemm_fp8.cuh", "src[i] = pr < 0 ? -1 : (MODE == DOWN ? pr : pr / K);",
           "src[i] = pr < 0 ? -1 : pr / (MODE == DOWN ? 2 : K);",
           moe_gemm_fp8.test_moe_down_fp8x, dict(case=moe_gemm_fp8.case_of("bf16", 300, 5, 2, 144, 200, seed=31))),
    Mutant("int8 skinny linear: each row scaled by the next channel's weight scale", "include/int8.cuh",
           "s = m.s[i] + (r - off);", "s = m.s[i] + (r - off + 1);",
           linear_int8.test_linear_int8_exact_on_the_same_quantised_x,
           dict(dtype="bf16", T=5, K=512, rows=[200], variant=linear_int8.VARIANTS[0], big=False, shift="none",
                seed=16)),
    # one step a batch (unroll 1): with U steps a batch the last batch would still cover the dropped step
    Mutant("int8 skinny linear: the last 64-k step dropped (K = 2048: 32 steps over 8 warps, one a batch)",
           "include/int8.cuh",
           "const int my_steps = warp < NSTEPS ? (NSTEPS - warp + WARPS - 1) / WARPS : 0;",
           "const int my_steps = warp < NSTEPS ? (NSTEPS - 1 - warp + WARPS - 1) / WARPS : 0;",
           linear_int8.test_linear_int8_exact_on_the_same_quantised_x,
           dict(dtype="bf16", T=9, K=2048, rows=[256], variant=linear_int8.VARIANTS[1], big=False, shift="none",
                seed=17)),
    Mutant("int8 skinny linear in 16-token chunks: a chunk's output one row late (o_proj at b=40: 3 chunks)",
           "include/int8_chunks.cuh", "(out, mine, rows, t0);", "(out, mine, rows, t0 + 1);",
           linear_int8_chunks.test_linear_skinny_int8_chunks,
           dict(dtype="bf16", T=40, K=2048, rows=[2048], silu=False, big=False, extra=0, offset=0, shift="none",
                variant=linear_int8.VARIANTS[0], seed=52)),
    Mutant("int8 skinny linear in 16-token chunks: the last chunk's tokens not clipped at T (T = 33: 1 token)",
           "include/int8_chunks.cuh", "chunk_tokens = min(MAX_TOKENS, ntok - t0);", "chunk_tokens = MAX_TOKENS;",
           linear_int8_chunks.test_linear_skinny_int8_chunks,
           dict(dtype="bf16", T=33, K=512, rows=[200, 72], silu=False, big=False, extra=0, offset=0, shift="none",
                variant=linear_int8.VARIANTS[0], seed=53)),
    Mutant("int8 skinny linear in 16-token chunks: every chunk scaled by the first chunk's x scales",
           "include/int8_chunks.cuh", "sx + t0, m, mine", "sx, m, mine",
           linear_int8_chunks.test_linear_skinny_int8_chunks,
           dict(dtype="bf16", T=48, K=2048, rows=[10944], silu=True, big=False, extra=0, offset=0, shift="none",
                variant=linear_int8.VARIANTS[0], seed=54)),
    Mutant("int8 gate_up_silu: the up rows scaled with their gate's scale", "include/int8.cuh",
           "i8_scale(total(i + 2), __ldg(su), x_scale)", "i8_scale(total(i + 2), __ldg(s), x_scale)",
           linear_int8.test_gate_up_silu_int8, dict(dtype="bf16", T=4, K=512, n=136,
                                                    variant=linear_int8.VARIANTS[0], shift="none", seed=20)),
    # seed 20: 3 of the 16 rows' amax / 127 differ in the last bit from amax * fl(1 / 127) (checked on the CPU)
    Mutant("int8 quantiser: the scale by a reciprocal multiply (as torch on CUDA divides by a scalar)",
           "include/quant_int8.cuh", "return __fdiv_rn(amax, 127.f);", "return amax * (1.f / 127.f);",
           linear_int8.test_quantiser_int8, dict(dtype="bf16", T=16, K=2048, extra=0, offset=0, shift=False,
                                                 kind="random", seed=20)),
    Mutant("int8 quantiser: ties rounded away from zero", "include/quant_int8.cuh",
           "const int q = __float2int_rn(__fdiv_rn(x, s));", "const int q = (int)roundf(__fdiv_rn(x, s));",
           linear_int8.test_quantiser_int8, dict(dtype="bf16", T=3, K=720, extra=0, offset=0, shift=False,
                                                 kind="ties", seed=21)),
    Mutant("int8 prologue: the scale x1.01", "include/int8_prologue.cuh",
           "s[dst(tid)] = scale_of(amax);", "s[dst(tid)] = scale_of(amax) * 1.01f;",
           linear_int8.test_linear_int8_prologue_equals_the_quantiser_and_kernel, _prologue_case(seed=24)),
    Mutant("int8 prologue: the last row read from the row after it", "include/int8_prologue.cuh",
           "auto row_of = [&](int t) { return x + (i64)t * x_stride; };",
           "auto row_of = [&](int t) { return x + (i64)(t + (t == ntok - 1)) * x_stride; };",
           linear_int8.test_linear_int8_prologue_equals_the_quantiser_and_kernel,
           _prologue_case(T=3, K=512, rows=[200], extra=8, seed=25)),
    # the prologue kernel's weights reach L2 by prefetch before its wait (a hint: leaving a row out of it
    # changes no value) and registers by int8.cuh's loads after it, where a missing row shows
    Mutant("int8 prologue kernel: weight row 5 of each matrix loaded as zeros", "include/int8.cuh",
           "w = m.w[i] + (i64)(r - off) * K;", "w = r - off == 5 ? nullptr : m.w[i] + (i64)(r - off) * K;",
           linear_int8.test_linear_int8_prologue_equals_the_quantiser_and_kernel,
           _prologue_case(T=2, K=512, rows=[64], seed=26)),
    Mutant("W4A8 unpack: the nibbles swapped (the high nibble taken as the even channel)", "include/int4.cuh",
           "even = (w << 4) & 0xF0F0F0F0u;\n  odd = w & 0xF0F0F0F0u;",
           "odd = (w << 4) & 0xF0F0F0F0u;\n  even = w & 0xF0F0F0F0u;",
           int4_unpack.test_int4_unpack_exact, dict(tiles=2, steps=3, seed=22)),
    Mutant("W4A8 unpack: the /16 of the shifted unpack dropped", "include/int4.cuh",
           "return acc >> 4;", "return acc;", int4_unpack.test_int4_unpack_exact, dict(tiles=2, steps=3, seed=23)),
    Mutant("W4A8 experts: the nibbles swapped (down)", "include/int4.cuh",
           "even = (w << 4) & 0xF0F0F0F0u;\n  odd = w & 0xF0F0F0F0u;",
           "odd = (w << 4) & 0xF0F0F0F0u;\n  even = w & 0xF0F0F0F0u;",
           moe_int.test_moe_down_wi4, dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, seed=16))),
    Mutant("W4A8 experts: the >> 4 of the shifted unpack dropped (gate_up_silu)", "include/int4.cuh",
           "return acc >> 4;", "return acc;",
           moe_int.test_moe_gate_up_silu_wi4, dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, seed=16))),
    Mutant("W4A8 experts: down scaled by the next channel's weight scale", "include/moe_int.cuh",
           "*o = from_float<T>(wi4_scale(total(i), __ldg(s0 + ch), x_scale));",
           "*o = from_float<T>(wi4_scale(total(i), __ldg(s0 + ch + 1), x_scale));",
           moe_int.test_moe_down_wi4, dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, seed=16))),
    Mutant("W4A8 experts: the gate scaled by the next channel's weight scale", "include/moe_int.cuh",
           "const float gt = round_to<T>(wi4_scale(total(i), __ldg(s0 + ch), x_scale));",
           "const float gt = round_to<T>(wi4_scale(total(i), __ldg(s0 + ch + 1), x_scale));",
           moe_int.test_moe_gate_up_silu_wi4, dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, seed=16))),
    Mutant("W4A8 experts: a pair's x scale from the next token (gate_up_silu)", "include/moe_int.cuh",
           "const float x_scale = sx[MODE == DOWN ? p : p / K];",
           "const float x_scale = sx[MODE == DOWN ? p : p / K + 1];",
           moe_int.test_moe_gate_up_silu_wi4, dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, seed=16))),
    Mutant("W4A8 experts, per group: the even channel's group scale off by one group (KD = 512: two groups)",
           "include/moe_int.cuh", "const float ge = gr[rt][0] != nullptr ? __ldg(gr[rt][0] + grp) : 0.f;",
           "const float ge = gr[rt][0] != nullptr ? __ldg(gr[rt][0] + (grp ^ 1)) : 0.f;",
           moe_int.test_moe_gate_up_silu_wi4,
           dict(case=moe_int.case_of("bf16", (5, 4, 3), 2, 512, 200, fmt=moe_int.GROUPED.name, seed=17))),
    Mutant("int8 wgmma experts: the unpacked even and odd int4 boxes swapped (down)", "include/moe_gemm_int.cuh",
           "*reinterpret_cast<uint4*>(even_row) = ev;\n    *reinterpret_cast<uint4*>(odd_row) = od;",
           "*reinterpret_cast<uint4*>(even_row) = od;\n    *reinterpret_cast<uint4*>(odd_row) = ev;",
           moe_gemm_int.test_moe_gemm_int_bit_equal_to_mma_int,
           dict(case=moe_gemm_int.case_of("moe_down", "int4_channel", 300, 5, 2, 528, 256, seed=16))),
    Mutant("int8 wgmma experts: the /16 of the unpacked int4 sums dropped (gate_up_silu)", "include/moe_gemm_int.cuh",
           "return PACK == 2 ? acc >> 4 : acc;", "return acc;",
           moe_gemm_int.test_moe_gemm_int_bit_equal_to_mma_int,
           dict(case=moe_gemm_int.case_of("moe_gate_up_silu", "int4_channel", 300, 5, 2, 528, 192, seed=16))),
    Mutant("int8 GEMM: each column scaled by the next channel's weight scale", "include/gemm_int8.cuh",
           "swg[c] = __ldg(sw0 + col);", "swg[c] = __ldg(sw0 + min(col + 1, O - 1));",
           gemm_int8.test_linear_int8_gemm, dict(dtype="bf16", T=200, K=512, rows=[256], extra=0, offset=0,
                                                 kind="random", big=False, shift=False, seed=32)),
    Mutant("int8 GEMM: the last k32 step dropped (K = 2048: its last 32 columns)", "include/gemm_int8.cuh",
           "for (int k32 = 0; k32 < BK / 32; ++k32)",
           "for (int k32 = 0; k32 < (kb == KB - 1 ? BK / 32 - 1 : BK / 32); ++k32)",
           gemm_int8.test_linear_int8_gemm, dict(dtype="bf16", T=40, K=2048, rows=[576], extra=0, offset=0,
                                                 kind="random", big=False, shift=False, seed=33)),
    Mutant("int8 GEMM: the up rows scaled with their gate's scale (gate_up_silu)", "include/gemm_int8.cuh",
           "swu[c] = MODE == SILU ? __ldg(sw1 + col) : 0.f;", "swu[c] = MODE == SILU ? __ldg(sw0 + col) : 0.f;",
           gemm_int8.test_gate_up_silu_int8_gemm, dict(dtype="bf16", T=100, K=512, n=200, extra=0, offset=0,
                                                       shift=False, seed=34)),
    Mutant("int8 GEMM: the partial last K box dropped (K = 2064: 16 columns past the last whole box)",
           "include/gemm_ring.cuh", "const bool ok = m0 + r < num_tokens && kc < K;",
           "const bool ok = m0 + r < num_tokens && kc < K / BK * BK;",
           gemm_int8.test_linear_int8_gemm, dict(dtype="bf16", T=40, K=2064, rows=[129], extra=0, offset=0,
                                                 kind="random", big=False, shift=False, seed=35)),
    Mutant("int8 GEMM split K: the tickets never reset (a second run or graph replay writes nothing)",
           "include/tickets.cuh", '"st.relaxed.gpu.global.u32 [%0], 0;\\n"', '""',
           gemm_int8.test_split_int8_gemm_runs_again_the_same,
           dict(dtype="bf16", T=32, shape=gemm_int8.SPLIT_SHAPES[1], seed=44)),
    Mutant("int8 GEMM split K: the last split's partial left out of the sum", "include/gemm_split.cuh",
           "for (int z = 0; z < splits; ++z) {", "for (int z = 0; z < splits - 1; ++z) {",
           gemm_int8.test_linear_int8_gemm, dict(dtype="bf16", T=32, K=2048, rows=[2048], extra=0, offset=0,
                                                 kind="random", big=False, shift=False, seed=45)),
    Mutant("norm's int8 rows: the scale x1.01", "include/norm_quant.cuh",
           "const float sc = scale_of(block_max<Layout::NTHREADS>(amax, red));",
           "const float sc = scale_of(block_max<Layout::NTHREADS>(amax, red)) * 1.01f;",
           norm_int8.test_norm_int8_rows_equal_the_quantisers,
           dict(op="fused_add_rms_norm", dtype="bf16", T=16, n=2048, extra=0, offset=0, wscale=1.0, zeros=False,
                seed=46)),
    Mutant("norm's int8 rows: the scale one ulp up", "include/norm_quant.cuh",
           "const float sc = scale_of(block_max<Layout::NTHREADS>(amax, red));",
           "const float sc = nextafterf(scale_of(block_max<Layout::NTHREADS>(amax, red)), 1e30f);",
           norm_int8.test_norm_int8_rows_equal_the_quantisers,
           dict(op="rms_norm", dtype="bf16", T=4, n=2048, extra=0, offset=0, wscale=1.0, zeros=False, seed=47)),
    Mutant("norm's int8 rows: the max over values up to half a bf16 ulp larger (as over the unrounded row)",
           "include/norm_quant.cuh", "amax = fmaxf(amax, fabsf(v[i]));",
           "amax = fmaxf(amax, fabsf(v[i]) * (1.f + 0x1p-10f));",
           norm_int8.test_norm_int8_rows_equal_the_quantisers,
           dict(op="moe_combine_residual_rms_norm", dtype="bf16", T=5, n=2048, extra=0, offset=0, wscale=1.0,
                zeros=False, seed=48)),
    Mutant("norm's int8 rows: the padding not zeroed", "include/norm_quant.cuh",
           "i += Layout::NTHREADS) q[i] = 0;", "i += Layout::NTHREADS) q[i] = 1;",
           norm_int8.test_norm_int8_rows_equal_the_quantisers,
           dict(op="rms_norm", dtype="fp16", T=3, n=1001, extra=1, offset=1, wscale=1.0, zeros=False, seed=49)),
    Mutant("norm's FP8 rows: the scale x1.01", "include/norm_quant.cuh",
           "const float sc = amax / fp8q::E4M3_MAX;", "const float sc = amax / fp8q::E4M3_MAX * 1.01f;",
           norm_fp8.test_norm_fp8_rows_equal_the_quantisers,
           dict(op="fused_add_rms_norm", dtype="bf16", T=17, n=2048, extra=0, offset=0, wscale=1.0, zeros=False,
                seed=50)),
    Mutant("norm's FP8 rows: the max over values up to half a bf16 ulp larger (as over the unrounded row)",
           "include/norm_quant.cuh", "for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(c[e]));",
           "for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(c[e]) * (1.f + 0x1p-10f));",
           norm_fp8.test_norm_fp8_rows_equal_the_quantisers,
           dict(op="rms_norm", dtype="bf16", T=32, n=2048, extra=0, offset=0, wscale=1.0, zeros=False, seed=51)),
    Mutant("norm's FP8 rows: a group's max shared with its neighbour (the shuffle over the whole warp)",
           "include/norm_quant.cuh", "for (int m = LANES / 2; m > 0; m >>= 1)", "for (int m = LANES; m > 0; m >>= 1)",
           norm_fp8.test_norm_fp8_rows_equal_the_quantisers,
           dict(op="moe_combine_residual_rms_norm", dtype="bf16", T=5, n=2048, extra=0, offset=0, wscale=1.0,
                zeros=False, seed=52)),
    Mutant("v_up's FP8 rows: a head's bytes and scale from the neighbouring head's 128 columns",
           "include/v_up_rows.cuh", "if (vec) load16(row + i0, v);", "if (vec) load16(row + (i0 ^ V), v);",
           v_up_fp8.test_v_up_fp8_rows_equal_the_quantisers,
           dict(fp8=True, dtype="bf16", T=65, lead=0, odd_out=False, zeros=False, seed=53)),
]


def _mutated_templates(tmp: Path, m: Mutant) -> Path:
    root = tmp / "templates"
    shutil.copytree(TEMPLATES, root)
    path = root / m.file
    text = path.read_text()
    count = text.count(m.old)
    assert count == 1, f"mutation site of {m.name!r} occurs {count} times in templates/{m.file}: {m.old!r}"
    path.write_text(text.replace(m.old, m.new))
    return root


def _run(m: Mutant, example: dict, runner_=None):
    inner = m.test.hypothesis.inner_test
    if m.uses_runner:
        inner(runner_, **example)
    else:
        inner(**example)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_planted_mutant_is_caught(m, tmp_path):
    from runtime.launcher import KernelRunner
    example = dict(m.example)
    plain = KernelRunner() if m.uses_runner else None
    _run(m, example, plain)                       # the real kernel passes this example
    folder = _mutated_templates(tmp_path, m)
    with templates_from(folder) as mutated:
        with pytest.raises(AssertionError):
            _run(m, example, KernelRunner(templates_dir=folder) if m.uses_runner else mutated)
