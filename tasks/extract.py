"""Task extraction: partition a network graph into fused subgraphs, one ComputeDAG per subgraph.

As TVM's relay_integration does it: first simplify for inference (fold constants, fold BatchNorm into
the convolution before it, rewrite any other BatchNorm into a scale and shift), then give every
anchor op (conv, dense, matmul, pooling, softmax, layer norm, and any data-movement or elementwise
op that no anchor absorbed) its own subgraph together with the chain of elementwise ops that follow
it while each value in the chain has that op as its only consumer. Reshapes are views: they belong
to no subgraph. Subgraphs with the same workload key are one task whose weight is their count.

The result keeps, for every subgraph, which graph values feed its DAG's inputs and which value it
produces, so the runtime can execute the network from per-task kernels.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from tensortune.tasks import network_ops, nhwc_ops, ops, te, winograd
from tensortune.tasks.channels_last import to_channels_last
from tensortune.tasks.compute_dag import ComputeDAG, DAGError
from tensortune.tasks.graph import Graph, contiguous
from tensortune.tasks.graph_ops import OPS, Node, TensorInfo, run_node
from tensortune.tasks.te import Tensor


class ExtractError(ValueError):
    """A graph node that cannot become part of a task; the message names the node and the reason."""


# ---------------------------------------------------------------------------------- simplification

def _fresh_name(used: set[str], base: str) -> str:
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def simplify_for_inference(graph: Graph, origin: dict[str, str | None] | None = None) -> Graph:
    """Fold constant subgraphs and BatchNorm; the result computes the same outputs with fewer nodes.

    `origin`, when given, is filled with each source node's node in the result (None: folded away)."""
    origin = {} if origin is None else origin
    consts = dict(graph.constants)
    used = set(graph.values) | {n.name for n in graph.nodes}
    nodes: list[Node] = []
    made_by: dict[str, int] = {}          # value -> index in `nodes`
    for node in graph.nodes:
        if all(v in consts for v in node.inputs):
            value = run_node(node, [np.asarray(consts[v], np.float64) if consts[v].dtype.kind == "f" else consts[v]
                                    for v in node.inputs])
            consts[node.output] = contiguous(value.astype(graph.values[node.output].dtype))
            origin[node.name] = None
            continue
        if node.op == "batch_norm" and all(v in consts for v in node.inputs[1:]):
            gamma, beta, mean, var = (consts[v].astype(np.float64) for v in node.inputs[1:])
            scale = gamma / np.sqrt(var + node.attrs["epsilon"])
            shift = beta - mean * scale
            prev_i = made_by.get(node.inputs[0], -1)
            prev = nodes[prev_i] if prev_i >= 0 else None
            if (prev is not None and prev.op in ("conv2d", "conv_transpose2d")
                    and all(v in consts for v in prev.inputs[1:]) and len(graph.consumers(prev.output)) == 1
                    and prev.output not in graph.outputs):
                w = consts[prev.inputs[1]].astype(np.float64)
                axis = 0 if prev.op == "conv2d" else 1
                shape = [1] * w.ndim
                shape[axis] = -1
                bias = consts[prev.inputs[2]].astype(np.float64) if len(prev.inputs) == 3 else 0.0
                dtype = graph.values[prev.output].dtype
                wname = _fresh_name(used, f"{prev.name}.folded_weight")
                bname = _fresh_name(used, f"{prev.name}.folded_bias")
                consts[wname] = (w * scale.reshape(shape)).astype(dtype)
                consts[bname] = (bias * scale + shift).astype(dtype)
                nodes[prev_i] = Node(prev.name, prev.op, (prev.inputs[0], wname, bname), node.output, dict(prev.attrs))
                del made_by[prev.output]
                made_by[node.output] = prev_i
                origin[node.name] = prev.name
                continue
            rank = len(graph.values[node.inputs[0]].shape)
            dtype = graph.values[node.output].dtype
            bshape = (-1,) + (1,) * (rank - 2)
            sname = _fresh_name(used, f"{node.name}.scale")
            tname = _fresh_name(used, f"{node.name}.shift")
            consts[sname] = scale.reshape(bshape).astype(dtype)
            consts[tname] = shift.reshape(bshape).astype(dtype)
            scaled = _fresh_name(used, f"{node.name}.scaled")
            nodes.append(Node(_fresh_name(used, f"{node.name}.mul"), "mul", (node.inputs[0], sname), scaled))
            nodes.append(Node(_fresh_name(used, f"{node.name}.add"), "add", (scaled, tname), node.output))
            made_by[scaled], made_by[node.output] = len(nodes) - 2, len(nodes) - 1
            origin[node.name] = nodes[-1].name
            continue
        nodes.append(Node(node.name, node.op, node.inputs, node.output, dict(node.attrs)))
        made_by[node.output] = len(nodes) - 1
        origin[node.name] = node.name
    nodes = _recognise_gelu(nodes, consts, set(graph.outputs), origin)
    referenced = {v for n in nodes for v in n.inputs} | set(graph.outputs)
    return Graph(graph.name, graph.inputs, {k: v for k, v in consts.items() if k in referenced}, nodes,
                 graph.outputs)


