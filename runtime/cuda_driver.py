"""Thin CUDA driver-API layer: load CUBINs, look up kernels, launch them on
torch tensors and torch's current stream (no copies).

The kernel ABI is explicit: integers must say their width (I32 / I64), floats
are 32-bit, tensors are device pointers, tensor maps (TMA descriptors) are 128
bytes passed by value (TensorMap). A wrong width would not fail loudly; it would
silently shift every later argument.

cuda.bindings.driver is imported lazily so this module imports on machines
without a GPU or driver (CI); every call here needs a GPU.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

# Above this much dynamic shared memory a kernel must opt in per function.
_DEFAULT_DYNAMIC_SMEM = 48 * 1024
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _driver():
    from cuda.bindings import driver
    return driver


class CudaError(RuntimeError):
    """A CUDA driver call failed. `name` is the CUresult name, e.g. CUDA_ERROR_INVALID_VALUE."""

    def __init__(self, call: str, code: int, name: str, text: str, hint: str = ""):
        self.call, self.code, self.name, self.text = call, code, name, text
        super().__init__(f"{call} failed: {name} ({text})" + (f"; {hint}" if hint else ""))

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name, self.text))


def _raise(err, call: str, hint: str = "") -> None:
    driver = _driver()
    try:
        e1, name = driver.cuGetErrorName(err)
        e2, text = driver.cuGetErrorString(err)
        name = name.decode() if e1 == driver.CUresult.CUDA_SUCCESS else str(err)
        text = text.decode() if e2 == driver.CUresult.CUDA_SUCCESS else "no description"
    except Exception:  # the error may be that the driver library itself is unusable
        name, text = getattr(err, "name", str(err)), "no description"
    raise CudaError(call, int(err), name, text, hint)


def check(result, call: str = "CUDA driver call"):
    """Unwrap a cuda-bindings result, (CUresult, *values), raising CudaError on failure.

    Returns None, the single value, or a tuple of values.
    """
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _raise(err, call)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# -- kernel argument wrappers ----------------------------------------------------

def _check_int(kind: str, value, bounds: tuple[int, int]) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{kind} needs an int, got {type(value).__name__}")
    if not bounds[0] <= value <= bounds[1]:
        raise OverflowError(f"{kind}({value}) is out of range")


@dataclass(frozen=True)
class I32:
    value: int

    def __post_init__(self):
        _check_int("I32", self.value, _INT32)


@dataclass(frozen=True)
class I64:
    value: int

    def __post_init__(self):
        _check_int("I64", self.value, _INT64)


@dataclass(frozen=True)
class F32:
    value: float

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise TypeError(f"F32 needs a float, got {type(self.value).__name__}")


class TensorMap(ctypes.Structure):
    """A TMA descriptor (the driver's CUtensorMap: 128 opaque bytes), a by-value kernel parameter
    (`const __grid_constant__ dsg::TensorMap`, templates/include/tma.cuh).  Made by
    encode_tensor_map, which places it 64-byte aligned as the driver requires."""
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


assert ctypes.sizeof(TensorMap) == 128


def pack_args(args: list) -> tuple[tuple, tuple]:
    """Kernel arguments -> cuda-bindings' kernelParams form ((values...), (ctypes...)); a
    TensorMap goes by address with type None (cuda-bindings copies the parameter's 128 bytes
    from it)."""
    values, types = [], []
    for i, a in enumerate(args):
        if isinstance(a, TensorMap):
            values.append(a)
            types.append(None)
        elif isinstance(a, torch.Tensor):
            # A host pointer in a kernel faults and poisons the whole context.
            if not a.is_cuda:
                raise ValueError(f"kernel argument {i} is a {a.device} tensor; kernels need "
                                 f"CUDA tensors")
            values.append(a.data_ptr())
            types.append(ctypes.c_void_p)
        elif a is None:
            values.append(0)
            types.append(ctypes.c_void_p)
        elif isinstance(a, I32):
            values.append(a.value)
            types.append(ctypes.c_int)  # 32-bit on every platform CUDA supports
        elif isinstance(a, I64):
            values.append(a.value)
            types.append(ctypes.c_longlong)
        elif isinstance(a, F32):
            values.append(float(a.value))
            types.append(ctypes.c_float)
        elif isinstance(a, float):
            values.append(a)
            types.append(ctypes.c_float)
        elif isinstance(a, (bool, int)):
            raise TypeError(f"kernel argument {i} is a bare {type(a).__name__} ({a!r}); "
                            f"wrap it in I32(...) or I64(...) to state its width")
        else:
            raise TypeError(f"kernel argument {i} has unsupported type {type(a).__name__}; "
                            f"expected a torch.Tensor, None, I32, I64, F32, float or TensorMap")
    return tuple(values), tuple(types)


# -- modules ------------------------------------------------------------------------

def _bind_torch_context():
    """Make the primary context of torch's current device current on this thread.

    torch binds it lazily and per thread, so a fresh thread (or one that has
    only touched another device) can have none, or the wrong one, current.
    Returns (context, device ordinal).
    """
    driver = _driver()
    torch.cuda.init()  # creates torch's CUDA state; modules share its context
    device = torch.cuda.current_device()
    check(driver.cuInit(0), "cuInit")
    current = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) == 0 or int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice")) != device:
        cu_device = check(driver.cuDeviceGet(device), "cuDeviceGet")
        current = check(driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(current), "cuCtxSetCurrent")
    return current, device


class LoadedModule:
    """One CUBIN loaded into the primary context of torch's current device."""

    def __init__(self, name: str, module, context, device: int):
        self.name = name
        self.device = device
        self._module = module
        self._context = context
        self._functions: dict[str, object] = {}
        self._dynamic_smem: dict[str, int] = {}

    @classmethod
    def load(cls, cubin: bytes, name: str) -> "LoadedModule":
        driver = _driver()
        context, device = _bind_torch_context()
        module = check(driver.cuModuleLoadData(bytes(cubin)), f"cuModuleLoadData({name})")
        return cls(name, module, context, device)

    def function(self, kernel_name: str, shared_mem: int = 0):
        """The CUfunction for `kernel_name`, opted in to `shared_mem` bytes of
        dynamic shared memory when that is over the 48 KiB default."""
        driver = _driver()
        if self._module is None:
            raise RuntimeError(f"module {self.name} was unloaded")
        func = self._functions.get(kernel_name)
        if func is None:
            err, func = driver.cuModuleGetFunction(self._module, kernel_name.encode())
            if err != driver.CUresult.CUDA_SUCCESS:
                _raise(err, f"cuModuleGetFunction({kernel_name})",
                       f"module {self.name} has no extern \"C\" kernel of that name")
            self._functions[kernel_name] = func
        if shared_mem > self._dynamic_smem.get(kernel_name, 0):
            # A kernel's dynamic shared memory without an opt-in is the 48 KiB default less its static
            # shared memory; above that (or above an earlier opt-in) it must be opted in.
            static = check(driver.cuFuncGetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func), "cuFuncGetAttribute")
            if shared_mem > _DEFAULT_DYNAMIC_SMEM - static:
                self._opt_in_shared_mem(kernel_name, func, shared_mem)
            else:
                self._dynamic_smem[kernel_name] = _DEFAULT_DYNAMIC_SMEM - static
        return func

    def _opt_in_shared_mem(self, kernel_name: str, func, shared_mem: int) -> None:
        driver = _driver()
        cu_device = check(driver.cuDeviceGet(self.device), "cuDeviceGet")
        limit = check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            cu_device), "cuDeviceGetAttribute")
        static = check(driver.cuFuncGetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
            "cuFuncGetAttribute")
        if shared_mem + static > limit:
            raise ValueError(
                f"kernel {kernel_name} needs {shared_mem} B dynamic + {static} B static shared "
                f"memory per block; the device allows {limit} B "
                f"({shared_mem + static - limit} B over)")
        check(driver.cuFuncSetAttribute(
            func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_mem), f"cuFuncSetAttribute({kernel_name})")
        self._dynamic_smem[kernel_name] = shared_mem

    def unload(self) -> None:
        if self._module is not None:
            check(_driver().cuModuleUnload(self._module), f"cuModuleUnload({self.name})")
            self._module = None
            self._functions.clear()


