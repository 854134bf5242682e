"""Expert parallel at the op level: a rank computes only the pairs of its own experts.

moe_local_experts gives another rank's pairs id -1 and weight 0; alignment leaves them out, so the
grouped expert ops never compute them; the combine skips weight-0 pairs whatever their rows hold.
Summed over the ranks (the all-reduce), the partial outputs are the single-process output."""
from __future__ import annotations

import torch

from ir.ops.moe import align_ref, combine_ref, grouped_linear, local_experts_ref


def _routing(T=37, E=8, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=g)
    return ids, weights


def test_other_ranks_pairs_get_id_minus_one_and_weight_zero():
    ids, w = _routing()
    lid, lw = local_experts_ref(ids, w, first=4, count=4)
    mine = (ids >= 4) & (ids < 8)
    assert torch.equal(lid[mine], ids[mine] - 4) and torch.equal(lw[mine], w[mine])
    assert (lid[~mine] == -1).all() and (lw[~mine] == 0).all()


def test_alignment_leaves_out_pairs_of_no_local_expert():
    ids, w = _routing()
    lid, _ = local_experts_ref(ids, w, first=0, count=4)
    r = align_ref(lid, 4)
    n_local = int((lid >= 0).sum())
    assert r["offsets"][-1].item() == n_local                  # every segment holds local pairs only
    flat = lid.reshape(-1)
    grouped = r["order"][:n_local]
    assert (flat[grouped] >= 0).all()
    assert torch.equal(flat[grouped], torch.sort(flat[flat >= 0]).values)
    assert sorted(r["order"].tolist()) == list(range(flat.numel()))   # the rest follow, unclaimed


def test_combine_skips_weight_zero_pairs_even_over_garbage_rows():
    T, K, D = 5, 3, 4
    eo = torch.randn(T * K, D)
    w = torch.rand(T, K)
    w[1, 2] = 0.0
    w[3, 0] = 0.0
    ref = combine_ref(eo, w)
    eo[1 * K + 2] = float("nan")
    eo[3 * K + 0] = float("inf")
    assert torch.equal(combine_ref(eo, w), ref)


def test_ranks_partial_expert_outputs_sum_to_the_single_process_output():
    T, E, K, D, M, world = 37, 8, 3, 16, 12, 4
    ids, w = _routing(T, E, K, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    W = torch.randn(E, M, D, generator=g, dtype=torch.float64)
    full = combine_ref(grouped_linear(x, False, align_ref(ids, E), W, T * K), w).double()
    total, computed = torch.zeros_like(full), 0
    for r in range(world):
        first, count = r * E // world, E // world
        lid, lw = local_experts_ref(ids, w, first, count)
        routing = align_ref(lid, count)
        computed += int(routing["offsets"][-1])
        eo = grouped_linear(x, False, routing, W[first:first + count], T * K)
        total += combine_ref(eo, lw).double()
    assert computed == T * K                                   # each pair computed by exactly one rank
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)   # combine_ref sums in fp32
