# SPDX-License-Identifier: Apache-2.0
# Parts of this file are copied from vLLM (https://github.com/vllm-project/vllm), Copyright contributors to the
# vLLM project, licensed under the Apache License 2.0; they are marked "copied from vLLM" below:
#   - write_zeros_to_output, fused_moe_kernel, and the launch logic of invoke_fused_moe_kernel and
#     fused_experts_impl: vllm/model_executor/layers/fused_moe/fused_moe.py
#     at commit 13cb3e44373beb1c8b9d2c017f565af6f7a1b601;
#   - _per_token_group_quant_fp8 and the launch logic of per_token_group_quant_fp8:
#     vllm/model_executor/layers/quantization/utils/fp8_utils.py at commit 007d50058a06dec0f82472d63c819244d460c40d;
#   - the tuning search space: get_configs_compute_bound in benchmarks/kernels/benchmark_moe.py (its CUDA ranges:
#     BLOCK_SIZE_M 16-256, N 32-256, K 64-256, GROUP_SIZE_M 1/16/32/64, num_warps 4/8, num_stages 2-5, with block
#     fp8 keeping N and K multiples of the 128 block), pruned as the module docstring says.
# Kept: only the fp8_w8a8 block-quantised path (block_shape [128, 128]); the branches the other quantisation modes
# take (int8, per-channel, per-tensor, bias, wna16) are dropped, each behind a constexpr flag this path sets off.
"""DeepSeek-V2-Lite's routed-expert FFN in FP8: vLLM's fused_moe Triton kernel (fp8_w8a8, block [128, 128], its
best config) against dsgraph's FP8 expert launches, side by side on one GPU (a script).

    python3 -m bench.peer_fused_moe [--tokens 1,2,4,...,256] [--json PATH] [--jobs N]
    python3 -m bench.peer_fused_moe --quick         # a smaller config grid: under ~3 minutes on an H100

The layer: 64 experts, top-6, hidden 2048, expert intermediate 1408; FP8 e4m3 weights with a float32 scale per
128 x 128 block (DeepSeek-V3's layout), quantised once from the same random bf16 weights for both sides (vLLM's
w13 = [gate; up] of dsgraph's two weights, the same bytes).  The same routing for both (T tokens, top-6 distinct
experts drawn uniformly; routing weights a softmax).

vLLM's side is fused_experts_impl's flow for fp8_w8a8 block quantisation: per_token_group_quant_fp8(x, 128) ->
fused_moe_kernel (x @ w13) -> silu_and_mul -> per_token_group_quant_fp8 -> fused_moe_kernel (@ w2, times the
routing weight) -> the top-k sum.  The Triton kernels are vLLM's (copied below); vLLM's CUDA ops are replaced by
what does the same work in one launch each: silu_and_mul by a Triton kernel with the CUDA kernel's roundings, the
top-k sum by torch.sum(dim=1, out=...) (what vLLM's moe_sum calls for top-k > 4), per_token_group_fp8_quant by
vLLM's own Triton fallback.  moe_align_block_size is done in torch outside the timed region (not timed), as is
dsgraph's moe_align.  dsgraph's side: moe_gate_up_silu and moe_down as bench/perf_expert_fp8.py lowers them
(FP8 weights, bf16 activations: templates/include/moe_fp8.cuh), then moe_combine; three launches.

Config sweep (vLLM's benchmarks/kernels/benchmark_moe.py): every config of a grid timed on the whole FFN at each
T, the best kept.  The grid is vLLM's search space for block fp8 (BLOCK_SIZE_N a multiple of 128, BLOCK_SIZE_K
128: invoke_fused_moe_kernel clamps it to the 128-wide scale block, so K = 256 repeats K = 128), pruned to what its
tuned H100 block-fp8 configs pick at <= 256 tokens: BLOCK_SIZE_M 16/32/64, BLOCK_SIZE_N 128/256, GROUP_SIZE_M 1/16,
num_warps 4/8, num_stages 2-5 (96 configs; --quick: GROUP_SIZE_M 1 and num_stages 3/4, 24), plus vLLM's default
block-fp8 config.  Its kernels are compiled first in --jobs processes (Triton's cache on disk is shared).

Timing: runtime.timing.graph_us for both sides, over a CUDA graph that cycles two copies of every weight (each
larger than L2, so touched experts come from HBM as in a decode step), median of 3 replays; the sweep with 10
calls a graph, the side-by-side row with 20.  Correctness: every output against a float64 reference on the
dequantised FP8 weights.  vLLM quantises activations to e4m3 per token and 128 columns (x and the silu output),
dsgraph's decode kernel does not; so vLLM's norm-wise error against that reference is e4m3's (~3-5%, BAD above
8%), and it is also checked against a reference that quantises and rounds where vLLM does (errq, BAD above 2%);
dsgraph's BAD above 1%.  Exit status 1 if any row is BAD or failed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

try:   # only the GPU path needs Triton; the CPU tests import this module without it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

E, K, D, M = 64, 6, 2048, 1408          # experts, top-k, hidden, expert intermediate (V2-Lite)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUP = 128                             # the FP8 block: weights 128 x 128, activations 1 x 128
FP8_MAX = 448.0                         # float8_e4m3fn's largest finite value
QUANT_EPS = 1e-10                       # per_token_group_quant_fp8's floor on a group's amax
COPIES = 2
SWEEP_ITERS, ROW_ITERS = 10, 20
BAD_DSG, BAD_VLLM, BAD_VLLM_Q = 1e-2, 8e-2, 2e-2

# vLLM's get_default_config for fp8_w8a8 with a block shape (what it runs with no tuned config file)
DEFAULT_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
                  "num_warps": 4, "num_stages": 3}


# -- the config grid ---------------------------------------------------------------------------------------

def search_space(quick: bool) -> list[dict]:
    """The configs the sweep times (see the module docstring), vLLM's default config last."""
    grid = {"BLOCK_SIZE_M": (16, 32, 64), "BLOCK_SIZE_N": (128, 256), "BLOCK_SIZE_K": (128,),
            "GROUP_SIZE_M": (1,) if quick else (1, 16), "num_warps": (4, 8),
            "num_stages": (3, 4) if quick else (2, 3, 4, 5)}
    keys = list(grid)
    configs = [dict(zip(keys, values)) for values in itertools.product(*grid.values())]
    if DEFAULT_CONFIG not in configs:
        configs.append(dict(DEFAULT_CONFIG))
    return configs


