"""Load and run a network library written by `tensortune compile`: numpy and ctypes only.

    from tensortune.runtime import load
    m = load("out/")                 # the folder, or the .so beside its manifest.json
    m.input_shapes                   # {"data": (1, 3, 224, 224)}
    outs = m.run({"data": x})        # {"output": array}

This module imports nothing else of tensortune (nor llvmlite, prefect, dask or xgboost), so a deployed
process needs only numpy. A library built for CPU features this host lacks is refused with the list of
missing features, before it is loaded.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
from typing import Mapping

import numpy as np

__all__ = ["load", "CompiledModule", "RuntimeLoadError"]


class RuntimeLoadError(RuntimeError):
    """The library cannot be loaded or run here; the message says why."""


# LLVM feature name -> /proc/cpuinfo flag, for the instruction-set features generated code may use.
_CPUINFO_FLAG = {
    "sse": "sse", "sse2": "sse2", "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2",
    "sse4a": "sse4a", "avx": "avx", "avx2": "avx2", "fma": "fma", "fma4": "fma4", "f16c": "f16c",
    "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt", "movbe": "movbe", "aes": "aes",
    "pclmul": "pclmulqdq", "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni", "vaes": "vaes",
}
_MACHINES = {"x86_64": ("x86_64", "amd64"), "aarch64": ("aarch64", "arm64")}


def host_cpu_flags() -> set[str] | None:
    """The host's CPU flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def missing_features(features: str, flags: set[str] | None = None) -> list[str]:
    """The LLVM features ('+avx2,...') the library was built with that this host's CPU does not have."""
    flags = host_cpu_flags() if flags is None else flags
    if flags is None:
        return []
    out = []
    for feat in features.split(","):
        feat = feat.strip()
        if feat.startswith("+") and feat[1:] in _CPUINFO_FLAG and _CPUINFO_FLAG[feat[1:]] not in flags:
            out.append(feat[1:])
    return out


def _check_host(manifest: dict, where: str) -> None:
    target = manifest.get("target", {})
    arch = str(target.get("triple", "")).split("-")[0]
    machine = platform.machine().lower()
    if arch and arch in _MACHINES and machine not in _MACHINES[arch]:
        raise RuntimeLoadError(f"{where} was built for {arch} ({target.get('string')}); this host is {machine}")
    if arch in ("", "x86_64"):
        missing = missing_features(str(target.get("features", "")))
        if missing:
            raise RuntimeLoadError(
                f"{where} was built for CPU {target.get('cpu')!r} with features this host's CPU lacks: "
                f"{', '.join(missing)}; compile it again on (or for) this machine")


_DTYPES = {"float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool"}