def _dims(what: str, dims, allow_zero: bool) -> tuple[int, int, int]:
    if len(dims) != 3 or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise TypeError(f"{what} must be three ints, got {dims!r}")
    if any(d < (0 if allow_zero else 1) for d in dims):
        raise ValueError(f"{what} dims must be {'>= 0' if allow_zero else '>= 1'}: {dims!r}")
    return tuple(dims)


# -- programmatic dependent launch ------------------------------------------------------
# A PDL launch goes through cuLaunchKernelEx with one attribute, programmatic stream
# serialization: the kernel may start while the one before it in the stream is still running
# (once that one's CTAs have all called griddepcontrol.launch_dependents or exited), and its
# griddepcontrol.wait then blocks until that kernel has completed and its writes are visible
# (templates/include/pdl.cuh).  Stream capture keeps it as a programmatic edge of the graph.
# The attribute is the same for every PDL launch, and a launch config is a few fields: the configs
# of recent (grid, block, shared memory, stream) are kept, so the eager prefill's ~600 launches a
# step mostly reuse one (building one costs ~1 us of Python, looking it up ~0.1 us).

@functools.lru_cache(maxsize=1)
def _pdl_attrs() -> tuple:
    driver = _driver()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return (attr,)


@functools.lru_cache(maxsize=512)
def _pdl_config(grid: tuple, block: tuple, shared_mem: int, stream: int):
    """The CUlaunchConfig of a programmatic dependent launch (never modified once made)."""
    driver = _driver()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream)
    attrs = _pdl_attrs()
    config.attrs = list(attrs)
    config.numAttrs = len(attrs)
    return config


