"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API.

Some decode kernels need control that Triton does not give (which loads are in flight while which registers
are multiplied). Those are written in CUDA C++ (`ember/*/csrc/*.cu`, no CUDA headers needed; what they share
is in `ember/ops/csrc/ember_cuda.cuh`) and built on first use for the GPU in hand by NVRTC, the run-time
compiler that CUDA builds of torch ship with (nvidia-cuda-nvrtc): no toolkit, no nvcc, no C++ compiler on the
user's machine. A build takes about a second; the cubin is cached per source, device and NVRTC version in
`$EMBER_CACHE_DIR/kernels/`.

    kernels = load(source_path, ["int8_gemv<true, 4, 1, 4, false>"], device)
    launch(kernels["int8_gemv<true, 4, 1, 4, false>"], grid, block, (x, w, s, y, N, K, M), device, pdl=True)

`launch` passes tensors as device pointers and Python ints as C ints, on torch's current stream, so CUDA
graph capture records it like any other kernel; `pdl=True` launches with programmatic dependent launch
(`ember.ops.launch`: the kernel must call griddepcontrol.wait before reading what an earlier kernel wrote).
`available()` is False where NVRTC or the driver library cannot be loaded (one log line says why):
callers then keep their Triton kernels.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from ember.paths import cache_root, remove_stale, temporary

log = logging.getLogger(__name__)

ENV = "EMBER_CUDA_KERNELS"  # "0": never build or launch these kernels
_CLUSTER_ATTRIBUTE = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_LOCK = threading.Lock()
_MODULES: dict[tuple, dict[str, ctypes.c_void_p]] = {}


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed."""


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int), ("dims", ctypes.c_uint * 3)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attr)),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [
        ctypes.POINTER(_LaunchConfig),
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ]
    return lib


def _nvrtc_candidates() -> list[str]:
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    site = os.path.dirname(os.path.dirname(torch.__file__))  # holds torch and the nvidia/* wheels
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    return [n for n in names if "builtins" not in n and "alt" not in os.path.basename(n)]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    errors = []
    for name in _nvrtc_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise CudaError("NVRTC (libnvrtc) not found: " + "; ".join(errors[:3]))


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(msg))
        raise CudaError(f"{what} failed: {(msg.value or b'error %d' % result).decode()}")


def _nvrtc_check(result: int, what: str) -> None:
    if result != 0:
        lib = _nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CudaError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(result).decode()}")


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


HEADERS = (Path(__file__).with_name("csrc") / "ember_cuda.cuh",)  # what Ember's kernel sources share


def headers() -> dict[str, str]:
    """What a kernel source may `#include "name"`: {name: text}."""
    return {path.name: path.read_text() for path in HEADERS}


def compile_cubin(
    source: str, names: list[str], arch: str, filename: str, includes: dict[str, str] | None = None
) -> tuple[bytes, dict[str, str]]:
    """NVRTC: CUDA C++ source -> (cubin for sm_`arch`, {name expression: lowered symbol}). includes: the
    headers the source may `#include "name"`, {name: text}."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    includes = includes or {}
    texts = (ctypes.c_char_p * len(includes))(*[t.encode() for t in includes.values()])
    include_names = (ctypes.c_char_p * len(includes))(*[n.encode() for n in includes])
    _nvrtc_check(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), filename.encode(), len(includes), texts, include_names
        ),
        "create",
    )
    try:
        for name in names:
            _nvrtc_check(lib.nvrtcAddNameExpression(prog, name.encode()), "name expression")
        opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "-default-device"]
        opts_c = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), opts_c)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, text)
            raise CudaError(f"NVRTC could not compile {filename}:\n{text.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _nvrtc_check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = {}
        for name in names:
            sym = ctypes.c_char_p()
            _nvrtc_check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(sym)), "lowered name")
            lowered[name] = sym.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_PRIMARY: dict[int, ctypes.c_void_p] = {}


