"""Tensor maps (TMA descriptors) on the host, without a GPU: the geometry handed to
cuTensorMapEncodeTiled (innermost first, byte strides, leading dims boxed by 1), each driver
constraint refused up front with one clear line, the descriptor placed 64-byte aligned, passed by
value (cuda-bindings copies its 128 bytes), and a launch's tensor-map argument bound from its weight."""
from __future__ import annotations

import ctypes

import pytest
import torch

from codegen.kernel import KernelLaunch, tensor_map
from runtime import cuda_driver
from runtime.cuda_driver import TensorMapError, pack_args, tiled_map_params
from runtime.launcher import KernelRunner, LaunchError


def test_geometry_of_a_stacked_expert_weight():
    E, N, K = 64, 1408, 2048
    p = tiled_map_params((E, N, K), (N * K, K, 1), 2, 1 << 20, (128, 64), 128)
    assert p.dims == (K, N, E) and p.strides == (K * 2, N * K * 2) and p.box == (64, 128, 1)


@pytest.mark.parametrize("shape,strides,address,box,swizzle,match", [
    ((4, 8, 64), (512, 64, 1), 8, (8, 64), 128, "16-byte aligned base"),
    ((4, 8, 60), (480, 60, 1), 0, (8, 60), 128, "16-byte multiples"),
    ((4, 8, 64), (512, 1, 8), 0, (8, 64), 128, "innermost dim must be contiguous"),
    ((4, 8, 128), (1024, 128, 1), 0, (8, 128), 128, "swizzle 128 B cannot take box rows of 256 B"),
    ((4, 512, 64), (32768, 64, 1), 0, (512, 64), 128, "box dims must be 1..256"),
    ((2, 2, 2, 2, 2, 8), (128, 64, 32, 16, 8, 1), 0, (8,), 0, "1..5 dims"),
])
def test_what_tma_cannot_describe_is_one_clear_error(shape, strides, address, box, swizzle, match):
    with pytest.raises(TensorMapError, match=match):
        tiled_map_params(shape, strides, 2, address, box, swizzle)


def test_a_tensor_map_is_64_byte_aligned_and_passed_by_value():
    tmap = cuda_driver._aligned_tensor_map()
    assert ctypes.addressof(tmap) % 64 == 0 and ctypes.sizeof(tmap) == 128
    values, types = pack_args([tmap])
    assert values == (tmap,) and types == (None,)    # cuda-bindings: a ctypes.Structure, by address


def _launch():
    return KernelLaunch(family="f", template="t", name="k", params={}, nodes=("n",), grid=(1, 1, 1),
                        block=(32, 1, 1), args=(tensor_map("w", "e.*.w", (128, 64)),))


def test_a_missing_or_host_weight_is_a_launch_error():
    runner, launch = KernelRunner(arch="sm_90a"), _launch()
    with pytest.raises(LaunchError, match="needs weight 'e.\\*.w'"):
        runner._arg(launch.args[0], launch, {}, {}, {}, {}, {})
    with pytest.raises(LaunchError, match="tensor_map e.\\*.w box 128x64.*CUDA tensor"):
        runner._arg(launch.args[0], launch, {}, {"e.*.w": torch.zeros(2, 128, 64, dtype=torch.bfloat16)}, {}, {}, {})


def test_a_runner_refuses_a_kernel_its_target_cannot_build():
    import dataclasses
    launch = dataclasses.replace(_launch(), requires=("sm_90a",))
    with pytest.raises(LaunchError, match="sm_90a features, which this runner's target sm_100 does not offer"):
        KernelRunner(arch="sm_100").cubin(launch)