def _launch_once(func, grid, block, shared_mem: int, stream: int, params, pdl: bool):
    """One driver launch; returns its CUresult."""
    driver = _driver()
    if pdl:
        (err,) = driver.cuLaunchKernelEx(_pdl_config(grid, block, shared_mem, stream), func, params, 0)
    else:
        (err,) = driver.cuLaunchKernel(func, *grid, *block, shared_mem, driver.CUstream(stream), params, 0)
    return err


def launch(func, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
           args: list, stream: int | torch.cuda.Stream | None = None, *, pdl: bool = False) -> None:
    """Launch `func` (from LoadedModule.function) asynchronously on `stream`
    (default: torch's current stream). An empty grid launches nothing.

    pdl=True: a programmatic dependent launch (cuLaunchKernelEx, see above); only for a kernel that
    keeps templates/include/pdl.cuh's contract, which is what KernelLaunch.pdl records."""
    grid = _dims("grid", grid, allow_zero=True)
    block = _dims("block", block, allow_zero=False)
    if 0 in grid:
        return  # e.g. no tokens this step; CUDA would reject a zero-sized grid
    launch_packed(func, grid, block, shared_mem, pack_args(args), stream, pdl=pdl)


def launch_packed(func, grid: tuple, block: tuple, shared_mem: int, params: tuple,
                  stream: int | torch.cuda.Stream | None = None, *, pdl: bool = False) -> None:
    """launch() for arguments already packed (pack_args' form) and dims already checked (a
    non-empty grid): the runner's path, which works both out once per launch and step sizes."""
    if stream is None:
        stream = torch.cuda.current_stream().cuda_stream
    elif isinstance(stream, torch.cuda.Stream):
        stream = stream.cuda_stream
    driver = _driver()
    err = _launch_once(func, grid, block, shared_mem, stream, params, pdl)
    if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread that has not used CUDA yet has no current context; bind
        # torch's and retry (nothing was launched). Costs nothing when bound.
        _bind_torch_context()
        err = _launch_once(func, grid, block, shared_mem, stream, params, pdl)
    if err != driver.CUresult.CUDA_SUCCESS:
        hint = ""
        if pdl and err == driver.CUresult.CUDA_ERROR_NOT_SUPPORTED:
            hint = ("programmatic dependent launch needs an sm_90 (Hopper) or newer GPU and a CUDA 12.3+ "
                    "driver; recompile the bundle without it (dsgraph compile --no-pdl)")
        elif err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            # Error path only, so the query costs the hot path nothing.
            opted = driver.cuFuncGetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func)
            if opted[0] == driver.CUresult.CUDA_SUCCESS and shared_mem > opted[1]:
                hint = (f"{shared_mem} B of dynamic shared memory is over the {opted[1]} B this "
                        f"kernel is opted in to; get it with "
                        f"LoadedModule.function(name, shared_mem={shared_mem})")
            else:
                hint = (f"check the kernel's parameter count and types "
                        f"({len(params[0])} arguments given)")
        call = "cuLaunchKernelEx(programmatic dependent launch, " if pdl else "cuLaunchKernel("
        _raise(err, f"{call}grid={grid}, block={block}, shared_mem={shared_mem})", hint)


def device_arch() -> str:
    """The current device as an NVRTC target, e.g. 'sm_90' on H100/H200."""
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


# -- tensor maps (TMA descriptors) ----------------------------------------------------

_TMA_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
               torch.float32: "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
               torch.float8_e4m3fn: "CU_TENSOR_MAP_DATA_TYPE_UINT8", torch.uint8: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
               torch.int8: "CU_TENSOR_MAP_DATA_TYPE_UINT8"}   # bytes copied as bytes; out of bounds: zeros
_TMA_SWIZZLES = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
                 128: "CU_TENSOR_MAP_SWIZZLE_128B"}


class TensorMapError(ValueError):
    """A tensor cannot be described by the tensor map a kernel asks for (alignment, strides, box)."""


