"""Rewrite a network's NCHW convolutions and pools into NHWC, with transposes only where layouts change.

Why: an NCHW conv vectorises over the output width (at most 7 of 16 AVX-512 lanes at 7x7), an
NHWC conv over the output channels (tasks.nhwc_ops). Measured on a 256-channel 14x14 3x3 conv at
256 trials, 2 threads: NHWC 261 GFLOP/s, NCHW 228.

The pass walks the nodes in order and keeps, for every value of the source graph, the layout its
producer stores it in. Convs (dense or depthwise) and pools take NHWC inputs and make NHWC outputs
(a reduction that keeps its dims, an exporter's global pool, reduces the same axes of an NHWC input);
elementwise ops whose activation inputs are all stored NHWC stay NHWC, their constant operands
transposed once here (a per-channel constant [C, 1, 1] becomes [1, 1, C]); every other op gets its
inputs in NCHW. A value is transposed to the layout a reader needs on first need, once, and the
graph outputs are NCHW, so the rewritten graph computes the same outputs under the same names. A
transpose of a [N, C, 1, 1] value (after a global pool) only reorders unit axes: it is a reshape,
which costs nothing (a view).

Names: a value stored NHWC is `<name>.nhwc`; `<name>` is then defined only if some reader needs
it in NCHW (by the transpose back). Nodes keep their names, so `origin` maps stay valid.
"""
from __future__ import annotations

from tensortune.tasks.graph import Graph, contiguous
from tensortune.tasks.graph_ops import OPS, Node

_TO_NHWC, _TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
_POOLS = {"max_pool2d": "max_pool2d_nhwc", "avg_pool2d": "avg_pool2d_nhwc",
          "global_avg_pool2d": "global_avg_pool2d_nhwc"}
_REDUCTIONS = {"reduce_mean", "reduce_sum", "reduce_max", "reduce_min"}
_NHWC_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}        # an NCHW axis -> the same axis of the NHWC value
# elementwise ops whose operands broadcast as numpy arrays do (batch_norm's statistics follow axis 1)
_NOT_BROADCASTING = {"batch_norm"}