def _make_current(index: int) -> None:
    """Make device `index`'s primary context (torch's) current on this thread. A thread that has made no CUDA
    runtime call yet has none (a tuner's worker, a server's engine thread), and driver calls need one."""
    lib = _driver()
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        _check(lib, lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        if dev.value == index:
            return
    if index not in _PRIMARY:
        primary = ctypes.c_void_p()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
        _PRIMARY[index] = primary
    _check(lib, lib.cuCtxSetCurrent(_PRIMARY[index]), "cuCtxSetCurrent")


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare 'cuda')."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def load(path: Path, names: list[str], device: torch.device) -> dict[str, ctypes.c_void_p]:
    """The kernels `names` (template instances) of the CUDA source at `path`, built for `device`, as driver
    function handles. Built once per process and cached on disk; raises CudaError if that fails."""
    index = device_index(device)
    key = (str(path), tuple(names), index)
    with _LOCK:
        if key in _MODULES:
            return _MODULES[key]
        source, includes = path.read_text(), headers()
        arch = _arch(device)
        parts = [source, *includes.values(), *names, arch, _nvrtc_version()]
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        cache = cache_root() / "kernels" / f"{path.stem}-sm{arch}-{digest}"
        cubin_file, names_file = cache.with_suffix(".cubin"), cache.with_suffix(".names")
        if cubin_file.exists() and names_file.exists():
            cubin = cubin_file.read_bytes()
            lowered = dict(line.split("\t") for line in names_file.read_text().splitlines())
        else:
            cubin, lowered = compile_cubin(source, names, arch, path.name, includes)
            cache.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(cache.parent)
            tmp = temporary(cache)
            tmp.write_text("".join(f"{n}\t{lowered[n]}\n" for n in names))
            tmp.replace(names_file)
            tmp.write_bytes(cubin)  # last: a reader takes the pair only once the cubin is there
            tmp.replace(cubin_file)
        lib = _driver()
        torch.cuda.init()
        _make_current(index)
        module = ctypes.c_void_p()
        _check(lib, lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        functions = {}
        for name in names:
            fn = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(fn), module, lowered[name].encode()), name)
            functions[name] = fn
        _MODULES[key] = functions
        return functions


_UNBUILT: set[tuple[str, tuple[str, ...], int]] = set()  # (source, kernels, device) whose build failed


def load_or_none(path: Path, names: list[str], device: torch.device, what: str) -> dict | None:
    """`load`, or None where the build fails: logged once (naming `what`, the kernel) per source, set of
    kernels and device, which are not tried again; the caller runs its Triton kernel instead."""
    key = (str(path), tuple(names), device_index(device))
    if key in _UNBUILT:
        return None
    try:
        return load(path, names, device)
    except CudaError as e:
        log.warning("Ember's %s could not be built (%s); the Triton kernel runs instead", what, e)
        _UNBUILT.add(key)
        return None


def launch(
    fn: ctypes.c_void_p,
    grid: int | tuple[int, ...],
    block: int,
    args: tuple,
    device: torch.device,
    pdl: bool = False,
    shared: int = 0,
    cluster: int = 1,
) -> None:
    """Launch `fn` on torch's current stream of `device`: tensors go as pointers, ints as C ints, floats as C
    floats. cluster > 1: consecutive blocks along x form thread-block clusters of that many (sm_90+)."""
    grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    values, params = pack(args)
    config = _LaunchConfig()
    config.grid[:] = grid
    config.block[:] = (block, 1, 1)
    config.shared = shared
    config.stream = torch.cuda.current_stream(device).cuda_stream
    attrs = (_Attr * 2)()
    n = 0
    if pdl:
        attrs[n].id = _PDL_ATTRIBUTE
        attrs[n].value.flag = 1
        n += 1
    if cluster > 1:
        attrs[n].id = _CLUSTER_ATTRIBUTE
        attrs[n].value.dims[:] = (cluster, 1, 1)
        n += 1
    if n:
        config.attrs = ctypes.cast(attrs, ctypes.POINTER(_Attr))
        config.num_attrs = n
    _make_current(device_index(device))
    lib = _driver()
    _check(lib, lib.cuLaunchKernelEx(ctypes.byref(config), fn, params, None), "cuLaunchKernelEx")


@functools.cache
def _arg_layout(kinds: tuple[type, ...]) -> tuple[type, tuple[int, ...], type]:
    """A C struct of the kernel's arguments (of the C types `kinds`), its fields' offsets, the params array type."""
    fields = [(f"a{i}", kind) for i, kind in enumerate(kinds)]
    struct = type("KernelArgs", (ctypes.Structure,), {"_fields_": fields})
    return (
        struct,
        tuple(getattr(struct, f"a{i}").offset for i in range(len(fields))),
        ctypes.c_void_p * len(fields),
    )


def pack(args: tuple) -> tuple[ctypes.Structure, ctypes.Array]:
    """Kernel arguments -> (their values in one C struct, the array of their addresses that a launch takes).
    Tensors go as device pointers, Python ints as C ints, floats as C floats; keep the struct alive until the
    launch returns."""
    kinds = []
    for a in args:
        if isinstance(a, torch.Tensor):
            kinds.append(ctypes.c_void_p)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            kinds.append(ctypes.c_int if isinstance(a, int) else ctypes.c_float)
        else:
            raise TypeError(
                f"kernel argument of type {type(a).__name__}: expected a tensor, an int or a float"
            )
    struct, offsets, array = _arg_layout(tuple(kinds))
    values = struct(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
    base = ctypes.addressof(values)
    return values, array(*[base + o for o in offsets])


@functools.cache
def available() -> bool:
    """Whether CUDA kernels can be built and launched here (NVRTC and the driver library load)."""
    if os.environ.get(ENV, "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        _driver()
        _nvrtc_version()
        return True
    except (OSError, CudaError, AttributeError) as e:
        log.warning("Ember's CUDA C++ kernels are off (%s); the Triton kernels run instead", e)
        return False