def _recognise_gelu(nodes: list[Node], consts: dict[str, np.ndarray], outputs: set[str],
                    origin: dict[str, str | None]) -> list[Node]:
    """Rewrite x * (erf(x / sqrt 2) + 1) * 0.5, the form exporters emit before ONNX had Gelu, into one
    gelu node, so it fuses into the matmul before it as the built-in BERT's does."""
    made = {n.output: n for n in nodes}
    readers: dict[str, list[Node]] = {}
    for n in nodes:
        for v in dict.fromkeys(n.inputs):
            readers.setdefault(v, []).append(n)

    def scalar(v: str) -> float | None:
        arr = consts.get(v)
        return float(arr.reshape(())) if arr is not None and arr.size == 1 and arr.dtype.kind == "f" else None

    def only_reader(n: Node, op: str) -> Node | None:
        r = readers.get(n.output, [])
        return r[0] if len(r) == 1 and r[0].op == op and n.output not in outputs else None

    def other(n: Node, v: str) -> str | None:
        rest = [i for i in n.inputs if i != v]
        return rest[0] if len(n.inputs) == 2 and len(rest) == 1 else None

    replaced: dict[str, Node] = {}
    dropped: set[str] = set()
    dropped_into: dict[str, str] = {}
    for erf in (n for n in nodes if n.op == "erf"):
        scale = made.get(erf.inputs[0])
        if scale is None or scale.op not in ("div", "mul") or len(readers.get(scale.output, [])) != 1:
            continue
        c = scalar(scale.inputs[1])
        if c is None or not np.isclose(c if scale.op == "div" else 1.0 / c, np.sqrt(2.0), rtol=1e-4):
            continue
        x = scale.inputs[0]
        plus = only_reader(erf, "add")
        if plus is None or scalar(other(plus, erf.output) or "") != 1.0:
            continue
        times = only_reader(plus, "mul")
        if times is None or other(times, plus.output) != x:
            continue
        half = only_reader(times, "mul")
        if half is None or scalar(other(half, times.output) or "") != 0.5 or scale.output in outputs:
            continue
        replaced[half.name] = Node(half.name, "gelu", (x,), half.output)
        for n in (scale, erf, plus, times):
            dropped.add(n.name)
            dropped_into[n.name] = half.name
    if not replaced:
        return nodes
    for src, dst in origin.items():
        if dst in dropped:
            origin[src] = dropped_into[dst]
    return [replaced.get(n.name, n) for n in nodes if n.name not in dropped]


# ---------------------------------------------------------------------------------- partition

def _kind(node: Node) -> str:
    return OPS[node.op].kind


def partition(graph: Graph) -> tuple[list[list[Node]], dict[str, str]]:
    """Fused groups (anchor first, then its elementwise chain) and the views made by layout ops."""
    aliases: dict[str, str] = {}
    absorbed: set[str] = set()
    groups: list[list[Node]] = []
    outputs = set(graph.outputs)
    for node in graph.nodes:
        if node.name in absorbed:
            continue
        if _kind(node) == "layout":
            aliases[node.output] = aliases.get(node.inputs[0], node.inputs[0])
            continue
        group, cur = [node], node
        while cur.output not in outputs:
            readers = graph.consumers(cur.output)
            if len(readers) != 1:
                break
            nxt = readers[0]
            here, there = graph.values[cur.output], graph.values[nxt.output]
            if _kind(nxt) != "elementwise" or nxt.name in absorbed or here != there:
                break
            group.append(nxt)
            absorbed.add(nxt.name)
            cur = nxt
        groups.append(group)
    return groups, aliases