@dataclass(frozen=True)
class TiledMapParams:
    """cuTensorMapEncodeTiled's geometry, innermost dimension first."""
    dims: tuple            # elements per dim
    strides: tuple         # bytes between consecutive indices of dims 1.. (dim 0 is contiguous)
    box: tuple             # elements per copy along each dim


def tiled_map_params(shape, strides, elem_bytes: int, address: int, box, swizzle: int) -> TiledMapParams:
    """The TMA geometry of a tensor of `shape` / element `strides` at `address` for boxes of `box`
    over its trailing dims (outermost first; leading dims get 1), with the driver's constraints
    checked here so that a bad weight is one clear error, not an INVALID_VALUE: a contiguous
    innermost dim, a 16-byte aligned base and 16-byte multiple strides, box dims of 1..256, and a
    swizzled box row no wider than the swizzle span."""
    shape, strides, box = tuple(int(d) for d in shape), tuple(int(s) for s in strides), tuple(int(b) for b in box)
    if not 1 <= len(shape) <= 5 or len(box) > len(shape):
        raise TensorMapError(f"a tensor map covers 1..5 dims with a box over at most all of them: "
                             f"shape {shape}, box {box}")
    if strides[-1] != 1:
        raise TensorMapError(f"the innermost dim must be contiguous (strides {strides})")
    if address % 16:
        raise TensorMapError(f"TMA needs a 16-byte aligned base (address % 16 = {address % 16})")
    if any((s * elem_bytes) % 16 for s in strides[:-1]):
        raise TensorMapError(f"TMA needs strides that are 16-byte multiples (strides {strides} x {elem_bytes} B)")
    full_box = (1,) * (len(shape) - len(box)) + box
    if any(not 1 <= b <= 256 for b in full_box):
        raise TensorMapError(f"box dims must be 1..256, got {box}")
    if swizzle not in _TMA_SWIZZLES or (swizzle and full_box[-1] * elem_bytes > swizzle):
        raise TensorMapError(f"swizzle {swizzle} B cannot take box rows of {full_box[-1] * elem_bytes} B")
    return TiledMapParams(dims=shape[::-1], strides=tuple(s * elem_bytes for s in strides[-2::-1]),
                          box=full_box[::-1])


def _aligned_tensor_map() -> TensorMap:
    """A TensorMap at a 64-byte aligned address (the driver's requirement for the descriptor it
    writes; ctypes and cuda-bindings' own CUtensorMap objects are only 16-byte aligned)."""
    buf = ctypes.create_string_buffer(ctypes.sizeof(TensorMap) + 64)
    offset = (-ctypes.addressof(buf)) % 64
    tmap = TensorMap.from_buffer(buf, offset)
    tmap._buffer = buf          # keep the storage alive with the view
    return tmap


@functools.lru_cache(maxsize=None)
def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled through ctypes, on the libcuda torch has loaded: it
    writes into memory we place 64-byte aligned (see _aligned_tensor_map); the enum values are
    cuda-bindings'."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tensor_map(tensor: torch.Tensor, box, swizzle: int = 128) -> TensorMap:
    """A TMA descriptor of `tensor` (a CUDA tensor, e.g. a stacked expert weight [E, N, K]) for
    boxes of `box` over its trailing dims, zeros filled outside it (TensorMapError if it cannot be
    described; CudaError if the driver refuses)."""
    if not tensor.is_cuda or tensor.dtype not in _TMA_DTYPES:
        raise TensorMapError(f"a tensor map describes a CUDA tensor of {', '.join(map(str, _TMA_DTYPES))}, "
                             f"got a {tensor.device} {tensor.dtype} tensor")
    p = tiled_map_params(tensor.shape, tensor.stride(), tensor.element_size(), tensor.data_ptr(), box, swizzle)
    driver = _driver()
    rank = len(p.dims)
    tmap = _aligned_tensor_map()
    err = _encode_tiled()(
        ctypes.addressof(tmap), int(getattr(driver.CUtensorMapDataType, _TMA_DTYPES[tensor.dtype])), rank,
        tensor.data_ptr(), (ctypes.c_uint64 * rank)(*p.dims), (ctypes.c_uint64 * max(1, rank - 1))(*p.strides),
        (ctypes.c_uint32 * rank)(*p.box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        int(driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
        int(getattr(driver.CUtensorMapSwizzle, _TMA_SWIZZLES[swizzle])),
        int(driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B),
        int(driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    if err:
        _raise(driver.CUresult(err), f"cuTensorMapEncodeTiled(dims={p.dims}, box={p.box}, swizzle={swizzle})")
    return tmap
