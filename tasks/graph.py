"""The network graph IR: named values flowing through single-output op nodes, with constant weights.

A `Graph` is what model builders and the ONNX importer produce and what task extraction consumes.
Every value has a static shape and dtype, inferred when a node is added (tasks.graph_ops), so a bad
network fails at the node that is wrong; `run_reference` runs each op's NumPy implementation.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tensortune.tasks.graph_ops import DTYPES, GraphError, Node, TensorInfo, infer_node, run_node


def contiguous(array) -> np.ndarray:
    """A C-contiguous array of the same rank (np.ascontiguousarray turns 0-d arrays into 1-d ones)."""
    arr = np.asarray(array)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _np_dtype_name(arr: np.ndarray) -> str:
    name = str(arr.dtype)
    if name not in DTYPES:
        raise GraphError(f"constant dtype {name} is not supported; use one of {', '.join(DTYPES)}")
    return name


class Graph:
    """Inputs, constants, nodes in topological order and outputs; validated on construction."""

    def __init__(self, name: str, inputs: Mapping[str, TensorInfo], constants: Mapping[str, np.ndarray],
                 nodes: Sequence[Node], outputs: Sequence[str]):
        self.name = name
        self.inputs: dict[str, TensorInfo] = dict(inputs)
        self.constants: dict[str, np.ndarray] = dict(constants)
        self.nodes: list[Node] = list(nodes)
        self.outputs: list[str] = list(outputs)
        self.values: dict[str, TensorInfo] = {}
        self._validate()

    def _define(self, value: str, info: TensorInfo, what: str) -> None:
        if not isinstance(value, str) or not value:
            raise GraphError(f"{what}: value names must be non-empty strings, got {value!r}")
        if value in self.values:
            raise GraphError(f"{what}: value {value!r} is defined twice; every value needs a unique name")
        self.values[value] = info

    def _validate(self) -> None:
        for name, info in self.inputs.items():
            if info.dtype not in DTYPES or not all(isinstance(s, int) and s > 0 for s in info.shape):
                raise GraphError(f"input {name!r}: needs positive integer dims and a known dtype, got {info}")
            self._define(name, info, f"input {name!r}")
        for name, arr in self.constants.items():
            if not isinstance(arr, np.ndarray):
                raise GraphError(f"constant {name!r} must be a numpy array, got {type(arr).__name__}")
            if arr.ndim and min(arr.shape) == 0:
                raise GraphError(f"constant {name!r} is empty (shape {list(arr.shape)})")
            self._define(name, TensorInfo(tuple(int(s) for s in arr.shape), _np_dtype_name(arr)), f"constant {name!r}")
        names = set()
        for node in self.nodes:
            if node.name in names:
                raise GraphError(f"node name {node.name!r} is used twice")
            names.add(node.name)
            missing = [v for v in node.inputs if v not in self.values]
            if missing:
                raise GraphError(f"node {node.name!r} ({node.op}) reads {missing[0]!r}, which is not a graph "
                                 f"input, a constant or the output of an earlier node (nodes must be in "
                                 f"topological order)")
            info = infer_node(node, [self.values[v] for v in node.inputs])
            self._define(node.output, info, f"node {node.name!r}")
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        for out in self.outputs:
            if out not in self.values:
                raise GraphError(f"graph output {out!r} is not produced by any node, input or constant")
        self._producer = {n.output: n for n in self.nodes}
        self._consumers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                self._consumers.setdefault(v, []).append(n)

    # ------------------------------------------------------------------ structure

    def producer(self, value: str) -> Node | None:
        return self._producer.get(value)

    def consumers(self, value: str) -> list[Node]:
        return list(self._consumers.get(value, ()))

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"graph {self.name!r} has no node {name!r}")

    @property
    def num_params(self) -> int:
        return int(sum(a.size for a in self.constants.values()))

    def op_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"graph {self.name}: {len(self.nodes)} nodes, {self.num_params} parameters"]
        for k, v in self.inputs.items():
            lines.append(f"  input {k}: {v.dtype}{list(v.shape)}")
        for n in self.nodes:
            info = self.values[n.output]
            attrs = ", ".join(f"{k}={v}" for k, v in n.attrs.items())
            lines.append(f"  {n.output} = {n.op}({', '.join(n.inputs)}{', ' if attrs else ''}{attrs})"
                         f"  -> {info.dtype}{list(info.shape)}")
        lines.append(f"  outputs: {', '.join(self.outputs)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ data

    def index_bound(self, value: str) -> int | None:
        """The exclusive upper bound an integer input must respect (from the gathers it indexes)."""
        bounds = [self.values[n.inputs[0]].shape[n.attrs["axis"] % len(self.values[n.inputs[0]].shape)]
                  for n in self.consumers(value) if n.op == "gather" and n.inputs[1] == value]
        return min(bounds) if bounds else None

    def random_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Fresh random inputs: floats in [-1, 1), integers in [0, bound) of the table they index."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, info in self.inputs.items():
            if info.dtype.startswith("float"):
                out[name] = rng.uniform(-1.0, 1.0, size=info.shape).astype(info.dtype)
            elif info.dtype == "bool":
                out[name] = rng.integers(0, 2, size=info.shape).astype(bool)
            else:
                out[name] = rng.integers(0, self.index_bound(name) or 8, size=info.shape).astype(info.dtype)
        return out

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        missing = [k for k in self.inputs if k not in inputs]
        if missing:
            raise GraphError(f"graph {self.name!r} needs input(s) {missing}; got {sorted(inputs)}")
        for k, info in self.inputs.items():
            arr = np.asarray(inputs[k])
            if tuple(arr.shape) != info.shape:
                raise GraphError(f"input {k!r} must have shape {list(info.shape)}, got {list(arr.shape)}")

    def run_reference(self, inputs: Mapping[str, np.ndarray], keep_all: bool = False) -> dict[str, np.ndarray]:
        """Evaluate the graph in NumPy (floats in float64); returns the outputs (or every value)."""
        self.check_inputs(inputs)
        env: dict[str, np.ndarray] = {}
        for k in self.inputs:
            env[k] = _widen(np.asarray(inputs[k]))
        for k, arr in self.constants.items():
            env[k] = _widen(arr)
        for node in self.nodes:
            env[node.output] = run_node(node, [env[v] for v in node.inputs])
        if keep_all:
            return env
        return {k: env[k] for k in self.outputs}




def _widen(arr: np.ndarray) -> np.ndarray:
    return arr.astype(np.float64) if np.issubdtype(arr.dtype, np.floating) else arr


class GraphBuilder:
    """Builds a Graph node by node, inferring each output's shape as it goes (errors point at the node)."""

    def __init__(self, name: str):
        self.name = name
        self.inputs: dict[str, TensorInfo] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.nodes: list[Node] = []
        self.values: dict[str, TensorInfo] = {}
        self._counts: dict[str, int] = {}

    def _fresh(self, base: str) -> str:
        while True:
            k = self._counts.get(base, 0)
            self._counts[base] = k + 1
            name = base if k == 0 and base not in self.values else f"{base}_{k}"
            if name not in self.values:
                return name

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        if name in self.values:
            raise GraphError(f"value {name!r} is defined twice")
        self.inputs[name] = self.values[name] = TensorInfo(tuple(int(s) for s in shape), dtype)
        return name

    def constant(self, array: np.ndarray, name: str = "const") -> str:
        name = self._fresh(name)
        arr = contiguous(array)
        self.constants[name] = arr
        self.values[name] = TensorInfo(tuple(int(s) for s in arr.shape), _np_dtype_name(arr))
        return name

    def add(self, op: str, inputs: Sequence[str], name: str | None = None, **attrs) -> str:
        """Append `op(*inputs, **attrs)`; returns the name of its output value."""
        name = self._fresh(name or op)
        node = Node(name, op, tuple(inputs), name, dict(attrs))
        missing = [v for v in node.inputs if v not in self.values]
        if missing:
            raise GraphError(f"node {name!r} ({op}) reads undefined value {missing[0]!r}")
        self.values[name] = infer_node(node, [self.values[v] for v in node.inputs])
        self.nodes.append(node)
        return name

    def shape(self, value: str) -> tuple[int, ...]:
        return self.values[value].shape

    def build(self, outputs: Sequence[str]) -> Graph:
        return Graph(self.name, self.inputs, self.constants, self.nodes, outputs)