def config_name(cfg: dict) -> str:
    return (f"M{cfg['BLOCK_SIZE_M']}N{cfg['BLOCK_SIZE_N']}K{cfg['BLOCK_SIZE_K']}G{cfg['GROUP_SIZE_M']}"
            f"w{cfg['num_warps']}s{cfg['num_stages']}")


# -- moe_align_block_size (torch; not timed) ---------------------------------------------------------------

def moe_align_block_size(topk_ids, block_size: int, num_experts: int):
    """vLLM's moe_align_block_size, in torch: (sorted_token_ids int32 [numel + E * (block - 1)],
    expert_ids int32 [cdiv(that, block)], num_tokens_post_padded int32 [1]).  Each expert's pairs (flat indices
    of topk_ids, in flat order) fill whole blocks of `block_size`, padded with numel (no pair); expert_ids[b] is
    block b's expert; blocks past num_tokens_post_padded hold padding and expert 0 (the kernel stops before them)."""
    import torch
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_padded = numel + num_experts * (block_size - 1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)                 # pairs grouped by expert, flat order within
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts      # where each expert's pairs start in `order`
    rank = torch.arange(numel, device=dev) - first_of_expert[sorted_experts]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    blocks = (max_padded + block_size - 1) // block_size
    total = int(padded_end[-1])
    expert_ids = torch.zeros(blocks, dtype=torch.int32, device=dev)
    used = total // block_size
    if used:
        starts = torch.arange(used, device=dev) * block_size
        expert_ids[:used] = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=dev)


# -- references (float64; device-agnostic) -----------------------------------------------------------------