def _execution_order(graph: Graph, groups: list[list[Node]], aliases: dict[str, str]) -> list[int]:
    """Groups in an order where each runs after the groups producing its inputs (node order breaks ties)."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    made_by = {g[-1].output: gi for gi, g in enumerate(groups)}
    deps: list[set[int]] = []
    for g in groups:
        inside = {n.output for n in g}
        deps.append({made_by[aliases.get(v, v)] for n in g for v in n.inputs
                     if v not in inside and aliases.get(v, v) in made_by})
    users: dict[int, list[int]] = {}
    for gi, d in enumerate(deps):
        for p in d:
            users.setdefault(p, []).append(gi)
    waiting = [len(d) for d in deps]
    ready = [(position[g[0].name], gi) for gi, g in enumerate(groups) if not deps[gi]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, gi = heapq.heappop(ready)
        order.append(gi)
        for u in users.get(gi, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (position[groups[u][0].name], u))
    if len(order) != len(groups):
        raise ExtractError("fused groups depend on each other in a cycle; the graph is not a DAG")
    return order


# ---------------------------------------------------------------------------------- TE builders

class _GroupBuilder:
    """Turns one fused group into tensors: external values become placeholders (in first-use order),
    single-element float constants read by elementwise ops become literals."""

    def __init__(self, graph: Graph, nodes: list[Node],
                 overrides: Mapping[str, Callable[[Node, "_GroupBuilder"], Tensor]] | None = None, name: str = ""):
        self.graph, self.nodes = graph, nodes
        self.overrides, self.name = dict(overrides or {}), name      # node name -> builder (another form)
        self.env: dict[str, Tensor] = {}
        self.placeholders: dict[str, Tensor] = {}
        self.roles: dict[str, str] = {}          # graph value -> the role it was read in first
        self.node: Node | None = None

    @property
    def current(self) -> Node:
        """The node being built: the accessors below read its inputs (build() sets it for each node)."""
        assert self.node is not None, "a node's inputs are read outside build()"
        return self.node

    def info(self, i: int) -> TensorInfo:
        return self.graph.values[self.current.inputs[i]]

    def has(self, i: int) -> bool:
        return i < len(self.current.inputs)

    def scalar(self, i: int) -> float | None:
        v = self.current.inputs[i]
        arr = self.graph.constants.get(v)
        if arr is None or arr.size != 1 or arr.dtype.kind != "f" or v in self.env:
            return None
        return float(arr.reshape(()))

    def input(self, i: int, role: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """Input i of the current node; `shape` re-views an external input (same element count)."""
        v = self.current.inputs[i]
        if v in self.env:
            return self.env[v]
        info = self.graph.values[v]
        shape = tuple(shape or info.shape)
        if int(np.prod(shape)) != info.size:
            raise ExtractError(f"cannot view {v!r} {list(info.shape)} as {list(shape)}")
        if v in self.placeholders:
            if self.placeholders[v].shape != shape:
                raise ExtractError(f"value {v!r} is read with two different shapes in one task")
            return self.placeholders[v]
        t = te.placeholder(shape, info.dtype, role)
        self.placeholders[v] = t
        self.roles[v] = role
        return t

    def build(self) -> tuple[ComputeDAG, list[str]]:
        for node in self.nodes:
            self.node = node
            try:
                out = self.overrides[node.name](node, self) if node.name in self.overrides \
                    else TE_BUILDERS[node.op](node, self)
            except KeyError:
                raise ExtractError(f"node {node.name!r}: op {node.op!r} has no tensor-expression builder; "
                                   f"known: {', '.join(sorted(TE_BUILDERS))}") from None
            except (ValueError, TypeError, DAGError) as err:
                if isinstance(err, ExtractError) and str(err).startswith("node "):
                    raise
                raise ExtractError(f"node {node.name!r} ({node.op}): {err}") from None
            want = self.graph.values[node.output]
            if out.shape != want.shape or out.dtype != want.dtype:
                raise ExtractError(f"node {node.name!r} ({node.op}): builder made {out.dtype}{list(out.shape)}, "
                                   f"the graph says {want.dtype}{list(want.shape)}")
            self.env[node.output] = out
        names = list(self.placeholders)
        dag = ComputeDAG(list(self.placeholders.values()) + [self.env[self.nodes[-1].output]],
                         name=self.name or group_name(self.graph, self.nodes))
        return dag, names


def group_name(graph: Graph, nodes: list[Node]) -> str:
    """A readable task name from its ops, e.g. conv2d_bias_add_relu or depthwise_conv2d_bias_clip."""
    parts = []
    for n in nodes:
        op = n.op
        if op in ("conv2d", "conv2d_nhwc") and n.attrs["groups"] > 1:
            channels = graph.values[n.inputs[0]].shape[1 if op == "conv2d" else 3]
            op = ("depthwise_" if n.attrs["groups"] == channels else "group_") + op
        if n.op in ("conv2d", "conv2d_nhwc", "conv_transpose2d", "dense") and len(n.inputs) == 3:
            op += "_bias"
        parts.append(op)
    return "_".join(parts)


def _fail(node: Node, msg: str) -> ExtractError:
    return ExtractError(f"node {node.name!r} ({node.op}): {msg}")


def _conv2d(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    xi, wi = b.info(0), b.info(1)
    c, (co, cig, kh, kw) = xi.shape[1], wi.shape
    pt, pl, pb, pr = a["pads"]
    x = b.input(0, "data")
    if (pt, pl) != (pb, pr):
        x = ops.pad(x, (0, 0, pt, pl), (0, 0, pb, pr))
        padding = (0, 0)
    else:
        padding = (pt, pl)
    g = a["groups"]
    if g > 1 and g == c and cig == 1:
        out = ops.depthwise_conv2d_nchw(x, b.input(1, "kernel", (c, co // c, kh, kw)), a["strides"], padding,
                                        a["dilations"])
    else:
        out = ops.conv2d_nchw(x, b.input(1, "kernel"), a["strides"], padding, a["dilations"], g)
    return ops.bias_add(out, b.input(2, "bias"), axis=1) if b.has(2) else out


def _conv2d_nhwc(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    c, (kh, kw, cig, co) = b.info(0).shape[3], b.info(1).shape
    x = b.input(0, "data")
    if a["groups"] == 1:
        out = nhwc_ops.conv2d(x, b.input(1, "kernel"), a["strides"], a["pads"], a["dilations"])
    elif a["groups"] == c == co and cig == 1:
        out = nhwc_ops.depthwise_conv2d(x, b.input(1, "kernel", (kh, kw, c)), a["strides"], a["pads"],
                                        a["dilations"])
    else:
        raise _fail(node, f"groups={a['groups']}: an NHWC conv is dense or depthwise (one filter per channel)")
    return ops.bias_add(out, b.input(2, "bias"), axis=3) if b.has(2) else out


def _pool_nhwc(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    kind = "max" if node.op == "max_pool2d_nhwc" else "avg"
    return nhwc_ops.pool2d(b.input(0, "data"), a["kernel"], a["strides"], a["pads"], kind,
                           kind == "max" or a["count_include_pad"])


def _conv_transpose2d(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    pt, pl, pb, pr = a["pads"]
    if (pt, pl) != (pb, pr):
        raise _fail(node, f"asymmetric pads {list(a['pads'])} are not supported for conv_transpose2d; "
                          f"use equal begin and end padding")
    if a["dilations"] != (1, 1):
        raise _fail(node, f"dilations {list(a['dilations'])} are not supported for conv_transpose2d")
    out = ops.conv2d_transpose_nchw(b.input(0, "data"), b.input(1, "kernel"), a["strides"], (pt, pl),
                                    a["output_padding"])
    return ops.bias_add(out, b.input(2, "bias"), axis=1) if b.has(2) else out


def _dense(node: Node, b: _GroupBuilder) -> Tensor:
    out = ops.dense(b.input(0, "data"), b.input(1, "weight"))
    return ops.bias_add(out, b.input(2, "bias"), axis=1) if b.has(2) else out


def _matmul(node: Node, b: _GroupBuilder) -> Tensor:
    ai, bi = b.info(0), b.info(1)
    x, y = b.input(0, "A"), b.input(1, "B")
    if len(ai.shape) == 2 and len(bi.shape) == 2:
        return ops.matmul(x, y, name="T_matmul")
    if len(ai.shape) == 3 and len(bi.shape) == 3 and bi.shape[0] in (1, ai.shape[0]):
        return ops.batch_matmul(x, y)
    return network_ops.matmul_nd(x, y)


def _pool(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    kind = "max" if node.op == "max_pool2d" else "avg"
    pt, pl, pb, pr = a["pads"]
    include = kind == "max" or a.get("count_include_pad", True) or not any(a["pads"])
    if (pt, pl) == (pb, pr) and include:
        return ops.pool2d_nchw(b.input(0, "data"), a["kernel"], a["strides"], (pt, pl), kind)
    return network_ops.pool2d_nchw(b.input(0, "data"), a["kernel"], a["strides"], a["pads"], kind,
                                   a.get("count_include_pad", True))


def _over_last_axis(fn: Callable[[Tensor], Tensor]) -> Callable[[Node, _GroupBuilder], Tensor]:
    """softmax / log_softmax: the importer moves the axis last (a transpose), the kernel reduces over it."""
    def build(node: Node, b: _GroupBuilder) -> Tensor:
        rank = len(b.info(0).shape)
        if node.attrs["axis"] % rank != rank - 1:
            raise _fail(node, f"{node.op} over axis {node.attrs['axis']} of a rank-{rank} tensor is not "
                              f"supported; only the last axis (transpose first)")
        return fn(b.input(0, "data"))
    return build


def _layer_norm(node: Node, b: _GroupBuilder) -> Tensor:
    rank = len(b.info(0).shape)
    if node.attrs["axis"] % rank != rank - 1:
        raise _fail(node, f"layer_norm over axes {node.attrs['axis']}.. of a rank-{rank} tensor is not supported; "
                          f"only the last axis")
    return ops.layer_norm(b.input(0, "data"), b.input(1, "gamma"), b.input(2, "beta"), node.attrs["epsilon"])


_BINARY_FN: dict[str, Callable] = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
    "pow": te.power, "maximum": te.maximum, "minimum": te.minimum,
    "prelu": lambda x, slope: te.if_then_else(x >= 0.0, x, x * slope),
}


def _binary(node: Node, b: _GroupBuilder) -> Tensor:
    lhs = b.scalar(0) if node.inputs[0] not in b.env else None
    rhs = b.scalar(1) if node.inputs[1] not in b.env else None
    if lhs is not None and rhs is not None:
        raise _fail(node, "both operands are constants; fold the graph first (simplify_for_inference)")
    x = lhs if lhs is not None else b.input(0, "lhs")
    y = rhs if rhs is not None else b.input(1, "rhs")
    return network_ops.broadcast_binary(x, y, _BINARY_FN[node.op], f"T_{node.op}")


_UNARY_FN: dict[str, Callable] = {
    "sigmoid": te.sigmoid, "tanh": te.tanh, "exp": te.exp, "log": te.log, "sqrt": te.sqrt, "erf": te.erf,
    "abs": te.abs, "neg": lambda v: -v,
}


def _unary(node: Node, b: _GroupBuilder) -> Tensor:
    x = b.input(0, "data")
    if node.op == "relu":
        return ops.relu(x)
    if node.op == "gelu":
        return ops.gelu(x)
    fn = _UNARY_FN[node.op]
    return te.compute(x.shape, lambda *i: fn(x[i]), name=f"T_{node.op}")


_COMPARE_FN: dict[str, Callable] = {
    "equal": lambda x, y: te.compare("eq", x, y), "less": lambda x, y: te.compare("lt", x, y),
    "greater": lambda x, y: te.compare("gt", x, y), "less_equal": lambda x, y: te.compare("le", x, y),
    "greater_equal": lambda x, y: te.compare("ge", x, y), "logical_and": lambda x, y: te.compare("and", x, y),
    "logical_or": lambda x, y: te.compare("or", x, y), "logical_xor": lambda x, y: te.compare("ne", x, y),
}


def _compare(node: Node, b: _GroupBuilder) -> Tensor:
    return network_ops.broadcast_binary(b.input(0, "lhs"), b.input(1, "rhs"), _COMPARE_FN[node.op], f"T_{node.op}")


def _elu_part(v, alpha: float):
    return te.if_then_else(v > 0.0, v, alpha * (te.exp(te.minimum(v, 0.0)) - 1.0))


# the TE form of graph_ops.ACTIVATIONS: name -> fn(value, attrs)
_ACTIVATION_FN: dict[str, Callable] = {
    "leaky_relu": lambda v, a: te.if_then_else(v >= 0.0, v, a["alpha"] * v),
    "elu": lambda v, a: _elu_part(v, a["alpha"]),
    "selu": lambda v, a: a["gamma"] * _elu_part(v, a["alpha"]),
    "softplus": lambda v, a: te.maximum(v, 0.0) + te.log(1.0 + te.exp(-te.abs(v))),
    "hard_sigmoid": lambda v, a: te.minimum(te.maximum(a["alpha"] * v + a["beta"], 0.0), 1.0),
    "hard_swish": lambda v, a: v * te.minimum(te.maximum(v / 6.0 + 0.5, 0.0), 1.0),
    "reciprocal": lambda v, a: 1.0 / v,
    "softsign": lambda v, a: v / (1.0 + te.abs(v)),
    "swish": lambda v, a: v * te.sigmoid(a["alpha"] * v),
    "thresholded_relu": lambda v, a: te.if_then_else(v > a["alpha"], v, 0.0),
    "shrink": lambda v, a: te.if_then_else(v < -a["lambd"], v + a["bias"],
                                           te.if_then_else(v > a["lambd"], v - a["bias"], 0.0)),
    "sign": lambda v, a: te.if_then_else(v > 0.0, te.const(1.0, v.dtype),
                                         te.if_then_else(v < 0.0, te.const(-1.0, v.dtype), 0.0)),
    "floor": lambda v, a: te.floor(v),
    "ceil": lambda v, a: te.ceil(v),
    "gelu_tanh": lambda v, a: 0.5 * v * (1.0 + te.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))),
}


def _activation(node: Node, b: _GroupBuilder) -> Tensor:
    x, fn = b.input(0, "data"), _ACTIVATION_FN[node.op]
    return te.compute(x.shape, lambda *i: fn(x[i], node.attrs), name=f"T_{node.op}")


def _pad(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    if a["mode"] == "constant":
        return ops.pad(b.input(0, "data"), a["before"], a["after"], a["value"])
    return network_ops.pad_mode(b.input(0, "data"), a["before"], a["after"], a["mode"])


def _with_bias(node: Node, b: _GroupBuilder, out: Tensor) -> Tensor:
    return ops.bias_add(out, b.input(2, "bias"), axis=1) if b.has(2) else out


def _clip(node: Node, b: _GroupBuilder) -> Tensor:
    x, lo, hi = b.input(0, "data"), node.attrs["min"], node.attrs["max"]
    if (lo, hi) == (0.0, 6.0):
        return ops.relu6(x)

    def f(*i):
        v = x[i]
        if lo is not None:
            v = te.maximum(v, te.const(lo, x.dtype))
        if hi is not None:
            v = te.minimum(v, te.const(hi, x.dtype))
        return v
    return te.compute(x.shape, f, name="T_clip")


def _batch_norm(node: Node, b: _GroupBuilder) -> Tensor:
    x, gamma, beta, mean, var = (b.input(i, r) for i, r in enumerate(("data", "gamma", "beta", "mean", "var")))
    return network_ops.batch_norm_inference(x, gamma, beta, mean, var, eps=node.attrs["epsilon"])


def _slice(node: Node, b: _GroupBuilder) -> Tensor:
    a = node.attrs
    return network_ops.strided_slice(b.input(0, "data"), a["begin"], a["step"], b.graph.values[node.output].shape)


TE_BUILDERS: dict[str, Callable[[Node, _GroupBuilder], Tensor]] = {
    "conv2d": _conv2d, "conv_transpose2d": _conv_transpose2d, "dense": _dense, "matmul": _matmul,
    "max_pool2d": _pool, "avg_pool2d": _pool,
    "conv2d_nhwc": _conv2d_nhwc, "max_pool2d_nhwc": _pool_nhwc, "avg_pool2d_nhwc": _pool_nhwc,
    "global_avg_pool2d_nhwc": lambda n, b: nhwc_ops.global_avg_pool2d(b.input(0, "data")),
    "global_avg_pool2d": lambda n, b: ops.global_avg_pool2d_nchw(b.input(0, "data")),
    "softmax": _over_last_axis(ops.softmax), "layer_norm": _layer_norm,
    "log_softmax": _over_last_axis(network_ops.log_softmax), "pad": _pad,
    "conv3d": lambda n, b: _with_bias(n, b, network_ops.conv3d_ncdhw(
        b.input(0, "data"), b.input(1, "kernel"), n.attrs["strides"], n.attrs["pads"], n.attrs["dilations"],
        n.attrs["groups"])),
    "max_pool3d": lambda n, b: network_ops.pool3d_ncdhw(b.input(0, "data"), n.attrs["kernel"], n.attrs["strides"],
                                                        n.attrs["pads"], "max"),
    "avg_pool3d": lambda n, b: network_ops.pool3d_ncdhw(b.input(0, "data"), n.attrs["kernel"], n.attrs["strides"],
                                                        n.attrs["pads"], "avg", n.attrs["count_include_pad"]),
    "lrn": lambda n, b: network_ops.lrn(b.input(0, "data"), n.attrs["size"], n.attrs["alpha"], n.attrs["beta"],
                                        n.attrs["bias"]),
    "tile": lambda n, b: network_ops.tile(b.input(0, "data"), n.attrs["repeats"]),
    **{op: _activation for op in _ACTIVATION_FN},
    **{op: _compare for op in _COMPARE_FN},
    "logical_not": lambda n, b: (lambda x: te.compute(x.shape, lambda *i: te.compare("eq", x[i], False),
                                                      name="T_logical_not"))(b.input(0, "data")),
    "where": lambda n, b: network_ops.where(b.input(0, "cond"), b.input(1, "lhs"), b.input(2, "rhs")),
    "reduce_mean": lambda n, b: network_ops.reduce(b.input(0, "data"), n.attrs["axes"], n.attrs["keepdims"], "mean"),
    "reduce_sum": lambda n, b: network_ops.reduce(b.input(0, "data"), n.attrs["axes"], n.attrs["keepdims"], "sum"),
    "reduce_max": lambda n, b: network_ops.reduce(b.input(0, "data"), n.attrs["axes"], n.attrs["keepdims"], "max"),
    "reduce_min": lambda n, b: network_ops.reduce(b.input(0, "data"), n.attrs["axes"], n.attrs["keepdims"], "min"),
    "broadcast_to": lambda n, b: network_ops.broadcast_to(b.input(0, "data"), n.attrs["shape"]),
    "batch_norm": _batch_norm, "clip": _clip,
    "transpose": lambda n, b: network_ops.transpose(b.input(0, "data"), n.attrs["perm"]),
    "slice": _slice,
    "gather": lambda n, b: network_ops.gather(b.input(0, "data"), b.input(1, "indices"), n.attrs["axis"]),
    "concat": lambda n, b: network_ops.concat([b.input(i, f"data{i}") for i in range(len(n.inputs))],
                                              n.attrs["axis"]),
    **{op: _binary for op in _BINARY_FN},
    **{op: _unary for op in list(_UNARY_FN) + ["relu", "gelu"]},
}


# ---------------------------------------------------------------------------------- Winograd forms

@dataclass
class _Forms:
    """Alternative forms found by extraction: the constants they add and, per group index, the
    (nodes, builder overrides, DAG name) to build each alternative from."""
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    per_group: dict[int, list[tuple[list[Node], dict[str, Callable], str]]] = field(default_factory=dict)


def winograd_eligible(graph: Graph, node: Node) -> bool:
    """A conv2d Winograd can compute: constant float32 weight, 3x3, stride 1, dilation 1, groups 1."""
    if node.op not in ("conv2d", "conv2d_nhwc") or node.inputs[1] not in graph.constants:
        return False
    w = graph.constants[node.inputs[1]]
    oihw = w.shape if node.op == "conv2d" else tuple(w.shape[p] for p in (3, 2, 0, 1))
    return w.dtype == np.float32 and winograd.eligible(oihw, node.attrs["strides"], node.attrs["dilations"],
                                                       node.attrs["groups"])


def _winograd_forms(graph: Graph, groups: list[list[Node]], tiles: tuple[int, ...]) -> _Forms:
    forms = _Forms()
    used = set(graph.values) | {n.name for n in graph.nodes}
    for gi, nodes in enumerate(groups):
        anchor = nodes[0]
        if not tiles or not winograd_eligible(graph, anchor):
            continue
        for m in tiles:
            u_name = _fresh_name(used, f"{anchor.inputs[1]}.winograd_f{m}")
            transform = winograd.transform_weight if anchor.op == "conv2d" else winograd.transform_weight_hwio
            forms.constants[u_name] = transform(graph.constants[anchor.inputs[1]], m)
            alt = Node(anchor.name, anchor.op, (anchor.inputs[0], u_name, *anchor.inputs[2:]), anchor.output,
                       dict(anchor.attrs))
            name = group_name(graph, nodes).replace("conv2d", f"conv2d_winograd_f{m}", 1)    # ..._nhwc stays
            forms.per_group.setdefault(gi, []).append(([alt, *nodes[1:]], {anchor.name: _conv2d_winograd}, name))
    return forms


def _conv2d_winograd(node: Node, b: _GroupBuilder) -> Tensor:
    """The conv of `node` in Winograd form; its input 1 is the transformed weight U."""
    if node.op == "conv2d_nhwc":
        out = winograd.conv2d_winograd_nhwc(b.input(0, "data"), b.input(1, "U"), node.attrs["pads"])
        return ops.bias_add(out, b.input(2, "bias"), axis=3) if b.has(2) else out
    pt, pl, pb, pr = node.attrs["pads"]
    x = b.input(0, "data")
    if (pt, pl) != (pb, pr):
        x = ops.pad(x, (0, 0, pt, pl), (0, 0, pb, pr))
        pt = pl = 0
    out = winograd.conv2d_winograd_nchw(x, b.input(1, "U"), (pt, pl))
    return ops.bias_add(out, b.input(2, "bias"), axis=1) if b.has(2) else out


# ---------------------------------------------------------------------------------- the result

@dataclass
class ExtractedTask:
    """One unique tuning task: its DAG (from its first occurrence) and how often the network runs it."""
    name: str
    dag: ComputeDAG
    weight: int = 1
    # DAG inputs that are constant weights in every occurrence (layout rewrite may store them in the
    # order the tuned kernel reads them; see WEIGHT_ROLES)
    layout_free: tuple[str, ...] = ()

    @property
    def workload_key(self) -> str:
        return self.dag.workload_key

    @property
    def flops(self) -> float:
        return self.dag.flop_ct


@dataclass(frozen=True)
class Alternative:
    """Another form of a fused group (Winograd of a conv): its task and the values bound to that task's
    inputs (a transformed weight is a constant of its own, made at extraction)."""
    task: int
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class FusedGroup:
    """One occurrence of a task in the network: graph values bound to the DAG's inputs and output.
    `task`/`inputs` are the direct form; `alternatives` compute the same output another way and the
    network build runs the fastest form (NetworkTasks.resolve_forms)."""
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str
    task: int
    alternatives: tuple[Alternative, ...] = ()


@dataclass
class NetworkTasks:
    source: Graph                          # the graph as given (the reference runs it)
    graph: Graph                           # simplified for inference (the groups refer to it)
    tasks: list[ExtractedTask]
    groups: list[FusedGroup]               # in execution order
    aliases: dict[str, str] = field(default_factory=dict)   # view value -> value that owns the storage
    # every node of the source graph -> index into `groups`; None for reshapes (views) and nodes folded
    # into constants at compile time. A BatchNorm folded into a conv maps to the conv's group.
    node_group: dict[str, int | None] = field(default_factory=dict)

    def task_of(self, node_name: str) -> ExtractedTask | None:
        if node_name not in self.node_group:
            raise KeyError(f"graph {self.source.name!r} has no node {node_name!r}")
        gi = self.node_group[node_name]
        return None if gi is None else self.tasks[self.groups[gi].task]

    @property
    def total_flops(self) -> float:
        return sum(t.weight * t.flops for t in self.tasks)

    def storage(self, value: str) -> str:
        """The value whose storage `value` uses: a view's is that of the value it views."""
        return self.aliases.get(value, value)

    def form_sets(self) -> list[tuple[int, ...]]:
        """Task indices that are forms of one group (direct first), for every task with alternatives:
        the network runs one of each set, so its latency term is their minimum."""
        sets: dict[int, tuple[int, ...]] = {}
        for g in self.groups:
            if g.alternatives:
                sets.setdefault(g.task, (g.task, *(a.task for a in g.alternatives)))
        return list(sets.values())

    def resolve_forms(self, records: Mapping[str, object], costs: Mapping[str, float]) -> "NetworkTasks":
        """The network with one form per group: of the forms that have a record (in `records`) and a
        cost (seconds, in `costs`, both by workload key), the fastest; where none has, the direct
        form. The result has no alternatives and only the tasks some group runs (re-indexed)."""
        def known(t: int) -> float | None:
            key = self.tasks[t].workload_key
            return float(costs[key]) if records.get(key) and key in costs else None

        sets = self.form_sets()
        if not sets:
            return self
        chosen: dict[int, int] = {}
        for forms in sets:
            timed = [(c, i) for i, t in enumerate(forms) if (c := known(t)) is not None]
            chosen[forms[0]] = forms[min(timed)[1]] if timed else forms[0]
        used: dict[int, int] = {}
        groups = []
        for g in self.groups:
            pick = chosen.get(g.task, g.task)
            inputs = g.inputs if pick == g.task else next(a.inputs for a in g.alternatives if a.task == pick)
            groups.append(FusedGroup(g.nodes, inputs, g.output, used.setdefault(pick, len(used))))
        tasks = [ExtractedTask(self.tasks[t].name, self.tasks[t].dag, 0, layout_free=self.tasks[t].layout_free)
                 for t in used]
        for g in groups:
            tasks[g.task].weight += 1
        return NetworkTasks(self.source, self.graph, tasks, groups, dict(self.aliases), dict(self.node_group))

    def table(self) -> list[dict]:
        """One row per task: index, name, weight, output shape, FLOPs per call and weighted, key."""
        return [{"index": i, "name": t.name, "weight": t.weight, "output": list(t.dag.outputs[0].shape),
                 "flops": t.flops, "weighted_flops": t.flops * t.weight, "workload_key": t.workload_key}
                for i, t in enumerate(self.tasks)]