class CompiledModule:
    """A loaded network library: `input_shapes`, `output_shapes`, `run(inputs) -> outputs`."""

    def __init__(self, library: str, manifest: dict, weights: str | None):
        self.path, self.manifest = library, manifest
        self.name = manifest["name"]
        try:
            self._lib = ctypes.CDLL(os.path.abspath(library))
        except OSError as err:
            raise RuntimeLoadError(f"cannot load {library}: {err}") from err
        p = self.name
        lib = self._lib
        for fn, res, args in (("num_inputs", ctypes.c_int32, []), ("num_outputs", ctypes.c_int32, []),
                              ("weights_size", ctypes.c_int64, []), ("num_calls", ctypes.c_int32, []),
                              ("set_weights", ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int64]),
                              ("run", ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p])):
            f = getattr(lib, f"{p}_{fn}")
            f.restype, f.argtypes = res, args
        self.inputs = self._signature("input", getattr(lib, f"{p}_num_inputs")())
        self.outputs = self._signature("output", getattr(lib, f"{p}_num_outputs")())
        self._run = getattr(lib, f"{p}_run")
        size = int(getattr(lib, f"{p}_weights_size")())
        self._weights = np.empty(0, np.uint8)
        if size:
            if weights is None or not os.path.exists(weights):
                raise RuntimeLoadError(f"{library} needs its weights file ({weights or 'not named'}), not found")
            raw = np.empty(size + 64, np.uint8)
            start = (-raw.ctypes.data) % 64
            self._weights = raw[start: start + size]
            data = np.fromfile(weights, dtype=np.uint8)
            if data.size != size:
                raise RuntimeLoadError(f"{weights} holds {data.size} bytes, the library expects {size}")
            self._weights[:] = data
        if getattr(lib, f"{p}_set_weights")(self._weights.ctypes.data if size else None, size) != 0:
            raise RuntimeLoadError(f"{library} refused its weights ({size} bytes)")
        self.num_calls = int(getattr(lib, f"{p}_num_calls")())
        self._in_ptrs = (ctypes.c_void_p * max(1, len(self.inputs)))()
        self._out_ptrs = (ctypes.c_void_p * max(1, len(self.outputs)))()
        self._last = None

    def _signature(self, kind: str, n: int) -> list[tuple[str, tuple[int, ...], str]]:
        lib, p = self._lib, self.name
        name_f, dtype_f = getattr(lib, f"{p}_{kind}_name"), getattr(lib, f"{p}_{kind}_dtype")
        ndim_f, shape_f = getattr(lib, f"{p}_{kind}_ndim"), getattr(lib, f"{p}_{kind}_shape")
        for f in (name_f, dtype_f):
            f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_int32]
        ndim_f.restype, ndim_f.argtypes = ctypes.c_int32, [ctypes.c_int32]
        shape_f.restype, shape_f.argtypes = ctypes.POINTER(ctypes.c_int64), [ctypes.c_int32]
        out = []
        for i in range(n):
            nd = ndim_f(i)
            shape = shape_f(i)
            dtype = dtype_f(i).decode()
            if dtype not in _DTYPES:
                raise RuntimeLoadError(f"{self.path}: {kind} {i} has unsupported dtype {dtype!r}")
            out.append((name_f(i).decode(), tuple(int(shape[d]) for d in range(nd)), dtype))
        return out

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s for n, s, _ in self.inputs}

    @property
    def output_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s for n, s, _ in self.outputs}

    @property
    def input_dtypes(self) -> dict[str, str]:
        return {n: d for n, _, d in self.inputs}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the network once; inputs by name (cast to the library's dtype), fresh output arrays."""
        missing = [n for n, _, _ in self.inputs if n not in inputs]
        if missing:
            raise ValueError(f"{self.name} needs input(s) {missing}; got {sorted(inputs)}")
        keep = []
        for i, (name, shape, dtype) in enumerate(self.inputs):
            arr = np.ascontiguousarray(np.asarray(inputs[name]), dtype=dtype)
            if arr.shape != shape:
                raise ValueError(f"input {name!r} must have shape {list(shape)}, got {list(arr.shape)}")
            keep.append(arr)
            self._in_ptrs[i] = arr.ctypes.data
        outs = {}
        for j, (name, shape, dtype) in enumerate(self.outputs):
            outs[name] = np.empty(shape, dtype=dtype)
            self._out_ptrs[j] = outs[name].ctypes.data
        self._last = (keep, outs)          # run_pointers writes into these: keep them alive
        self.run_pointers()
        return outs

    def run_pointers(self) -> None:
        """Run again on the last `run`'s inputs, into the arrays it returned (timing without allocation)."""
        if self._last is None:
            raise RuntimeLoadError("run_pointers needs a `run` first (it reuses that run's arrays)")
        code = self._run(self._in_ptrs, self._out_ptrs)
        if code != 0:
            raise RuntimeLoadError(f"{self.name}_run failed with code {code}")


def _read_manifest(path: str) -> tuple[str, dict]:
    try:
        with open(path) as f:
            return path, json.load(f)
    except (OSError, ValueError) as err:
        raise RuntimeLoadError(f"cannot read the manifest {path}: {err}") from err


def load(path: str) -> CompiledModule:
    """Load a compiled network from its folder (manifest.json, library, weights) or its .so file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        folder, library = path, None
    elif os.path.isfile(path):
        folder, library = os.path.dirname(os.path.abspath(path)), path
    else:
        raise RuntimeLoadError(f"no compiled network at {path}")
    _, manifest = _read_manifest(os.path.join(folder, "manifest.json"))
    if library is None:
        library = os.path.join(folder, manifest.get("library", ""))
    if not os.path.isfile(library):
        raise RuntimeLoadError(f"the library {library} named by {folder}/manifest.json is missing")
    _check_host(manifest, library)
    weights = os.path.join(folder, manifest["weights"]) if manifest.get("weights") else None
    return CompiledModule(library, manifest, weights)