def quant_groups(x):
    """vLLM's per_token_group_quant_fp8(x, 128) in torch: (q float8_e4m3fn like x, s float32 [rows, cols / 128]);
    s = max(amax of the group, 1e-10) / 448, q = clamp(x / s, +-448) rounded to e4m3 (fp32 arithmetic)."""
    import torch
    rows, cols = x.shape
    g = x.float().reshape(rows, cols // GROUP, GROUP)
    s = g.abs().amax(dim=2).clamp_min(QUANT_EPS) / FP8_MAX
    q = (g / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), s


def dequant_groups(q, s):
    rows, cols = q.shape
    return (q.double().reshape(rows, cols // GROUP, GROUP) * s.double()[:, :, None]).reshape(rows, cols)


def dequant_weight(q, s):
    """One expert's FP8 weight [O, I] with its block scales [ceil(O / 128), ceil(I / 128)] -> float64."""
    o, i = q.shape
    return q.double() * s.double().repeat_interleave(GROUP, 0)[:o].repeat_interleave(GROUP, 1)[:, :i]


def ffn_reference(x, ids, tw, w13, s13, w2, s2, *, vllm_rounding: bool):
    """y [T, D] float64 = sum_k tw[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, k], on the dequantised
    FP8 weights (w13 [E, 2M, D] = [gate; up], w2 [E, D, M], block scales s13 / s2).

    vllm_rounding: as vLLM's fp8 block flow computes it -- x quantised per 128 columns, gate/up rounded to bf16,
    silu rounded to bf16 then times up rounded to bf16, that quantised per 128, each pair's weighted down output
    rounded to bf16, their sum rounded to bf16.  Otherwise exact (bf16 x as given, nothing rounded)."""
    import torch
    bf16 = torch.bfloat16

    def rnd(t):
        return t.to(bf16).double() if vllm_rounding else t

    T, topk = ids.shape
    Mi = w2.shape[2]
    xd = dequant_groups(*quant_groups(x)) if vllm_rounding else x.double()
    out = torch.zeros(T, topk, w2.shape[1], dtype=torch.float64, device=x.device)
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().reshape(-1)
        tok, kk = pairs // topk, pairs % topk
        gu = rnd(xd[tok] @ dequant_weight(w13[e], s13[e]).T)
        g, u = gu[:, :Mi], gu[:, Mi:]
        a = rnd(rnd(torch.nn.functional.silu(g)) * u)
        if vllm_rounding:
            a = dequant_groups(*quant_groups(a.float()))
        o = (a @ dequant_weight(w2[e], s2[e]).T) * tw[tok, kk].double()[:, None]
        out[tok, kk] = rnd(o)
    return rnd(out.sum(dim=1))


def rel_err(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


# -- vLLM's Triton kernels (copied from vLLM; see the header) ----------------------------------------------

if triton is not None:

    @triton.jit
    def write_zeros_to_output(
        c_ptr,
        stride_cm,
        stride_cn,
        pid_n,
        N,
        offs_token,
        token_mask,
        BLOCK_SIZE_M,
        BLOCK_SIZE_N,
        compute_type,
    ):
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=compute_type)
        offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
        c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator, mask=c_mask)

    @triton.jit
    def fused_moe_kernel(
        # Pointers to matrices
        a_ptr,
        b_ptr,
        c_ptr,
        a_scale_ptr,
        b_scale_ptr,
        topk_weights_ptr,
        sorted_token_ids_ptr,
        expert_ids_ptr,
        num_tokens_post_padded_ptr,
        # Matrix dimensions
        N,
        K,
        EM,
        num_valid_tokens,
        # The stride variables represent how much to increase the ptr by when
        # moving by 1 element in a particular dimension. E.g. `stride_am` is
        # how much to increase `a_ptr` by to get the element one row down
        # (A has M rows).
        stride_am,
        stride_ak,
        stride_be,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_asm,
        stride_ask,
        stride_bse,
        stride_bsk,
        stride_bsn,
        # Block size for block-wise quantization
        group_n: tl.constexpr,
        group_k: tl.constexpr,
        # Meta-parameters
        BLOCK_SIZE_M: tl.constexpr,
        BLOCK_SIZE_N: tl.constexpr,
        BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr,
        SPLIT_K: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        top_k: tl.constexpr,
        compute_type: tl.constexpr,
        use_fp8_w8a8: tl.constexpr,
    ):
        """
        Implements the fused computation for a Mixture of Experts (MOE) using
        token and expert matrices.

        Key Parameters:
        - A: The input tensor representing tokens with shape (*, K), where '*' can
            be any shape representing batches and K is the feature dimension of
            each token.
        - B: The stacked MOE weight tensor with shape (E, N, K), where E is
            the number of experts, K is the input feature dimension, and N is
            the output feature dimension.
        - C: The output cache tensor with shape (M, topk, N), where M is the
            total number of tokens post padding, topk is the number of times
            each token is repeated, and N is the output feature dimension.
        - sorted_token_ids: A tensor containing the sorted indices of tokens,
            repeated topk times and arranged by the expert index they are
            assigned to.
        - expert_ids: A tensor containing the indices of the expert for each
            block. It determines which expert matrix from B should be used for
            each block in A.
        This kernel performs the multiplication of a token by its corresponding
        expert matrix as determined by `expert_ids`. The sorting of
        `sorted_token_ids` by expert index and padding ensures divisibility by
        BLOCK_SIZE_M, which is necessary to maintain consistency in block matrix
        multiplication across different blocks processed by the same expert.
        """
        # -----------------------------------------------------------
        # Map program ids `pid` to the block of C it should compute.
        # This is done in a grouped ordering to promote L2 data reuse.
        pid = tl.program_id(axis=0)
        num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        num_pid_in_group = GROUP_SIZE_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        # ----------------------------------------------------------
        # Create pointers for the first blocks of A and B.
        # We will advance this pointer as we move in the K direction
        # and accumulate
        # `a_ptrs` is a block of [BLOCK_SIZE_M, BLOCK_SIZE_K] pointers
        # `b_ptrs` is a block of [BLOCK_SIZE_K, BLOCK_SIZE_N] pointers
        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
            return
        offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
        offs_token = tl.load(sorted_token_ids_ptr + offs_token_id)
        token_mask = offs_token < num_valid_tokens

        off_experts = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if off_experts == -1:
            # -----------------------------------------------------------
            # Write back zeros to the output when the expert is not
            # in the current expert parallel rank.
            write_zeros_to_output(
                c_ptr,
                stride_cm,
                stride_cn,
                pid_n,
                N,
                offs_token,
                token_mask,
                BLOCK_SIZE_M,
                BLOCK_SIZE_N,
                compute_type,
            )
            return

        offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (
            offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak
        )

        b_ptrs = (
            b_ptr
            + off_experts * stride_be
            + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
        )

        if use_fp8_w8a8:
            # block-wise
            if group_k > 0 and group_n > 0:
                a_scale_ptrs = a_scale_ptr + (offs_token // top_k) * stride_asm
                offs_bsn = offs_bn // group_n
                b_scale_ptrs = (
                    b_scale_ptr + off_experts * stride_bse + offs_bsn * stride_bsn
                )
        # -----------------------------------------------------------
        # Iterate to compute a block of the C matrix.
        # We accumulate into a `[BLOCK_SIZE_M, BLOCK_SIZE_N]` block
        # of fp32 values for higher accuracy.
        # `accumulator` will be converted back to fp16 after the loop.
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            # Load the next block of A and B, generate a mask by checking the
            # K dimension.
            a = tl.load(
                a_ptrs,
                mask=token_mask[:, None] & (offs_k[None, :] < K - k * BLOCK_SIZE_K),
                other=0.0,
            )
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
            # We accumulate along the K dimension.
            if use_fp8_w8a8:
                if group_k > 0 and group_n > 0:
                    k_start = k * BLOCK_SIZE_K
                    offs_ks = k_start // group_k
                    a_scale = tl.load(
                        a_scale_ptrs + offs_ks * stride_ask, mask=token_mask, other=0.0
                    )
                    b_scale = tl.load(b_scale_ptrs + offs_ks * stride_bsk)

                    accumulator += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
            # Advance the ptrs to the next K block.
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk
        if MUL_ROUTED_WEIGHT:
            moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
            accumulator = accumulator * moe_weight[:, None]
        if use_fp8_w8a8:
            if group_k > 0 and group_n > 0:
                accumulator = accumulator.to(compute_type)

        # -----------------------------------------------------------
        # Write back the block of the output
        offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
        c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator, mask=c_mask)

    @triton.jit
    def _per_token_group_quant_fp8(
        # Pointers to inputs and output
        y_ptr,
        y_q_ptr,
        y_s_ptr,
        group_size,
        # Num columns of y
        y_num_columns,
        y_row_stride,
        # Avoid to divide zero
        eps,
        # Information for float8
        fp8_min,
        fp8_max,
        use_ue8m0: tl.constexpr,
        # Meta-parameters
        BLOCK: tl.constexpr,
    ):
        """A Triton-accelerated function to perform per-token-group
        quantization on a tensor.
        This function converts the tensor values into float8 values.
        """
        groups_per_row = y_num_columns // group_size

        # Map the program id to the row of X and Y it should compute.
        g_id = tl.program_id(0)
        row = g_id // groups_per_row
        row_g_id = g_id % groups_per_row

        # Ensure offset calculations use int64 to prevent overflow
        y_ptr_offset = (row.to(tl.int64) * y_row_stride) + (
            row_g_id.to(tl.int64) * group_size
        )
        y_ptr += y_ptr_offset

        y_q_ptr_offset = g_id.to(tl.int64) * group_size
        y_q_ptr += y_q_ptr_offset
        y_s_ptr += g_id

        cols = tl.arange(0, BLOCK)  # N <= BLOCK
        mask = cols < group_size

        y = tl.load(y_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Quant
        _absmax = tl.maximum(tl.max(tl.abs(y)), eps)
        scale_raw = _absmax / fp8_max
        y_s = tl.math.exp2(tl.ceil(tl.log2(scale_raw))) if use_ue8m0 else scale_raw
        y_q = tl.clamp(y / y_s, fp8_min, fp8_max).to(y_q_ptr.dtype.element_ty)

        tl.store(y_q_ptr + cols, y_q, mask=mask)
        tl.store(y_s_ptr, y_s)

    # -- not vLLM's: the stand-in for its CUDA silu_and_mul (csrc/activation_kernels.cu), one launch with the
    # same roundings: silu(x) rounded to the activation dtype, then times y, rounded again.

    @triton.jit
    def _silu_and_mul(out_ptr, in_ptr, d, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            x = tl.load(in_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(in_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
            s = (x / (1.0 + tl.exp(-x))).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * d + cols, (s.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
                     mask=mask)


# -- vLLM's launch logic (copied from vLLM, cut to the fp8 block path) -------------------------------------

def per_token_group_quant_fp8(x, x_q, x_s):
    """per_token_group_quant_fp8(x, 128) into x_q [rows, cols] e4m3 and x_s [rows, cols / 128] float32, through
    vLLM's Triton fallback (its launch parameters)."""
    Mg = x.numel() // GROUP
    BLOCK = triton.next_power_of_2(GROUP)
    num_warps = min(max(BLOCK // 256, 1), 8)
    _per_token_group_quant_fp8[(Mg,)](
        x, x_q, x_s, GROUP, x.shape[1], x.stride(0), QUANT_EPS,
        fp8_min=-FP8_MAX, fp8_max=FP8_MAX, use_ue8m0=False, BLOCK=BLOCK, num_warps=num_warps, num_stages=1)


def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    _silu_and_mul[(x.shape[0],)](out, x, d, BLOCK=1024, num_warps=4)


def invoke_fused_moe_kernel(A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids,
                            num_tokens_post_padded, mul_routed_weight: bool, top_k: int, config: dict,
                            block_shape=(GROUP, GROUP)) -> None:
    """invoke_fused_moe_kernel with use_fp8_w8a8 and block_shape, compute type bf16."""
    assert triton.cdiv(B.size(-2), block_shape[0]) == B_scale.size(-2)
    assert triton.cdiv(B.size(-1), block_shape[1]) == B_scale.size(-1)
    EM = sorted_token_ids.size(0)
    if A.size(0) < config["BLOCK_SIZE_M"]:
        # optimize for small batch_size.
        # We assume that top_ids of each token is unique,
        # so num_valid_experts <= batch_size <= BLOCK_SIZE_M,
        # and we can skip some invalid blocks.
        EM = min(sorted_token_ids.size(0), A.size(0) * top_k * config["BLOCK_SIZE_M"])
    grid = lambda META: (  # noqa: E731
        triton.cdiv(EM, META["BLOCK_SIZE_M"]) * triton.cdiv(B.size(1), META["BLOCK_SIZE_N"]),
    )
    config = dict(config)
    config["SPLIT_K"] = 1
    BLOCK_SIZE_K = config.pop("BLOCK_SIZE_K")
    BLOCK_SIZE_K = min(BLOCK_SIZE_K, min(block_shape[0], block_shape[1]))
    fused_moe_kernel[grid](
        A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        B.size(1), B.size(2), EM, A.size(0) * top_k,
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), C.stride(1), C.stride(2),
        A_scale.stride(0), A_scale.stride(1), B_scale.stride(0), B_scale.stride(2), B_scale.stride(1),
        block_shape[0], block_shape[1],
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=tl.bfloat16, use_fp8_w8a8=True,
        BLOCK_SIZE_K=BLOCK_SIZE_K, **config)


class VllmExperts:
    """fused_experts_impl's fp8 block flow at T tokens over preallocated buffers (nothing allocated per call, so
    a call can be captured in a CUDA graph); `align` holds moe_align_block_size per BLOCK_SIZE_M."""

    def __init__(self, x, ids, tw):
        import torch
        self.x, self.ids, self.tw = x, ids, tw.contiguous()
        self.tokens, self.topk = ids.shape
        self.align = {}
        self.qx = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        self.sx = torch.empty(x.shape[0], x.shape[1] // GROUP, dtype=torch.float32, device=x.device)

    def buffers(self, Mi: int, Dout: int):
        """Allocate the intermediates for expert intermediate Mi and output width Dout; returns self."""
        import torch
        dev, bf16, f8 = self.x.device, torch.bfloat16, torch.float8_e4m3fn
        T, topk = self.tokens, self.topk
        self.cache1 = torch.empty(T, topk, 2 * Mi, dtype=bf16, device=dev)
        self.cache2 = torch.empty(T * topk, Mi, dtype=bf16, device=dev)
        self.qa = torch.empty(T * topk, Mi, dtype=f8, device=dev)
        self.sa = torch.empty(T * topk, Mi // GROUP, dtype=torch.float32, device=dev)
        self.cache3 = torch.empty(T, topk, Dout, dtype=bf16, device=dev)
        self.out = torch.empty(T, Dout, dtype=bf16, device=dev)
        return self

    def aligned(self, block_m: int, num_experts: int):
        if block_m not in self.align:
            self.align[block_m] = moe_align_block_size(self.ids, block_m, num_experts)
        return self.align[block_m]

    def __call__(self, w13, s13, w2, s2, config: dict):
        import torch
        sorted_ids, expert_ids, ntpp = self.aligned(config["BLOCK_SIZE_M"], w13.shape[0])
        Mi = w2.shape[2]
        per_token_group_quant_fp8(self.x, self.qx, self.sx)
        invoke_fused_moe_kernel(self.qx, w13, self.cache1, self.sx, s13, self.tw, sorted_ids, expert_ids, ntpp,
                                False, self.topk, config)
        silu_and_mul(self.cache2, self.cache1.view(-1, 2 * Mi))
        per_token_group_quant_fp8(self.cache2, self.qa, self.sa)
        invoke_fused_moe_kernel(self.qa, w2, self.cache3, self.sa, s2, self.tw, sorted_ids, expert_ids, ntpp,
                                True, 1, config)
        torch.sum(self.cache3, dim=1, out=self.out)
        return self.out


# -- arguments ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="token counts, comma-separated (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the smaller config grid (24 configs + vLLM's default)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes compiling the Triton kernels before the sweep (default: min(12, CPUs); 0: none)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tokens: expected comma-separated positive integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error(f"--tokens: expected comma-separated positive integers, got {','.join(map(str, args.tokens))!r}")
    if args.jobs is None:
        args.jobs = min(12, os.cpu_count() or 1)
    if args.jobs < 0:
        ap.error("--jobs: expected 0 or more")
    return args


def routing(T: int, seed: int = 0):
    """ids int32 [T, K] (K distinct experts a token, uniformly), routing weights float32 [T, K] (a softmax)."""
    import torch
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(1000 * seed + t))[:K]
                       for t in range(T)]).to(torch.int32)
    g = torch.Generator().manual_seed(7 + seed)
    tw = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return ids, tw


# -- the GPU run -------------------------------------------------------------------------------------------

def _precompile(configs: list, tokens: list) -> list:
    """Run vLLM's flow once for each config at each T (dummy weights), so that Triton compiles every variant
    the sweep will launch into its on-disk cache; returns [(config index, error)] for those that fail."""
    import torch
    dev = "cuda"
    w13 = torch.zeros(E, 2 * M, D, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    w2 = torch.zeros(E, D, M, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    s13 = torch.ones(E, 2 * M // GROUP, D // GROUP, device=dev)
    s2 = torch.ones(E, D // GROUP, M // GROUP, device=dev)
    failed = []
    runs = []
    for T in tokens:
        ids, tw = routing(T)
        x = torch.randn(T, D, device=dev).to(torch.bfloat16)
        runs.append(VllmExperts(x, ids.to(dev), tw.to(dev)).buffers(M, D))
    for i, cfg in configs:
        try:
            for run in runs:
                run(w13, s13, w2, s2, cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a config Triton cannot build (shared memory) is skipped, as vLLM's tuner does
            failed.append((i, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return failed


def precompile(configs: list, tokens: list, jobs: int) -> dict:
    """{config index: error} of the configs that cannot run; compiles in `jobs` processes (0: here)."""
    items = list(enumerate(configs))
    t0 = time.time()
    if jobs <= 1:
        failed = _precompile(items, tokens)
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        chunks = [items[j::jobs] for j in range(jobs)]
        failed = []
        from bench import peer_fused_moe as importable   # pickled by module name, not as __main__'s
        try:
            with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
                for part in pool.map(importable._precompile, chunks, [tokens] * jobs):
                    failed += part
        except Exception as e:  # noqa: BLE001 -- the pool is only a speed-up: compile here instead
            print(f"(parallel compile failed: {type(e).__name__}: {e}; compiling in this process)", flush=True)
            failed = _precompile(items, tokens)
    print(f"compiled {len(configs)} configs x {len(tokens)} token counts in {time.time() - t0:.0f} s"
          f" ({len(failed)} cannot run)", flush=True)
    return dict(failed)


def cycled_us(fn, iters: int) -> float:
    """us per call of fn(i), i cycling over the weight copies, in one CUDA graph of `iters` calls."""
    from runtime.timing import graph_us
    calls = itertools.count()
    return graph_us(lambda: fn(next(calls) % COPIES), iters=max(iters, COPIES))


def dsgraph_side():
    """dsgraph's launches: (gate_up_silu, down, combine), each (launches, input names, output name)."""
    from bench import perf_expert_fp8 as pe
    from codegen import families
    from codegen.kernel import Options
    from ir.ops import TType
    from tests.gpu.harness import single_op_graph, tiny_model
    assert (pe.E, pe.K, pe.D, pe.M) == (E, K, D, M)
    Ggu, ngu, lgu = pe.graph("moe_gate_up_silu", D, M, True)
    Gdn, ndn, ldn = pe.graph("moe_down", M, D, True)
    Gcb, ncb = single_op_graph(tiny_model(), "moe_combine", {},
                               {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32")}, {})
    lcb = families.family_for_op("moe_combine").lower(ncb, Gcb, Options(dtype="bf16"))
    return {"gate_up": (lgu, Ggu.nodes[ngu]["weights"], Ggu.nodes[ngu]["outputs"][0]),
            "down": (ldn, Gdn.nodes[ndn]["weights"], Gdn.nodes[ndn]["outputs"][0]),
            "combine": (lcb, {}, Gcb.nodes[ncb]["outputs"][0])}


def main(argv=None) -> int:
    args = parse_args(argv)
    if triton is None:
        raise SystemExit("bench.peer_fused_moe needs Triton (and a GPU); it is not installed here")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench.peer_fused_moe needs a CUDA GPU; none is visible here")

    from bench import perf_expert_fp8 as pe
    from ir.formats import FP8, companion_names
    from ir.ops.moe import align_ref
    from runtime.launcher import KernelRunner

    configs = search_space(args.quick)
    cannot = precompile(configs, args.tokens, args.jobs)
    runnable = [c for i, c in enumerate(configs) if i not in cannot]
    for i, err in sorted(cannot.items()):
        print(f"  {config_name(configs[i])}: {err}", flush=True)

    print(f"device: {torch.cuda.get_device_name()}; triton {triton.__version__}, torch {torch.__version__}",
          flush=True)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    side = dsgraph_side()
    runner = KernelRunner()
    # weights: COPIES copies, each quantised from its own random bf16 weights; vLLM's and dsgraph's share bytes
    vw, dw = [], []
    for c in range(COPIES):
        q, s = {}, {}
        for role, (O, I) in {"gate": (M, D), "up": (M, D), "down": (D, M)}.items():
            w = torch.randn(E, O, I, device=dev, generator=gen) * I ** -0.5
            q[role], s[role] = pe.quantize(w.to(torch.bfloat16).float())
            del w
        vw.append((torch.cat([q["gate"], q["up"]], 1).contiguous(), torch.cat([s["gate"], s["up"]], 1).contiguous(),
                   q["down"], s["down"]))
        ws = {}
        for part in ("gate_up", "down"):
            for role, name in side[part][1].items():
                mine = "down" if role == "weight" else role
                ws[name], ws[companion_names(name, FP8)[0]] = q[mine], s[mine]
        dw.append(ws)
        del q, s
    torch.cuda.synchronize()

    print("\nvLLM quantises activations to e4m3 per token and 128 columns (x and the silu output); dsgraph's decode "
          "kernel keeps them bf16.\nerr: norm-wise against float64 on the dequantised weights and unquantised "
          f"activations (e4m3's ~3-5% for vLLM, BAD > {BAD_VLLM:.0%}; dsgraph BAD > {BAD_DSG:.0%});\n"
          f"errq: vLLM against float64 that quantises and rounds where vLLM does (BAD > {BAD_VLLM_Q:.0%}).",
          flush=True)
    head = (f"{'T':>4} {'pairs':>5} {'exp':>3} | {'vLLM best config':<18} {'vLLM us':>8} {'default':>8} "
            f"{'err':>7} {'errq':>7} | {'dsgraph us':>10} {'err':>7} | {'vLLM/dsg':>8}")
    print(head + "\n" + "-" * len(head), flush=True)
    rows, bad = [], 0
    for T in args.tokens:
        ids, tw = routing(T)
        touched = len(set(ids.flatten().tolist()))
        x = torch.randn(T, D, device=dev, generator=gen).to(torch.bfloat16)
        ids_d, tw_d = ids.to(dev), tw.to(dev)
        row = {"T": T, "pairs": T * K, "experts": touched}
        try:
            vl = VllmExperts(x, ids_d, tw_d).buffers(M, D)
            # the sweep: every runnable config on the whole FFN, as benchmark_moe.py tunes
            t0 = time.time()
            times, failed = {}, 0
            for cfg in runnable:
                try:
                    times[config_name(cfg)] = (cycled_us(lambda i, cfg=cfg: vl(*vw[i], cfg), SWEEP_ITERS), cfg)
                except Exception:  # noqa: BLE001 -- as vLLM's tuner: a config that cannot run is skipped
                    failed += 1
            best_name, (_, best) = min(times.items(), key=lambda kv: kv[1][0])
            sweep_s = time.time() - t0
            v_us = cycled_us(lambda i: vl(*vw[i], best), ROW_ITERS)
            v_default_us = (cycled_us(lambda i: vl(*vw[i], DEFAULT_CONFIG), ROW_ITERS)
                            if config_name(DEFAULT_CONFIG) in times else float("nan"))
            y_v = vl(*vw[0], best).clone()

            R0 = align_ref(ids.long(), E)
            R = {"order": R0["order"].to(dev, torch.int32), "offsets": R0["offsets"].to(dev, torch.int32)}
            h = torch.empty(T * K, M, device=dev, dtype=torch.bfloat16)
            eo = torch.empty(T * K, D, device=dev, dtype=torch.bfloat16)
            y_d = torch.full((T, D), float("nan"), device=dev, dtype=torch.bfloat16)
            sz = {"T": T, "NP": T * K}
            (lgu, _, ogu), (ldn, _, odn), (lcb, _, ocb) = side["gate_up"], side["down"], side["combine"]

            def dsg(i):
                runner.run_all(lgu, values={"x": x, "R": R, ogu: h}, weights=dw[i], sizes=sz)
                runner.run_all(ldn, values={"a": h, "R": R, odn: eo}, weights=dw[i], sizes=sz)
                runner.run_all(lcb, values={"eo": eo, "w": tw_d, ocb: y_d}, sizes=sz)

            dsg(0)
            torch.cuda.synchronize()
            y_dsg = y_d.clone()
            d_us = cycled_us(dsg, ROW_ITERS)

            w13, s13, w2, s2 = vw[0]
            ref = ffn_reference(x, ids_d, tw_d, w13, s13, w2, s2, vllm_rounding=False)
            refq = ffn_reference(x, ids_d, tw_d, w13, s13, w2, s2, vllm_rounding=True)
            ev, evq, ed = rel_err(y_v, ref), rel_err(y_v, refq), rel_err(y_dsg, ref)
            flags = [n for n, e, lim in (("vLLM err", ev, BAD_VLLM), ("vLLM errq", evq, BAD_VLLM_Q),
                                         ("dsgraph err", ed, BAD_DSG)) if not e <= lim]
            bad += bool(flags)
            row.update(vllm_us=v_us, vllm_config=best, vllm_default_us=v_default_us, vllm_err=ev, vllm_errq=evq,
                       dsgraph_us=d_us, dsgraph_err=ed, sweep_s=sweep_s, configs_timed=len(times), configs_failed=failed,
                       bad=flags)
            print(f"{T:>4} {T * K:>5} {touched:>3} | {best_name:<18} {v_us:>8.1f} {v_default_us:>8.1f} "
                  f"{ev:>7.1e} {evq:>7.1e} | {d_us:>10.1f} {ed:>7.1e} | {v_us / d_us:>7.2f}x"
                  + (f"  BAD: {', '.join(flags)}" if flags else ""), flush=True)
        except Exception as e:  # noqa: BLE001 -- one failed row is reported and the table goes on
            bad += 1
            row["failed"] = f"{type(e).__name__}: {e}"
            print(f"{T:>4} FAILED: {row['failed']}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    print("\nvLLM us: its best config of the sweep, re-timed; default: vLLM's untuned block-fp8 config; "
          "vLLM/dsg > 1: dsgraph faster.", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                       "grid": "quick" if args.quick else "full", "configs": len(configs), "rows": rows},
                      fh, indent=1)
    if bad:
        print(f"{bad} row(s) BAD or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