# The roles of the inputs an anchor reads as its weights (conv and transposed-conv kernels, dense
# weights, a matmul's right operand): when such an input is a constant of the graph, its layout is free.
WEIGHT_ROLES = ("kernel", "weight", "B")


def _layout_free(graph: Graph, builder: _GroupBuilder, inputs: list[str]) -> set[int]:
    """The positions of this occurrence's DAG inputs that are constant weights."""
    return {i for i, v in enumerate(inputs) if v in graph.constants and builder.roles.get(v) in WEIGHT_ROLES}


def extract_tasks(graph: Graph, winograd_tiles: Sequence[int] = (), channels_last: bool = True) -> NetworkTasks:
    """Simplify, rewrite convs and pools to NHWC (tasks.channels_last), partition, build each group's
    ComputeDAG and dedup them by workload key.

    `winograd_tiles` (e.g. (4,) or (2, 4)): every conv that can take the Winograd form F(m x m, 3 x 3)
    (constant weight, 3x3, stride 1, dilation 1, groups 1) gets it as an alternative of its group,
    one task per tile size, its weight transformed here into a new constant (in the conv's layout).
    `channels_last=False` keeps every conv and pool NCHW, as the source graph has them."""
    origin: dict[str, str | None] = {}
    simple = simplify_for_inference(graph, origin)
    if channels_last:
        simple = to_channels_last(simple)
    groups, aliases = partition(simple)
    forms = _winograd_forms(simple, groups, tuple(winograd_tiles))
    if forms.constants:
        simple = Graph(simple.name, simple.inputs, {**simple.constants, **forms.constants}, simple.nodes,
                       simple.outputs)
    tasks: list[ExtractedTask] = []
    by_key: dict[str, int] = {}
    built: list[FusedGroup] = []

    def add(dag: ComputeDAG, builder: _GroupBuilder, inputs: list[str]) -> int:
        key = dag.workload_key
        free = _layout_free(simple, builder, inputs)
        if key in by_key:
            t = tasks[by_key[key]]
            t.weight += 1
            t.layout_free = tuple(t.dag.inputs[i].name for i in sorted(free)
                                  if t.dag.inputs[i].name in t.layout_free)
        else:
            by_key[key] = len(tasks)
            tasks.append(ExtractedTask(dag.name, dag, layout_free=tuple(dag.inputs[i].name for i in sorted(free))))
        return by_key[key]

    for gi, nodes in enumerate(groups):
        builder = _GroupBuilder(simple, nodes)
        dag, inputs = builder.build()
        task = add(dag, builder, inputs)
        alternatives = []
        for alt_nodes, override, name in forms.per_group.get(gi, ()):
            alt_builder = _GroupBuilder(simple, alt_nodes, override, name)
            alt_dag, alt_inputs = alt_builder.build()
            alternatives.append(Alternative(add(alt_dag, alt_builder, alt_inputs), tuple(alt_inputs)))
        built.append(FusedGroup(tuple(n.name for n in nodes), tuple(inputs), nodes[-1].output, task,
                                tuple(alternatives)))
    order = _execution_order(simple, groups, aliases)
    ordered = [built[i] for i in order]
    group_of: dict[str, int] = {name: gi for gi, g in enumerate(ordered) for name in g.nodes}
    node_group = {src: None if dst is None else group_of.get(dst) for src, dst in origin.items()}
    return NetworkTasks(graph, simple, tasks, ordered, aliases, node_group)