class _Rewriter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[Node] = []
        self.constants = dict(graph.constants)
        self.nhwc: dict[str, str] = {}            # source value -> the name of its NHWC copy
        self.nchw: set[str] = set(graph.inputs) | set(graph.constants)   # source values defined in NCHW
        self.used = set(graph.values) | {n.name for n in graph.nodes}

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name

    def _move(self, src: str, dst: str, perm: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """A transpose of `src` by `perm` into `dst`; a reshape (a view) when the axes longer than 1 keep
        their order, so the bytes do not move."""
        unit_only = [a for a in range(4) if shape[a] > 1] == [a for a in perm if shape[a] > 1]
        moved = tuple(shape[p] for p in perm)
        node = Node(self.fresh(f"{dst}.transpose"), "reshape" if unit_only else "transpose", (src,), dst,
                    {"shape": moved} if unit_only else {"perm": perm})
        self.nodes.append(node)

    def as_nhwc(self, value: str) -> str:
        """The name of `value` stored NHWC, transposed from NCHW on first need."""
        if value not in self.nhwc:
            name = self.fresh(f"{value}.nhwc")
            self._move(value, name, _TO_NHWC, self.graph.values[value].shape)
            self.nhwc[value] = name
        return self.nhwc[value]

    def as_nchw(self, value: str) -> str:
        """`value` under its own name in NCHW, transposed back from NHWC on first need."""
        if value not in self.nchw:
            shape = self.graph.values[value].shape
            self._move(self.nhwc[value], value, _TO_NCHW, (shape[0], shape[2], shape[3], shape[1]))
            self.nchw.add(value)
        return value

    def constant_nhwc(self, value: str) -> str:
        """A constant operand of an NHWC elementwise op, broadcast the same way after the transpose."""
        arr = self.constants[value]
        if arr.size == 1:
            return value
        name = self.fresh(f"{value}.nhwc")
        full = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)
        self.constants[name] = contiguous(full.transpose(_TO_NHWC))
        return name

    def stored_nhwc(self, value: str) -> bool:
        return value in self.nhwc and value not in self.nchw

    def emit(self, node: Node) -> None:
        g = self.graph
        out_shape = g.values[node.output].shape
        if node.op == "conv2d" and self._conv_converts(node):
            w = g.constants[node.inputs[1]]
            wname = self.fresh(f"{node.inputs[1]}.hwio")
            self.constants[wname] = contiguous(w.transpose(2, 3, 1, 0))
            self._nhwc_node(node, "conv2d_nhwc", (self.as_nhwc(node.inputs[0]), wname, *node.inputs[2:]))
        elif node.op in _POOLS and self.stored_nhwc(node.inputs[0]):
            self._nhwc_node(node, _POOLS[node.op], (self.nhwc[node.inputs[0]],))
        elif node.op in _REDUCTIONS and node.attrs["keepdims"] and self.stored_nhwc(node.inputs[0]):
            # an exporter's global pool (ReduceMean over H, W): the same reduction over the NHWC axes
            axes = tuple(sorted(_NHWC_AXIS[a % 4] for a in node.attrs["axes"]))
            self._nhwc_node(node, node.op, (self.nhwc[node.inputs[0]],), {**node.attrs, "axes": axes})
        elif self._elementwise_converts(node, out_shape):
            ins = tuple(self.constant_nhwc(v) if v in self.constants else self.as_nhwc(v) for v in node.inputs)
            self._nhwc_node(node, node.op, ins)
        else:
            ins = tuple(self.as_nchw(v) if v in self.nhwc else v for v in node.inputs)
            self.nodes.append(Node(node.name, node.op, ins, node.output, dict(node.attrs)))
            self.nchw.add(node.output)

    def _nhwc_node(self, node: Node, op: str, inputs: tuple[str, ...], attrs: dict | None = None) -> None:
        name = self.fresh(f"{node.output}.nhwc")
        self.nodes.append(Node(node.name, op, inputs, name, dict(node.attrs if attrs is None else attrs)))
        self.nhwc[node.output] = name

    def _conv_converts(self, node: Node) -> bool:
        """A 2-D conv with a constant weight, dense or depthwise (one filter per channel)."""
        if node.inputs[1] not in self.graph.constants:
            return False
        co, cig = self.graph.values[node.inputs[1]].shape[:2]
        channels, groups = self.graph.values[node.inputs[0]].shape[1], node.attrs["groups"]
        return groups == 1 or (groups == channels == co and cig == 1)

    def _elementwise_converts(self, node: Node, out_shape: tuple[int, ...]) -> bool:
        """Elementwise, some activation input stored NHWC, every other input a constant of rank <= 4 or
        an activation of the output's shape (one that would need no broadcasting)."""
        if OPS[node.op].kind != "elementwise" or node.op in _NOT_BROADCASTING or len(out_shape) != 4:
            return False
        if not any(self.stored_nhwc(v) for v in node.inputs):
            return False
        g = self.graph
        return all((v in self.constants and g.values[v].dtype == g.values[node.output].dtype
                    and len(g.values[v].shape) <= 4) or g.values[v].shape == out_shape for v in node.inputs)


def to_channels_last(graph: Graph) -> Graph:
    """The same network with NHWC convs and pools; the graph as given when none converts."""
    r = _Rewriter(graph)
    for node in graph.nodes:
        r.emit(node)
    if not r.nhwc:
        return graph
    outputs = [r.as_nchw(v) if v in r.nhwc else v for v in graph.outputs]
    referenced = {v for n in r.nodes for v in n.inputs} | set(outputs)
    return Graph(graph.name, graph.inputs, {k: v for k, v in r.constants.items() if k in referenced},
                 r.nodes, outputs)

