"""LoadedModule.function's shared-memory opt-in, through a fake driver: a kernel's dynamic shared memory
without an opt-in is the 48 KiB default less its static shared memory."""
import types

import pytest

from runtime import cuda_driver as cd

OK = 0


class _Driver:
    CUresult = types.SimpleNamespace(CUDA_SUCCESS=OK)
    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="STATIC",
                                                 CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="MAXDYN")
    CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="OPTIN")

    def __init__(self, static: int):
        self.static = static
        self.opt_ins: list[int] = []

    def cuModuleGetFunction(self, module, name):
        return OK, "func"

    def cuFuncGetAttribute(self, attr, func):
        return OK, self.static

    def cuDeviceGet(self, device):
        return OK, 0

    def cuDeviceGetAttribute(self, attr, dev):
        return OK, 227 * 1024

    def cuFuncSetAttribute(self, func, attr, value):
        self.opt_ins.append(value)
        return (OK,)


@pytest.mark.parametrize("static, dynamic, opted", [
    (0, 40 * 1024, []),                    # under the default: nothing to do
    (0, 48 * 1024, []),
    (0, 48 * 1024 + 1, [48 * 1024 + 1]),
    (8192, 40960, []),                     # 8 KiB static leaves exactly 40 KiB
    (8192, 43920, [43920]),                # the W4A8 bench's launch that failed without an opt-in
])
def test_a_kernel_is_opted_in_above_the_default_less_its_static_shared_memory(monkeypatch, static, dynamic, opted):
    drv = _Driver(static)
    monkeypatch.setattr(cd, "_driver", lambda: drv)
    mod = cd.LoadedModule("m", object(), None, 0)
    mod.function("k", dynamic)
    mod.function("k", dynamic)             # the second call finds it done
    assert drv.opt_ins == opted
    more = max(dynamic, 48 * 1024 - static) + 16
    mod.function("k", more)                # past the default or the last opt-in: opted in (again)
    assert drv.opt_ins == [*opted, more]
