"""What the cuda backend needs of the machine, checked before anything is read or compiled: a Hopper
GPU (the generated kernels' target) and a driver for CUDA 13 (the NVRTC and cuda-bindings wheels
dsgraph is built with).  The reference backend needs neither."""
from __future__ import annotations

import torch

from codegen.arch import MIN_ARCH, SUPPORTED_GPUS

from .errors import InputError

MIN_DRIVER = 13000          # cuDriverGetVersion's 1000 * major + 10 * minor: CUDA 13.0 (driver R580)
DRIVER_REQUIREMENT = "an NVIDIA driver for CUDA 13 or newer (R580+)"


def driver_version() -> int | None:
    """The CUDA version the installed driver supports (1000 * major + 10 * minor), None if unknown."""
    try:
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - no usable driver library: the first real call says why
        return None
    return int(version) if err == driver.CUresult.CUDA_SUCCESS else None


def check_gpu(device: torch.device) -> None:
    """InputError, one line, unless `device` can run dsgraph's generated kernels."""
    major, minor = torch.cuda.get_device_capability(device)
    if 10 * major + minor < MIN_ARCH:
        raise InputError(f"backend='cuda' runs dsgraph's generated kernels, written for {SUPPORTED_GPUS} and newer; "
                         f"{device} is a {torch.cuda.get_device_name(device)} (sm_{major}{minor}); "
                         f"use backend='reference' (slow, any device)")
    version = driver_version()
    if version is not None and version < MIN_DRIVER:
        raise InputError(f"the NVIDIA driver here supports CUDA {version // 1000}.{version % 1000 // 10}; dsgraph's "
                         f"kernels are built with CUDA 13 and need {DRIVER_REQUIREMENT}: update the driver")
