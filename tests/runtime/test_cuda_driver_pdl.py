"""The launch paths of runtime/cuda_driver.py on the CPU, through a fake driver module: a PDL launch
is one cuLaunchKernelEx whose config carries the launch geometry, the stream and exactly one
attribute (programmatic stream serialization, allowed); every other launch is the plain
cuLaunchKernel; errors keep their one-line form with a hint.  The KernelRunner launches as each
manifest step says (KernelLaunch.pdl)."""
from __future__ import annotations

import types

import pytest
import torch

import runtime.cuda_driver as cd
from codegen.kernel import KernelLaunch, SizeRef, ValueRef, Arg
from runtime.launcher import KernelRunner

SUCCESS, INVALID_VALUE, INVALID_CONTEXT, NOT_SUPPORTED = 0, 1, 201, 801


class _Enum(int):
    """A CUresult stand-in: an int with a name."""

    def __new__(cls, value, name):
        obj = int.__new__(cls, value)
        obj.name = name
        return obj


class FakeDriver:
    """What cuda_driver uses of cuda.bindings.driver, recording every launch."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=_Enum(SUCCESS, "CUDA_SUCCESS"),
                                     CUDA_ERROR_INVALID_VALUE=_Enum(INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
                                     CUDA_ERROR_INVALID_CONTEXT=_Enum(INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
                                     CUDA_ERROR_NOT_SUPPORTED=_Enum(NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"))
    CUlaunchAttributeID = types.SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION="PSS")
    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="MAXDYN")

    class CUstream(int):
        pass

    class CUlaunchAttribute:
        def __init__(self):
            self.id = None
            self.value = types.SimpleNamespace(programmaticStreamSerializationAllowed=0)

    class CUlaunchConfig:
        pass

    def __init__(self, results=()):
        self.calls = []
        self.results = list(results)     # CUresults to answer with, in order (then success)
        self.configs_made = 0
        outer = self

        class Config(FakeDriver.CUlaunchConfig):
            def __init__(self):
                outer.configs_made += 1
        self.CUlaunchConfig = Config

    def _answer(self):
        return (self.results.pop(0) if self.results else self.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("cuLaunchKernel", func, (gx, gy, gz), (bx, by, bz), smem, int(stream), params))
        return self._answer()

    def cuLaunchKernelEx(self, config, func, params, extra):
        self.calls.append(("cuLaunchKernelEx", func, config, params))
        return self._answer()

    def cuGetErrorName(self, err):
        return self.CUresult.CUDA_SUCCESS, err.name.encode()

    def cuGetErrorString(self, err):
        return self.CUresult.CUDA_SUCCESS, b"fake description"

    def cuFuncGetAttribute(self, attr, func):
        return self.CUresult.CUDA_SUCCESS, 0


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(cd, "_driver", lambda: drv)
    monkeypatch.setattr(cd, "_bind_torch_context", lambda: drv.calls.append(("bind",)))
    # the caches hold configs made by whichever driver module was current: start and end empty
    cd._pdl_config.cache_clear()
    cd._pdl_attrs.cache_clear()
    yield drv
    cd._pdl_config.cache_clear()
    cd._pdl_attrs.cache_clear()


ARGS = [cd.I32(7), cd.F32(0.5)]


def test_a_pdl_launch_is_cuLaunchKernelEx_with_the_programmatic_serialization_attribute(fake):
    cd.launch("F", (3, 2, 1), (256, 1, 1), 4096, ARGS, stream=1234, pdl=True)
    (call,) = fake.calls
    name, func, config, params = call
    assert (name, func) == ("cuLaunchKernelEx", "F")
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 1, 1)
    assert config.sharedMemBytes == 4096 and int(config.hStream) == 1234
    assert config.numAttrs == 1 and len(config.attrs) == 1
    (attr,) = config.attrs
    assert attr.id == "PSS" and attr.value.programmaticStreamSerializationAllowed == 1
    assert params == cd.pack_args(ARGS)


def test_a_plain_launch_stays_cuLaunchKernel(fake):
    cd.launch("F", (3, 2, 1), (256, 1, 1), 0, ARGS, stream=99)
    cd.launch("F", (3, 2, 1), (256, 1, 1), 0, ARGS, stream=99, pdl=False)
    assert [c[0] for c in fake.calls] == ["cuLaunchKernel", "cuLaunchKernel"]
    assert fake.calls[0][2:6] == ((3, 2, 1), (256, 1, 1), 0, 99)
    assert fake.configs_made == 0


def test_configs_are_built_once_per_geometry_and_stream(fake):
    for _ in range(5):
        cd.launch("F", (3, 1, 1), (128, 1, 1), 0, ARGS, stream=1, pdl=True)
        cd.launch("G", (3, 1, 1), (128, 1, 1), 0, ARGS, stream=1, pdl=True)   # another kernel, same config
    assert fake.configs_made == 1
    cd.launch("F", (4, 1, 1), (128, 1, 1), 0, ARGS, stream=1, pdl=True)
    cd.launch("F", (3, 1, 1), (128, 1, 1), 0, ARGS, stream=2, pdl=True)
    cd.launch("F", (3, 1, 1), (128, 1, 1), 16, ARGS, stream=1, pdl=True)
    assert fake.configs_made == 4
    configs = [c[2] for c in fake.calls]
    assert configs[0] is configs[9] and configs[10].gridDimX == 4 and int(configs[11].hStream) == 2
    assert configs[12].sharedMemBytes == 16 and configs[0].sharedMemBytes == 0


def test_an_empty_grid_launches_nothing(fake):
    cd.launch("F", (0, 1, 1), (128, 1, 1), 0, ARGS, stream=1, pdl=True)
    assert fake.calls == []


def test_a_thread_without_a_context_binds_torchs_and_retries_the_same_launch(fake):
    fake.results = [fake.CUresult.CUDA_ERROR_INVALID_CONTEXT]
    cd.launch("F", (1, 1, 1), (32, 1, 1), 0, ARGS, stream=5, pdl=True)
    assert [c[0] for c in fake.calls] == ["cuLaunchKernelEx", "bind", "cuLaunchKernelEx"]
    assert fake.calls[0][2] is fake.calls[2][2]


def test_pdl_launch_errors_name_the_call_and_say_how_to_do_without(fake):
    fake.results = [fake.CUresult.CUDA_ERROR_NOT_SUPPORTED]
    with pytest.raises(cd.CudaError) as info:
        cd.launch("F", (2, 1, 1), (64, 1, 1), 0, ARGS, stream=5, pdl=True)
    msg = str(info.value)
    assert msg.startswith("cuLaunchKernelEx(programmatic dependent launch, grid=(2, 1, 1), block=(64, 1, 1), "
                          "shared_mem=0) failed: CUDA_ERROR_NOT_SUPPORTED (fake description); ")
    assert "dsgraph compile --no-pdl" in msg and "\n" not in msg
    fake.results = [fake.CUresult.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(cd.CudaError, match=r"check the kernel's parameter count and types \(2 arguments given\)"):
        cd.launch("F", (2, 1, 1), (64, 1, 1), 0, ARGS, stream=5, pdl=True)
    fake.results = [fake.CUresult.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(cd.CudaError, match=r"^cuLaunchKernel\(grid=\(2, 1, 1\)"):
        cd.launch("F", (2, 1, 1), (64, 1, 1), 0, ARGS, stream=5)


class _Module:
    def function(self, name, smem):
        return f"func:{name}"


class DeviceTensor:
    """What the runner reads of a CUDA tensor (no GPU here)."""
    is_cuda = True
    device = "cuda:0"

    def __init__(self, address: int, strides=(1,)):
        self.address, self.strides = address, strides

    def data_ptr(self):
        return self.address

    def stride(self, dim):
        return self.strides[dim]


def test_the_runner_launches_each_step_as_its_record_says(monkeypatch):
    seen = []
    monkeypatch.setattr(cd, "launch_packed", lambda func, grid, block, smem, params, stream=None, *, pdl=False:
                        seen.append((func, grid, pdl)))
    runner = KernelRunner("sm_90")
    monkeypatch.setattr(runner, "module", lambda launch: _Module())
    base = dict(family="rms_norm", template="rms_norm.cu.j2", params={}, nodes=("n",), grid=("T", 1, 1),
                block=(32, 1, 1), args=(Arg("x", "const float*", ValueRef("x")), Arg("T", "int", SizeRef("T"))))
    x = DeviceTensor(0x1000)
    for name, pdl in (("k_pdl", True), ("k_plain", False)):
        runner.run(KernelLaunch(name=name, pdl=pdl, **base), values={"x": x}, sizes={"T": 3, "SMS": 132})
    assert seen == [("func:k_pdl", (3, 1, 1), True), ("func:k_plain", (3, 1, 1), False)]


def test_the_config_builds_with_the_real_bindings():
    """The same config through cuda.bindings itself (its structs need no GPU): the field names and the
    attribute's union member are the bindings' own, which the fake above cannot vouch for."""
    driver = pytest.importorskip("cuda.bindings.driver")
    cd._pdl_config.cache_clear()
    cd._pdl_attrs.cache_clear()
    try:
        config = cd._pdl_config((5, 2, 1), (128, 1, 1), 1024, 77)
        assert isinstance(config, driver.CUlaunchConfig)
        assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (5, 2, 128, 1024)
        assert int(config.hStream) == 77 and config.numAttrs == 1
        (attr,) = config.attrs
        assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        assert attr.value.programmaticStreamSerializationAllowed == 1
    finally:
        cd._pdl_config.cache_clear()
        cd._pdl_attrs.cache_clear()
