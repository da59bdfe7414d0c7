"""ONNX importer: an .onnx model (file, bytes or ModelProto) -> Graph, for the op set of our networks.

Shapes are static: symbolic input dimensions must be given (`input_shapes`). Shape arithmetic that
exporters emit (Shape -> Gather -> Concat -> Reshape, Constant, Cast, ...) is evaluated at import
time, so only the real tensor computation reaches the graph. Anything else fails with an
`OnnxImportError` that names the op and the node (unsupported op, unsupported attribute value,
malformed or missing file, a value used before it is defined).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, overload

import numpy as np

from tensortune.tasks.graph import Graph, GraphBuilder, contiguous
from tensortune.tasks.graph_ops import GraphError, Node, TensorInfo, infer_node, run_node
from tensortune.tasks.onnx_functions import expand_functions

if TYPE_CHECKING:
    import onnx


class OnnxImportError(ValueError):
    """The model cannot be imported; the message says which node or file and what to do."""


def _onnx():
    try:
        import onnx
    except ImportError as err:  # pragma: no cover - onnx is a dependency
        raise OnnxImportError("the `onnx` package is needed to import ONNX models: pip install onnx") from err
    return onnx


def load_model(source) -> onnx.ModelProto:
    """Load and check a model from a path, bytes or a ModelProto; malformed input fails clearly."""
    onnx = _onnx()
    if isinstance(source, onnx.ModelProto):
        model, where = source, "model"
    elif isinstance(source, (bytes, bytearray)):
        where = "ONNX bytes"
        model = _parse(onnx, bytes(source), where)
    elif isinstance(source, (str, os.PathLike)):
        where = os.fspath(source)
        if not os.path.isfile(where):
            raise OnnxImportError(f"{where}: no such file; pass the path of an .onnx model")
        with open(where, "rb") as fh:
            data = fh.read()
        model = _parse(onnx, data, where)
        try:
            from onnx.external_data_helper import load_external_data_for_model
            if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
                load_external_data_for_model(model, os.path.dirname(os.path.abspath(where)))
        except (OSError, ValueError) as err:
            raise OnnxImportError(f"{where}: cannot load the model's external weight data: {err}") from None
    else:
        raise OnnxImportError(f"cannot import a {type(source).__name__}; pass a path, bytes or an onnx.ModelProto")
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise OnnxImportError(f"{where}: the model has no graph (an empty or truncated file?)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise OnnxImportError(f"{where}: invalid ONNX model: {first}") from None
    return model


def _parse(onnx, data: bytes, where: str):
    if not data:
        raise OnnxImportError(f"{where}: the file is empty; it is not an ONNX model")
    try:
        from google.protobuf.message import DecodeError
    except ImportError:  # pragma: no cover
        DecodeError = Exception
    try:
        return onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise OnnxImportError(f"{where}: not a valid ONNX model (cannot decode the protobuf: {err})") from None


def _pass_shape(name: str) -> str:
    """How to give an input's sizes, in the library and on the command line."""
    return f"pass concrete sizes: input_shapes={{{name!r}: (...)}}, or --input-shape {name}=D0,D1,... on the CLI"


def import_onnx(source, input_shapes: Mapping[str, Sequence[int]] | None = None, name: str | None = None) -> Graph:
    """Import an ONNX model as a Graph; `input_shapes` fixes inputs whose dimensions are symbolic."""
    model = expand_functions(load_model(source), set(CONVERTERS))
    return _Importer(model, dict(input_shapes or {}), name).run()


# ---------------------------------------------------------------------------------- the importer

_Value = str | np.ndarray        # a graph value name, or a constant known at import time


class _Importer:
    def __init__(self, model: onnx.ModelProto, input_shapes: dict, name: str | None):
        self.onnx = _onnx()
        self.model = model
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        gname = name or model.graph.name or "onnx-model"
        self.b = GraphBuilder(gname)
        self.env: dict[str, _Value] = {}
        self.materialized: dict[int, tuple[np.ndarray, str]] = {}   # id -> (array kept alive, value name)
        self.onnx_names: dict[int, str] = {}                         # id of an initializer -> its ONNX name
        self.input_shapes = input_shapes
        self._node: onnx.NodeProto | None = None
        self.node_label = ""
        self.out_name = ""      # the ONNX name of the current node's output: its last emitted value gets it
        self.used: set[str] = set()

    @property
    def node(self) -> onnx.NodeProto:
        """The node being converted (converters and errors run only while there is one)."""
        if self._node is None:
            raise OnnxImportError("no ONNX node is being converted")
        return self._node

    # ------------------------------------------------------------------ errors and values

    def fail(self, msg: str) -> OnnxImportError:
        return OnnxImportError(f"node {self.node_label} ({self.node.op_type}): {msg}")

    def value(self, name: str) -> _Value:
        if name not in self.env:
            raise self.fail(f"input {name!r} is not defined before this node (not a graph input, initializer "
                            f"or earlier node output)")
        return self.env[name]

    def const(self, i: int, what: str) -> np.ndarray | None:
        """Input i as a constant (None when absent); an error when it is computed at run time."""
        if i >= len(self.node.input) or not self.node.input[i]:
            return None
        v = self.value(self.node.input[i])
        if not isinstance(v, np.ndarray):
            raise self.fail(f"{what} (input {i}) must be a constant known at import time, not computed at run time")
        return v

    def required_const(self, i: int, what: str) -> np.ndarray:
        """Input i as a constant; an error when it is absent or computed at run time."""
        v = self.const(i, what)
        if v is None:
            raise self.fail(f"missing required input {i} ({what})")
        return v

    def inp(self, i: int) -> _Value:
        if i >= len(self.node.input) or not self.node.input[i]:
            raise self.fail(f"missing required input {i}")
        return self.value(self.node.input[i])

    def as_value(self, v: _Value, hint: str = "const") -> str:
        """A graph value name for v (a constant becomes a graph constant once, named as in the file)."""
        if isinstance(v, str):
            return v
        if id(v) not in self.materialized:
            self.materialized[id(v)] = (v, self.b.constant(v, self.onnx_names.get(id(v), hint)))
        return self.materialized[id(v)][1]

    def shape(self, v: _Value) -> tuple[int, ...]:
        return tuple(v.shape) if isinstance(v, np.ndarray) else self.b.shape(v)

    def dtype(self, v: _Value) -> str:
        return str(v.dtype) if isinstance(v, np.ndarray) else self.b.values[v].dtype

    def emit(self, op: str, inputs: Sequence[_Value], output: str | None = None, **attrs) -> _Value:
        """Add a graph node, or evaluate it now when every input is a constant (constant folding)."""
        arrays = [v for v in inputs if isinstance(v, np.ndarray)]
        if len(arrays) == len(inputs):
            node = Node("fold", op, tuple(f"c{i}" for i in range(len(arrays))), "out", dict(attrs))
            try:
                info = infer_node(node, [TensorInfo(tuple(v.shape), str(v.dtype)) for v in arrays])
                wide = [v.astype(np.float64) if v.dtype.kind == "f" else v for v in arrays]
                return contiguous(run_node(node, wide).astype(info.dtype))
            except GraphError as err:
                raise self.fail(str(err)) from None
        names = [self.as_value(v, f"{self.node_label}.c{i}") for i, v in enumerate(inputs)]
        try:
            return self.b.add(op, names, name=output or self.out_name, **attrs)
        except GraphError as err:
            raise self.fail(str(err).split(": ", 1)[-1]) from None

    def attrs(self) -> dict:
        out = {}
        for a in self.node.attribute:
            out[a.name] = self.onnx.helper.get_attribute_value(a)
            if isinstance(out[a.name], bytes):
                out[a.name] = out[a.name].decode()
        return out

    # ------------------------------------------------------------------ driver

    def _tensor_dtype(self, elem_type: int, what: str) -> str:
        try:
            return str(np.dtype(self.onnx.helper.tensor_dtype_to_np_dtype(elem_type)))
        except (KeyError, TypeError, ValueError):
            raise OnnxImportError(f"{what}: unsupported element type {elem_type}") from None

    def _inputs(self) -> None:
        inits = {t.name for t in self.model.graph.initializer}
        for t in self.model.graph.initializer:
            try:
                self.env[t.name] = contiguous(self.onnx.numpy_helper.to_array(t))
                self.onnx_names[id(self.env[t.name])] = t.name
            except (ValueError, TypeError, OSError) as err:
                raise OnnxImportError(f"initializer {t.name!r} cannot be read: {err}") from None
        for vi in self.model.graph.input:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                raise OnnxImportError(f"graph input {vi.name!r} is not a tensor; only tensor inputs are supported")
            dtype = self._tensor_dtype(tt.elem_type, f"graph input {vi.name!r}")
            if vi.name in self.input_shapes:
                shape = tuple(int(s) for s in self.input_shapes[vi.name])
            else:
                if not tt.HasField("shape"):
                    raise OnnxImportError(f"graph input {vi.name!r} has no shape; {_pass_shape(vi.name)}")
                dims: list[int] = []
                for d, dim in enumerate(tt.shape.dim):
                    if dim.HasField("dim_value") and dim.dim_value > 0:
                        dims.append(int(dim.dim_value))
                    else:
                        sym = dim.dim_param or "?"
                        raise OnnxImportError(f"graph input {vi.name!r} has a symbolic dimension {sym!r} (axis {d}); "
                                              f"{_pass_shape(vi.name)}")
                shape = tuple(dims)
            if any(s <= 0 for s in shape):
                raise OnnxImportError(f"graph input {vi.name!r}: shape {list(shape)} must be positive")
            self.env[vi.name] = self.b.input(vi.name, shape, dtype)
        unknown = set(self.input_shapes) - {vi.name for vi in self.model.graph.input}
        if unknown:
            raise OnnxImportError(f"input shapes given for {sorted(unknown)}, which are not graph inputs "
                                  f"({', '.join(vi.name for vi in self.model.graph.input if vi.name not in inits)})")

    def run(self) -> Graph:
        self._inputs()
        g = self.model.graph
        for node in g.node:
            self.used.update(i for i in node.input if i)
        self.used.update(o.name for o in g.output)
        seen_labels: set[str] = set()
        for k, node in enumerate(g.node):
            self._node = node
            label = node.name or f"{node.op_type}_{k}"
            while label in seen_labels or label in self.b.values:
                label = f"{label}_{k}"
            seen_labels.add(label)
            self.node_label = label
            self.out_name = node.output[0] if node.output and node.output[0] else label
            if node.domain not in ("", "ai.onnx"):
                raise self.fail(f"unsupported op {node.domain}.{node.op_type}: only the default ONNX domain is "
                                f"supported")
            conv = CONVERTERS.get(node.op_type)
            if conv is None:
                raise self.fail(f"unsupported op {node.op_type!r}; supported ops: {', '.join(sorted(CONVERTERS))}")
            extra = [o for o in node.output[1:] if o and o in self.used]
            if extra and node.op_type not in MULTI_OUTPUT:
                raise self.fail(f"its extra output(s) {extra} are used, but only the first output is supported")
            result = conv(self)
            if isinstance(result, tuple):                # one value per output (Split)
                for name, value in zip(node.output, result):
                    if name:
                        self.env[name] = value
                continue
            if node.output and node.output[0]:
                self.env[node.output[0]] = result
                if isinstance(result, np.ndarray):
                    self.onnx_names.setdefault(id(result), node.output[0])
        outputs = []
        for o in g.output:
            if o.name not in self.env:
                raise OnnxImportError(f"graph output {o.name!r} is not produced by any node")
            v = self.env[o.name]
            if isinstance(v, str) and v != o.name:      # an Identity/no-op output: a view under its ONNX name
                v = self.b.add("reshape", [v], name=o.name, shape=self.b.shape(v))
            outputs.append(v if isinstance(v, str) else self.as_value(v, o.name))
        try:
            return self.b.build(outputs)
        except GraphError as err:
            raise OnnxImportError(f"imported graph is invalid: {err}") from None


# ---------------------------------------------------------------------------------- converters

def _int_tuple(v: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


@overload
def _ints(v: Any, default: tuple[int, ...]) -> tuple[int, ...]: ...
@overload
def _ints(v: Any, default: None = None) -> tuple[int, ...] | None: ...
def _ints(v: Any, default: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """An ints attribute as a tuple; `default` when it is absent (None)."""
    if v is None:
        return default
    return _int_tuple(v)


def _required_ints(imp: _Importer, a: dict, name: str) -> tuple[int, ...]:
    if a.get(name) is None:
        raise imp.fail(f"missing required attribute {name!r}")
    return _int_tuple(a[name])


def _need_2d(imp: _Importer, x: _Value, what: str = "input") -> None:
    if len(imp.shape(x)) != 4:
        raise imp.fail(f"only 1-D, 2-D and 3-D spatial ops (NCW, NCHW, NCDHW) are supported; {what} has "
                       f"shape {list(imp.shape(x))}")


def _lift_1d(imp: _Importer, x: _Value, a: dict) -> tuple[_Value, dict, Callable[[_Value], _Value] | None]:
    """A 1-D op (NCW) as the 2-D op over an NC1W view: its window attributes get a leading 1 (pads
    [b, e] become [0, b, 0, e]); returns the view, the attributes and what turns the 2-D result back
    (None for an input that is not 1-D)."""
    shape = imp.shape(x)
    if len(shape) != 3:
        return x, a, None
    lifted = dict(a)
    for key in ("kernel_shape", "strides", "dilations"):
        if key in a:
            lifted[key] = (1,) + _ints(a[key], default=())
    if "pads" in a:
        b, e = _ints(a["pads"], default=(0, 0))
        lifted["pads"] = (0, b, 0, e)
    x4 = imp.emit("reshape", [x], output=f"{imp.node_label}.as_2d", shape=(shape[0], shape[1], 1, shape[2]))

    def back(y: _Value) -> _Value:
        n, c, _, w = imp.shape(y)
        return imp.emit("reshape", [y], shape=(n, c, w))
    return x4, lifted, back


def _pads_nd(imp: _Importer, a: dict, sizes, k, s, d) -> tuple[int, ...]:
    """ONNX pads (begins..., ends...) of an n-d window op, from `pads` or `auto_pad`."""
    r = len(sizes)
    mode = a.get("auto_pad", "NOTSET")
    if mode in ("NOTSET", ""):
        p = _ints(a.get("pads"), default=(0,) * (2 * r))
        if len(p) != 2 * r:
            raise imp.fail(f"pads {list(p)} must have {2 * r} entries for a {r}-D op")
        return p
    if mode == "VALID":
        return (0,) * (2 * r)
    if mode not in ("SAME_UPPER", "SAME_LOWER"):
        raise imp.fail(f"unsupported auto_pad {mode!r}")
    lo, hi = [], []
    for size, kk, ss, dd in zip(sizes, k, s, d):
        total = max(0, (-(-size // ss) - 1) * ss + (kk - 1) * dd + 1 - size)
        lo.append(total // 2 if mode == "SAME_UPPER" else total - total // 2)
        hi.append(total - lo[-1])
    return tuple(lo + hi)


def _conv3d(imp: _Importer):
    a = imp.attrs()
    x, w = imp.inp(0), imp.inp(1)
    k = _ints(a.get("kernel_shape"), default=tuple(imp.shape(w)[2:]))
    s, d = _ints(a.get("strides"), default=(1, 1, 1)), _ints(a.get("dilations"), default=(1, 1, 1))
    pads = _pads_nd(imp, a, imp.shape(x)[2:], k, s, d)
    ins = [x, w] + ([imp.inp(2)] if len(imp.node.input) > 2 and imp.node.input[2] else [])
    return imp.emit("conv3d", ins, strides=s, pads=pads, dilations=d, groups=int(a.get("group", 1)))


def _conv(imp: _Importer):
    x, w = imp.inp(0), imp.inp(1)
    if len(imp.shape(x)) == 5:
        return _conv3d(imp)
    x, a, back = _lift_1d(imp, x, imp.attrs())
    if len(imp.shape(w)) == 3:
        co, ci, kw = imp.shape(w)
        w = contiguous(w.reshape(co, ci, 1, kw)) if isinstance(w, np.ndarray) else imp.emit(
            "reshape", [w], output=f"{imp.node_label}.kernel_2d", shape=(co, ci, 1, kw))
    _need_2d(imp, x)
    k = _ints(a.get("kernel_shape"), default=tuple(imp.shape(w)[2:]))
    s, d = _ints(a.get("strides"), default=(1, 1)), _ints(a.get("dilations"), default=(1, 1))
    pads = _pads_nd(imp, a, imp.shape(x)[2:], k, s, d)
    ins = [x, w] + ([imp.inp(2)] if len(imp.node.input) > 2 and imp.node.input[2] else [])
    if back is None:
        return imp.emit("conv2d", ins, strides=s, pads=pads, dilations=d, groups=int(a.get("group", 1)))
    return back(imp.emit("conv2d", ins, output=f"{imp.node_label}.conv2d", strides=s, pads=pads, dilations=d,
                         groups=int(a.get("group", 1))))


def _conv_transpose(imp: _Importer):
    a = imp.attrs()
    x, w = imp.inp(0), imp.inp(1)
    _need_2d(imp, x)
    if int(a.get("group", 1)) != 1:
        raise imp.fail(f"group={a['group']} is not supported for ConvTranspose (only 1)")
    kh, kw = _ints(a.get("kernel_shape"), default=tuple(imp.shape(w)[2:]))
    s, d = _ints(a.get("strides"), default=(1, 1)), _ints(a.get("dilations"), default=(1, 1))
    op = _ints(a.get("output_padding"), default=(0, 0))
    mode = a.get("auto_pad", "NOTSET")
    pads: tuple[int, ...]                             # (top, left, bottom, right)
    if "output_shape" in a or mode in ("SAME_UPPER", "SAME_LOWER"):
        in_hw = imp.shape(x)[2:]
        target = _int_tuple(a["output_shape"])[-2:] if "output_shape" in a else tuple(v * st for v, st in zip(in_hw, s))
        halves = []                                   # (begin, end) per spatial dim
        for size, k, st, dl, o, t in zip(in_hw, (kh, kw), s, d, op, target):
            total = st * (size - 1) + o + ((k - 1) * dl + 1) - t
            if total < 0:
                raise imp.fail(f"output_shape {list(target)} is larger than the op can produce")
            lo = total // 2 if mode == "SAME_UPPER" else total - total // 2   # as the ONNX spec says
            halves.append((lo, total - lo))
        pads = (halves[0][0], halves[1][0], halves[0][1], halves[1][1])
    elif mode in ("NOTSET", "", "VALID"):
        pads = (0, 0, 0, 0) if mode == "VALID" else _ints(a.get("pads"), default=(0, 0, 0, 0))
    else:
        raise imp.fail(f"unsupported auto_pad {mode!r}")
    ins = [x, w] + ([imp.inp(2)] if len(imp.node.input) > 2 and imp.node.input[2] else [])
    return imp.emit("conv_transpose2d", ins, strides=s, pads=pads, output_padding=op, dilations=d)


def _gemm(imp: _Importer):
    """Y = alpha * A' B' + beta * C: a dense (weights [M, K]) when B is a constant, else a matmul."""
    a = imp.attrs()
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    x, w = imp.inp(0), imp.inp(1)
    if len(imp.shape(x)) != 2 or len(imp.shape(w)) != 2:
        raise imp.fail(f"Gemm needs 2-d operands, got {list(imp.shape(x))} and {list(imp.shape(w))}")
    c = imp.inp(2) if len(imp.node.input) > 2 and imp.node.input[2] else None
    label = imp.node_label
    if a.get("transA", 0):
        x = imp.emit("transpose", [x], output=f"{label}.transA", perm=(1, 0))
    if isinstance(w, np.ndarray):
        w = contiguous((w if a.get("transB", 0) else w.T) * np.float32(alpha)).astype(w.dtype)
        m = w.shape[0]
        bias = None
        if isinstance(c, np.ndarray) and c.size == m and (c.ndim == 1 or (c.ndim == 2 and c.shape[0] == 1)):
            bias, c = contiguous((c.reshape(m) * beta).astype(c.dtype)), None
        y = imp.emit("dense", [x, w] + ([bias] if bias is not None else []),
                     output=None if c is None else f"{label}.dense")
    else:
        if a.get("transB", 0):
            w = imp.emit("transpose", [w], output=f"{label}.transB", perm=(1, 0))
        y = imp.emit("matmul", [x, w], output=None if c is None and alpha == 1.0 else f"{label}.matmul")
        if alpha != 1.0:
            y = imp.emit("mul", [y, np.array(alpha, np.float32)], output=None if c is None else f"{label}.alpha")
    if c is not None:
        if beta != 1.0:
            c = (c * beta).astype(c.dtype) if isinstance(c, np.ndarray) else \
                imp.emit("mul", [c, np.array(beta, np.float32)], output=f"{label}.beta")
        y = imp.emit("add", [y, c])
    return y


def _matmul(imp: _Importer):
    a, b = imp.inp(0), imp.inp(1)
    if len(imp.shape(a)) < 2 or len(imp.shape(b)) < 2:
        raise imp.fail(f"1-d MatMul operands are not supported (shapes {list(imp.shape(a))} and "
                       f"{list(imp.shape(b))}); reshape them to matrices")
    return imp.emit("matmul", [a, b])


def _batch_norm(imp: _Importer):
    a = imp.attrs()
    if int(a.get("training_mode", 0)):
        raise imp.fail("training_mode=1 is not supported; export the model in eval mode")
    if int(a.get("spatial", 1)) != 1:
        raise imp.fail("spatial=0 is not supported")
    return imp.emit("batch_norm", [imp.inp(i) for i in range(5)], epsilon=float(a.get("epsilon", 1e-5)))


def _layer_norm_with_stats(imp: _Importer) -> tuple[_Value, _Value, _Value]:
    """LayerNormalization whose Mean and InvStdDev outputs are used: the statistics as their own
    reductions (keepdims, as ONNX gives them), then Y from them."""
    a = imp.attrs()
    x = imp.inp(0)
    shape = imp.shape(x)
    axis = int(a.get("axis", -1)) % len(shape)
    axes = tuple(range(axis, len(shape)))
    eps = np.asarray(float(a.get("epsilon", 1e-5)), dtype=imp.dtype(x))
    label = imp.node_label
    out = list(imp.node.output) + ["", ""]
    mean = imp.emit("reduce_mean", [x], output=out[1] or f"{label}.mean", axes=axes, keepdims=True)
    d = imp.emit("sub", [x, mean], output=f"{label}.centered")
    var = imp.emit("reduce_mean", [imp.emit("mul", [d, d], output=f"{label}.squares")], output=f"{label}.var",
                   axes=axes, keepdims=True)
    std = imp.emit("sqrt", [imp.emit("add", [var, eps], output=f"{label}.var_eps")], output=f"{label}.std")
    inv = imp.emit("reciprocal", [std], output=out[2] or f"{label}.inv_std")
    y = imp.emit("mul", [imp.emit("mul", [d, inv], output=f"{label}.normed"), imp.inp(1)],
                 output=f"{label}.scaled" if len(imp.node.input) > 2 and imp.node.input[2] else out[0] or None)
    if len(imp.node.input) > 2 and imp.node.input[2]:
        y = imp.emit("add", [y, imp.inp(2)], output=out[0] or None)
    return y, mean, inv


def _layer_norm(imp: _Importer):
    if any(o and o in imp.used for o in imp.node.output[1:]):
        return _layer_norm_with_stats(imp)
    a = imp.attrs()
    x = imp.inp(0)
    shape = imp.shape(x)
    axis = int(a.get("axis", -1)) % len(shape)
    eps = float(a.get("epsilon", 1e-5))
    scale = imp.inp(1)
    bias = imp.inp(2) if len(imp.node.input) > 2 and imp.node.input[2] else np.zeros(shape[axis:], np.float32)
    if axis == len(shape) - 1:
        return imp.emit("layer_norm", [x, scale, bias], axis=-1, epsilon=eps)
    inner = math.prod(shape[axis:])
    flat = imp.emit("reshape", [x], output=f"{imp.node_label}.flatten", shape=shape[:axis] + (inner,))
    if not isinstance(scale, np.ndarray) or not isinstance(bias, np.ndarray):
        raise imp.fail("scale and bias must be constants when normalising over several axes")
    y = imp.emit("layer_norm", [flat, scale.reshape(inner), contiguous(bias.reshape(inner))],
                 output=f"{imp.node_label}.norm", axis=-1, epsilon=eps)
    return imp.emit("reshape", [y], shape=shape)


def _pool(kind: str) -> Callable:
    def convert(imp: _Importer):
        x, a, back = _lift_1d(imp, imp.inp(0), imp.attrs())
        spatial = len(imp.shape(x)) - 2
        if spatial != 3:
            _need_2d(imp, x)
        if int(a.get("ceil_mode", 0)):
            raise imp.fail("ceil_mode=1 is not supported; use ceil_mode=0 (floor)")
        if any(v != 1 for v in _ints(a.get("dilations"), default=(1,) * spatial)):
            raise imp.fail(f"dilations {a['dilations']} are not supported for pooling")
        if int(a.get("storage_order", 0)):
            raise imp.fail("storage_order=1 is not supported")
        k = _ints(a.get("kernel_shape"))
        if k is None or len(k) != spatial:
            raise imp.fail(f"kernel_shape must have {spatial} entries, got {a.get('kernel_shape')}")
        s = _ints(a.get("strides"), default=(1,) * spatial)
        pads = _pads_nd(imp, a, imp.shape(x)[2:], k, s, (1,) * spatial)
        attrs = dict(kernel=k, strides=s, pads=pads) if kind == "max" else dict(
            kernel=k, strides=s, pads=pads, count_include_pad=bool(a.get("count_include_pad", 0)))
        op = f"{kind}_pool{spatial}d"
        if back is None:
            return imp.emit(op, [x], **attrs)
        return back(imp.emit(op, [x], output=f"{imp.node_label}.pool2d", **attrs))
    return convert


def _softmax(imp: _Importer, op: str = "softmax"):
    a = imp.attrs()
    x = imp.inp(0)
    shape = imp.shape(x)
    rank = len(shape)
    if imp.opset < 13:     # old semantics: flatten to 2-D at `axis`, softmax over the second dim
        axis = int(a.get("axis", 1)) % rank
        if axis == rank - 1:
            return imp.emit(op, [x], axis=-1)
        flat = imp.emit("reshape", [x], output=f"{imp.node_label}.flatten",
                        shape=(math.prod(shape[:axis]) if axis else 1, math.prod(shape[axis:])))
        y = imp.emit(op, [flat], output=f"{imp.node_label}.{op}", axis=-1)
        return imp.emit("reshape", [y], shape=shape)
    axis = int(a.get("axis", -1)) % rank
    if axis == rank - 1:
        return imp.emit(op, [x], axis=-1)
    perm = tuple(d for d in range(rank) if d != axis) + (axis,)
    back = tuple(perm.index(d) for d in range(rank))
    t = imp.emit("transpose", [x], output=f"{imp.node_label}.to_last", perm=perm)
    y = imp.emit(op, [t], output=f"{imp.node_label}.{op}", axis=-1)
    return imp.emit("transpose", [y], perm=back)


def _binary(op: str) -> Callable:
    def convert(imp: _Importer):
        ins = [imp.inp(i) for i in range(len(imp.node.input))]
        if len(ins) < 2:
            raise imp.fail(f"needs at least 2 inputs, got {len(ins)}")
        out = ins[0]
        for k, v in enumerate(ins[1:]):
            last = k == len(ins) - 2
            out = imp.emit(op, [out, v], output=None if last else f"{imp.node_label}.{k}")
        return out
    return convert


def _sum(mean: bool) -> Callable:
    """Sum and Mean of one or more inputs (numpy broadcasting): a chain of adds, then 1/n for Mean."""
    def convert(imp: _Importer):
        ins = [imp.inp(i) for i in range(len(imp.node.input))]
        out = ins[0]
        for k, v in enumerate(ins[1:]):
            last = k == len(ins) - 2 and not mean
            out = imp.emit("add", [out, v], output=None if last else f"{imp.node_label}.{k}")
        if mean and len(ins) > 1:
            return imp.emit("mul", [out, np.asarray(1.0 / len(ins), dtype=imp.dtype(out))])
        return out
    return convert


def _prelu(imp: _Importer):
    """Before opset 7 a 1-D slope of C values is per channel (axis 1); from 7 on it broadcasts as numpy."""
    x, slope = imp.inp(0), imp.inp(1)
    shape = imp.shape(x)
    if imp.opset < 7 and len(imp.shape(slope)) == 1 and len(shape) > 2 and imp.shape(slope)[0] == shape[1]:
        channel = (shape[1],) + (1,) * (len(shape) - 2)
        slope = slope.reshape(channel) if isinstance(slope, np.ndarray) else imp.emit(
            "reshape", [slope], output=f"{imp.node_label}.slope", shape=channel)
    return imp.emit("prelu", [x, slope])


def _activation(op: str, *names: tuple[str, str]) -> Callable:
    """An elementwise op with float attributes: (ONNX attribute, graph attribute) pairs."""
    def convert(imp: _Importer):
        a = imp.attrs()
        attrs: dict[str, Any] = {mine: float(a[theirs]) for theirs, mine in names if theirs in a}
        return imp.emit(op, [imp.inp(0)], **attrs)
    return convert


def _rms_norm(imp: _Importer):
    """RMSNormalization: x / sqrt(mean(x^2 over axis..) + epsilon) * scale."""
    a = imp.attrs()
    x = imp.inp(0)
    shape = imp.shape(x)
    axes = tuple(range(int(a.get("axis", -1)) % len(shape), len(shape)))
    label = imp.node_label
    ms = imp.emit("reduce_mean", [imp.emit("mul", [x, x], output=f"{label}.squares")], output=f"{label}.mean_square",
                  axes=axes, keepdims=True)
    rms = imp.emit("sqrt", [imp.emit("add", [ms, np.asarray(float(a.get("epsilon", 1e-5)), dtype=imp.dtype(x))],
                                     output=f"{label}.eps")], output=f"{label}.rms")
    return imp.emit("mul", [imp.emit("div", [x, rms], output=f"{label}.normed"), imp.inp(1)])


def _expand(imp: _Importer):
    """Expand: numpy broadcasting of the input and the (constant) shape, both ways."""
    x = imp.inp(0)
    target = tuple(int(v) for v in imp.required_const(1, "shape").reshape(-1))
    xs = imp.shape(x)
    rank = max(len(xs), len(target))
    a, b = (1,) * (rank - len(xs)) + tuple(xs), (1,) * (rank - len(target)) + target
    if any(p != q and 1 not in (p, q) for p, q in zip(a, b)):
        raise imp.fail(f"shape {list(xs)} cannot be expanded to {list(target)}")
    out = tuple(max(p, q) for p, q in zip(a, b))
    if isinstance(x, np.ndarray):
        return contiguous(np.broadcast_to(x, out))
    return x if out == tuple(xs) else imp.emit("broadcast_to", [x], shape=out)


def _global_max_pool(imp: _Importer):
    x = imp.inp(0)
    rank = len(imp.shape(x))
    if rank < 3:
        raise imp.fail(f"needs N, C and spatial axes, got {list(imp.shape(x))}")
    return imp.emit("reduce_max", [x], axes=tuple(range(2, rank)), keepdims=True)


def _lrn(imp: _Importer):
    a = imp.attrs()
    if "size" not in a:
        raise imp.fail("the size attribute is required")
    return imp.emit("lrn", [imp.inp(0)], size=int(a["size"]), alpha=float(a.get("alpha", 1e-4)),
                    beta=float(a.get("beta", 0.75)), bias=float(a.get("bias", 1.0)))


def _pad(imp: _Importer):
    a = imp.attrs()
    x = imp.inp(0)
    rank = len(imp.shape(x))
    if imp.opset < 11:
        pads, value = _ints(a.get("pads")), float(a.get("value", 0.0))
    else:
        pads = tuple(int(v) for v in imp.required_const(1, "pads").reshape(-1))
        c = imp.const(2, "constant_value")
        value = 0.0 if c is None or c.size == 0 else float(c.reshape(-1)[0])
        axes_c = imp.const(3, "axes")
        if axes_c is not None:
            axes = [int(v) % rank for v in axes_c.reshape(-1)]
            full = [0] * (2 * rank)
            for k, ax in enumerate(axes):
                full[ax], full[rank + ax] = pads[k], pads[len(axes) + k]
            pads = tuple(full)
    if pads is None or len(pads) != 2 * rank:
        raise imp.fail(f"pads {list(pads or ())} must have 2 entries per axis ({2 * rank})")
    mode = a.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise imp.fail(f"mode {mode!r} is not supported (constant, reflect, edge)")
    if not any(pads):
        return x
    return imp.emit("pad", [x], before=pads[:rank], after=pads[rank:], mode=mode, value=value)


def _tile(imp: _Importer):
    x = imp.inp(0)
    reps = tuple(int(v) for v in imp.required_const(1, "repeats").reshape(-1))
    if isinstance(x, np.ndarray):
        return contiguous(np.tile(x, reps))
    if all(r == 1 for r in reps):
        return x
    return imp.emit("tile", [x], repeats=reps)


def _split(imp: _Importer) -> tuple[_Value, ...]:
    """Split: one strided slice per output (named as the node's outputs)."""
    a = imp.attrs()
    x = imp.inp(0)
    shape = imp.shape(x)
    axis = int(a.get("axis", 0)) % len(shape)
    outs = [o for o in imp.node.output]
    if imp.opset < 13 and "split" in a:
        sizes = list(_ints(a["split"], default=()))
    elif imp.opset >= 13 and len(imp.node.input) > 1 and imp.node.input[1]:
        sizes = [int(v) for v in imp.required_const(1, "split").reshape(-1)]
    else:
        n = len(outs)
        step = -(-shape[axis] // n)                 # ONNX: equal parts, the last one smaller
        sizes = [min(step, shape[axis] - k * step) for k in range(n)]
    if len(sizes) != len(outs) or sum(sizes) != shape[axis] or min(sizes) < 0:
        raise imp.fail(f"split sizes {sizes} must be one per output ({len(outs)}) and add up to {shape[axis]}")
    results: list[_Value] = []
    start = 0
    for size, name in zip(sizes, outs):
        begin, end, step_ = [0] * len(shape), list(shape), [1] * len(shape)
        begin[axis], end[axis] = start, start + size
        start += size
        if isinstance(x, np.ndarray):
            results.append(contiguous(x[tuple(slice(b, e) for b, e in zip(begin, end))]))
        elif size == 0:
            raise imp.fail(f"output {name!r} would be empty")
        else:
            results.append(imp.emit("slice", [x], output=name or None, begin=tuple(begin), end=tuple(end),
                                    step=tuple(step_)))
    return tuple(results)


def _instance_norm(imp: _Importer):
    """InstanceNormalization as a layer norm over each (n, c)'s spatial values, then the per-channel
    scale and bias."""
    a = imp.attrs()
    x, scale, bias = imp.inp(0), imp.inp(1), imp.inp(2)
    shape = imp.shape(x)
    if len(shape) < 3:
        raise imp.fail(f"needs N, C and spatial axes, got {list(shape)}")
    n, c, inner = shape[0], shape[1], math.prod(shape[2:])
    dt = imp.dtype(x)
    flat = imp.emit("reshape", [x], output=f"{imp.node_label}.flatten", shape=(n, c, inner))
    y = imp.emit("layer_norm", [flat, np.ones(inner, dt), np.zeros(inner, dt)], output=f"{imp.node_label}.norm",
                 axis=-1, epsilon=float(a.get("epsilon", 1e-5)))
    y = imp.emit("reshape", [y], output=f"{imp.node_label}.unflatten", shape=shape)
    channel = (c,) + (1,) * (len(shape) - 2)
    as_channel = [v.reshape(channel) if isinstance(v, np.ndarray) else
                  imp.emit("reshape", [v], output=f"{imp.node_label}.{what}", shape=channel)
                  for v, what in ((scale, "scale"), (bias, "bias"))]
    y = imp.emit("mul", [y, as_channel[0]], output=f"{imp.node_label}.scaled")
    return imp.emit("add", [y, as_channel[1]])


_INTEGER_UNARY = {"neg": np.negative, "abs": np.abs}       # on integer constants (shape arithmetic)


def _unary(op: str) -> Callable:
    def convert(imp: _Importer):
        x = imp.inp(0)
        if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and op in _INTEGER_UNARY:
            return contiguous(_INTEGER_UNARY[op](x))
        return imp.emit(op, [x])
    return convert


def _gelu(imp: _Importer):
    approx = imp.attrs().get("approximate", "none")
    if approx not in ("none", "tanh"):
        raise imp.fail(f"approximate={approx!r} is not supported (only 'none', the erf form, and 'tanh')")
    return imp.emit("gelu" if approx == "none" else "gelu_tanh", [imp.inp(0)])


def _clip(imp: _Importer):
    a = imp.attrs()
    if imp.opset < 11:
        lo, hi = a.get("min"), a.get("max")
    else:
        bounds = [imp.inp(i) if len(imp.node.input) > i and imp.node.input[i] else None for i in (1, 2)]
        if any(isinstance(v, str) for v in bounds):          # bounds computed at run time
            y = imp.inp(0)
            for k, (op, v) in enumerate((("maximum", bounds[0]), ("minimum", bounds[1]))):
                if v is not None:
                    last = k == 1 or bounds[1] is None
                    y = imp.emit(op, [y, v], output=None if last else f"{imp.node_label}.{op}")
            return y
        lo_c, hi_c = imp.const(1, "min"), imp.const(2, "max")
        lo = None if lo_c is None else float(lo_c.reshape(()))
        hi = None if hi_c is None else float(hi_c.reshape(()))
    return imp.emit("clip", [imp.inp(0)], min=None if lo is None else float(lo), max=None if hi is None else float(hi))


def _reshape_to(imp: _Importer, x: _Value, shape: tuple[int, ...]):
    if tuple(imp.shape(x)) == tuple(shape):
        return x
    if isinstance(x, np.ndarray):
        return contiguous(x.reshape(shape))
    return imp.emit("reshape", [x], shape=tuple(int(s) for s in shape))


def _reshape(imp: _Importer):
    x = imp.inp(0)
    if imp.opset < 5:
        target = list(_required_ints(imp, imp.attrs(), "shape"))
    else:
        target = [int(v) for v in imp.required_const(1, "shape").reshape(-1)]
    allowzero = int(imp.attrs().get("allowzero", 0))
    in_shape = imp.shape(x)
    out = [in_shape[i] if v == 0 and not allowzero else v for i, v in enumerate(target)]
    if out.count(-1) > 1:
        raise imp.fail(f"shape {target} has more than one -1")
    if -1 in out:
        known = math.prod(v for v in out if v != -1)
        total = math.prod(in_shape)
        if known == 0 or total % known:
            raise imp.fail(f"cannot reshape {list(in_shape)} to {target}")
        out[out.index(-1)] = total // known
    if math.prod(out) != math.prod(in_shape):
        raise imp.fail(f"cannot reshape {list(in_shape)} ({math.prod(in_shape)} elements) to {target}")
    return _reshape_to(imp, x, tuple(out))


def _flatten(imp: _Importer):
    x = imp.inp(0)
    shape = imp.shape(x)
    axis = int(imp.attrs().get("axis", 1))
    if not -len(shape) <= axis <= len(shape):
        raise imp.fail(f"axis {axis} is outside [-{len(shape)}, {len(shape)}] for a rank-{len(shape)} input")
    axis = axis + len(shape) if axis < 0 else axis        # ONNX: a negative axis counts from the back, r + axis
    return _reshape_to(imp, x, (math.prod(shape[:axis]), math.prod(shape[axis:])))


def _axes(imp: _Importer) -> tuple[int, ...] | None:
    """Squeeze/Unsqueeze axes: an attribute before opset 13, the second input from it on."""
    if imp.opset < 13:
        return _ints(imp.attrs().get("axes"))
    c = imp.const(1, "axes")
    return None if c is None else tuple(int(v) for v in c.reshape(-1))


def _squeeze(imp: _Importer):
    x = imp.inp(0)
    shape = imp.shape(x)
    axes = _axes(imp)
    if axes is None:
        axes = tuple(i for i, s in enumerate(shape) if s == 1)
    drop = {a % len(shape) for a in axes}
    bad = [a for a in drop if shape[a] != 1]
    if bad:
        raise imp.fail(f"cannot squeeze axes {bad} of shape {list(shape)}: they are not 1")
    return _reshape_to(imp, x, tuple(s for i, s in enumerate(shape) if i not in drop))


def _unsqueeze(imp: _Importer):
    x = imp.inp(0)
    shape = list(imp.shape(x))
    axes = _axes(imp)
    if axes is None:
        raise imp.fail("missing axes")
    rank = len(shape) + len(axes)
    for a in sorted(v % rank for v in axes):
        shape.insert(a, 1)
    return _reshape_to(imp, x, tuple(shape))


def _transpose(imp: _Importer):
    x = imp.inp(0)
    rank = len(imp.shape(x))
    perm = _ints(imp.attrs().get("perm"), default=tuple(reversed(range(rank))))
    if isinstance(x, np.ndarray):
        return contiguous(np.transpose(x, perm))
    return imp.emit("transpose", [x], perm=perm)


def _concat(imp: _Importer):
    ins = [imp.inp(i) for i in range(len(imp.node.input)) if imp.node.input[i]]
    axis = int(imp.attrs()["axis"])
    if all(isinstance(v, np.ndarray) for v in ins):
        return np.concatenate(ins, axis=axis)
    return imp.emit("concat", ins, axis=axis) if len(ins) > 1 else ins[0]


def _gather(imp: _Importer):
    data, idx = imp.inp(0), imp.inp(1)
    axis = int(imp.attrs().get("axis", 0))
    if isinstance(data, np.ndarray) and isinstance(idx, np.ndarray):
        n = data.shape[axis]
        return contiguous(np.take(data, np.where(idx < 0, idx + n, idx), axis=axis))
    if isinstance(idx, np.ndarray) and idx.ndim == 0:
        shape = imp.shape(data)
        ax = axis % len(shape)
        i = int(idx) % shape[ax]
        begin = tuple(i if d == ax else 0 for d in range(len(shape)))
        end = tuple(i + 1 if d == ax else s for d, s in enumerate(shape))
        sl = imp.emit("slice", [data], output=f"{imp.node_label}.slice", begin=begin, end=end,
                      step=(1,) * len(shape))
        return _reshape_to(imp, sl, shape[:ax] + shape[ax + 1:])
    if isinstance(idx, np.ndarray):
        idx = idx.astype(np.int64)
    return imp.emit("gather", [data, idx], axis=axis)


def _slice(imp: _Importer):
    x = imp.inp(0)
    shape = imp.shape(x)
    if imp.opset < 10:
        attrs = imp.attrs()
        starts, ends = list(_int_tuple(attrs["starts"])), list(_int_tuple(attrs["ends"]))
        axes = list(_ints(attrs.get("axes"), default=tuple(range(len(starts)))))
        steps = [1] * len(starts)
    else:
        starts = [int(v) for v in imp.required_const(1, "starts").reshape(-1)]
        ends = [int(v) for v in imp.required_const(2, "ends").reshape(-1)]
        ax = imp.const(3, "axes")
        axes = list(range(len(starts))) if ax is None else [int(v) for v in ax.reshape(-1)]
        st = imp.const(4, "steps")
        steps = [1] * len(starts) if st is None else [int(v) for v in st.reshape(-1)]
    begin, end, step = [0] * len(shape), list(shape), [1] * len(shape)
    for s, e, a, k in zip(starts, ends, axes, steps):
        a %= len(shape)
        if k == 0:
            raise imp.fail(f"step 0 on axis {a}")
        b, en, k = slice(s, e, k).indices(shape[a])
        begin[a], end[a], step[a] = b, en, k
    if isinstance(x, np.ndarray):
        return contiguous(x[tuple(slice(b, None if e < 0 else e, k) for b, e, k in zip(begin, end, step))])
    for a, (b, e, k) in enumerate(zip(begin, end, step)):
        if len(range(b, e, k)) == 0:
            raise imp.fail(f"the slice {b}:{e}:{k} of axis {a} (size {shape[a]}) is empty")
    if begin == [0] * len(shape) and end == list(shape) and step == [1] * len(shape):
        return x
    return imp.emit("slice", [x], begin=tuple(begin), end=tuple(end), step=tuple(step))


def _reduce(op: str, axes_input_from: int) -> Callable:
    """ReduceMean/Sum/Max/Min: axes from the attribute (older opsets) or the second input."""
    def convert(imp: _Importer):
        a = imp.attrs()
        x = imp.inp(0)
        rank = len(imp.shape(x))
        if imp.opset < axes_input_from:
            axes = _ints(a.get("axes"))
        else:
            c = imp.const(1, "axes")
            axes = None if c is None else tuple(int(v) for v in c.reshape(-1))
        if not axes:
            if int(a.get("noop_with_empty_axes", 0)):
                return x
            axes = tuple(range(rank))
        keep = bool(int(a.get("keepdims", 1)))
        if isinstance(x, np.ndarray):
            fold: dict[str, Callable[..., Any]] = {"reduce_mean": np.mean, "reduce_sum": np.sum,
                                                   "reduce_max": np.max, "reduce_min": np.min}
            return np.asarray(fold[op](x, axis=axes, keepdims=keep), dtype=x.dtype)
        return imp.emit(op, [x], axes=axes, keepdims=keep)
    return convert


def _identity(imp: _Importer):
    return imp.inp(0)


def _dropout(imp: _Importer):
    if len(imp.node.input) > 2 and imp.node.input[2]:
        mode = imp.const(2, "training_mode")
        if mode is not None and bool(mode.reshape(())):
            raise imp.fail("training_mode=True is not supported; export in eval mode")
    return imp.inp(0)


def _constant(imp: _Importer):
    a = imp.attrs()
    onnx = imp.onnx
    if "value" in a:
        return contiguous(onnx.numpy_helper.to_array(a["value"]))
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in a:
            return np.array(a[key], dtype=dtype)
    raise imp.fail(f"unsupported Constant attribute(s) {sorted(a)}")


def _shape(imp: _Importer):
    shape = imp.shape(imp.inp(0))
    a = imp.attrs()
    start, end = int(a.get("start", 0)), a.get("end")
    return np.array(shape[start: None if end is None else int(end)], dtype=np.int64)


def _cast_to(imp: _Importer, x: _Value, to: str) -> _Value:
    """A constant cast now; a run-time tensor only to its own dtype (kernels compute one dtype)."""
    if isinstance(x, np.ndarray):
        return x.astype(to)
    if imp.dtype(x) == to:
        return x
    raise imp.fail(f"casting a run-time tensor from {imp.dtype(x)} to {to} is not supported")


def _cast(imp: _Importer):
    return _cast_to(imp, imp.inp(0), imp._tensor_dtype(int(imp.attrs()["to"]), f"node {imp.node_label}"))


def _const_only(fn: Callable) -> Callable:
    """Ops evaluated only on constants (shape arithmetic); on run-time tensors they are unsupported."""
    def convert(imp: _Importer):
        ins = [imp.inp(i) if imp.node.input[i] else None for i in range(len(imp.node.input))]
        if any(isinstance(v, str) for v in ins):
            raise imp.fail(f"{imp.node.op_type} on a run-time tensor is not supported (only on constants, "
                           f"e.g. in shape computations)")
        return contiguous(fn(imp, ins))
    _CONSTANTS_ONLY.add(convert)
    return convert


_CONSTANTS_ONLY: set[Callable] = set()     # the converters _const_only made


def _folded_or(op: str, fn: Callable) -> Callable:
    """Folded with numpy when every input is a constant (shape arithmetic keeps its integer dtypes),
    else the graph op `op` on run-time tensors."""
    def convert(imp: _Importer):
        ins = [imp.inp(i) for i in range(len(imp.node.input))]
        if all(isinstance(v, np.ndarray) for v in ins):
            return contiguous(np.asarray(fn(*ins)))
        return imp.emit(op, ins)
    return convert


def _constant_of_shape(imp: _Importer, ins):
    a = imp.attrs()
    value = imp.onnx.numpy_helper.to_array(a["value"]).reshape(-1)[0] if "value" in a else np.float32(0)
    return np.full(tuple(int(v) for v in ins[0]), value, dtype=np.asarray(value).dtype)


def _global_avg_pool(imp: _Importer) -> _Value:
    _need_2d(imp, imp.inp(0))
    return imp.emit("global_avg_pool2d", [imp.inp(0)])


CONVERTERS: dict[str, Callable[[_Importer], _Value | tuple[_Value, ...]]] = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "Gemm": _gemm, "MatMul": _matmul,
    "BatchNormalization": _batch_norm, "LayerNormalization": _layer_norm,
    "MaxPool": _pool("max"), "AveragePool": _pool("avg"),
    "GlobalAveragePool": _global_avg_pool,
    "Softmax": _softmax, "ReduceMean": _reduce("reduce_mean", 18), "ReduceSum": _reduce("reduce_sum", 13),
    "Add": _binary("add"), "Sub": _binary("sub"), "Mul": _binary("mul"), "Div": _binary("div"),
    "Pow": _binary("pow"), "Max": _binary("maximum"), "Min": _binary("minimum"),
    "Relu": _unary("relu"), "Sigmoid": _unary("sigmoid"), "Tanh": _unary("tanh"), "Exp": _unary("exp"),
    "Log": _unary("log"), "Sqrt": _unary("sqrt"), "Erf": _unary("erf"), "Neg": _unary("neg"), "Abs": _unary("abs"),
    "Gelu": _gelu, "Clip": _clip,
    "Sum": _sum(mean=False), "Mean": _sum(mean=True), "PRelu": _prelu,
    "LeakyRelu": _activation("leaky_relu", ("alpha", "alpha")), "Elu": _activation("elu", ("alpha", "alpha")),
    "Selu": _activation("selu", ("alpha", "alpha"), ("gamma", "gamma")), "Softplus": _activation("softplus"),
    "HardSigmoid": _activation("hard_sigmoid", ("alpha", "alpha"), ("beta", "beta")),
    "HardSwish": _activation("hard_swish"), "Reciprocal": _activation("reciprocal"),
    "LogSoftmax": lambda imp: _softmax(imp, "log_softmax"), "LRN": _lrn,
    "InstanceNormalization": _instance_norm, "Pad": _pad, "Tile": _tile, "Split": _split,
    "ReduceMax": _reduce("reduce_max", 18), "ReduceMin": _reduce("reduce_min", 18),
    "GlobalMaxPool": _global_max_pool, "RMSNormalization": _rms_norm, "Expand": _expand,
    "CastLike": lambda imp: _cast_to(imp, imp.inp(0), imp.dtype(imp.inp(1))),
    "Softsign": _activation("softsign"), "Swish": _activation("swish", ("alpha", "alpha")),
    "ThresholdedRelu": _activation("thresholded_relu", ("alpha", "alpha")),
    "Shrink": _activation("shrink", ("lambd", "lambd"), ("bias", "bias")), "Sign": _activation("sign"),
    "Floor": _activation("floor"), "Ceil": _activation("ceil"),
    "Size": lambda imp: np.asarray(math.prod(imp.shape(imp.inp(0))), dtype=np.int64),
    "And": _folded_or("logical_and", np.logical_and),
    "Or": _folded_or("logical_or", np.logical_or),
    "Xor": _folded_or("logical_xor", np.logical_xor),
    "Reshape": _reshape, "Flatten": _flatten, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze,
    "Transpose": _transpose, "Concat": _concat, "Gather": _gather, "Slice": _slice,
    "Identity": _identity, "Dropout": _dropout, "Constant": _constant, "Shape": _shape, "Cast": _cast,
    "ConstantOfShape": _const_only(_constant_of_shape),
    "Range": _const_only(lambda imp, ins: np.arange(ins[0].reshape(()), ins[1].reshape(()), ins[2].reshape(()))),
    "Equal": _folded_or("equal", np.equal),
    "Less": _folded_or("less", np.less),
    "Greater": _folded_or("greater", np.greater),
    "LessOrEqual": _folded_or("less_equal", np.less_equal),
    "GreaterOrEqual": _folded_or("greater_equal", np.greater_equal),
    "Not": _folded_or("logical_not", np.logical_not),
    "Mod": _const_only(lambda imp, ins: np.fmod(ins[0], ins[1]) if imp.attrs().get("fmod", 0)
                       else np.mod(ins[0], ins[1])),
    "ReduceProd": _const_only(lambda imp, ins: np.prod(ins[0], keepdims=bool(imp.attrs().get("keepdims", 1)))),
    "Where": _folded_or("where", np.where),
}


MULTI_OUTPUT = {"Split", "LayerNormalization"}      # converters that return one value per node output


def supported_ops_table() -> str:
    """The README's table of supported ops, made from CONVERTERS (tests/test_onnx_docs.py keeps them equal)."""
    runtime = sorted(op for op, fn in CONVERTERS.items() if fn not in _CONSTANTS_ONLY)
    folded = sorted(op for op, fn in CONVERTERS.items() if fn in _CONSTANTS_ONLY)
    header = "| on run-time tensors (computed by tuned kernels) | on constants only (folded at import) |"
    return "\n".join([header, "|---|---|",
                      f"| {', '.join(runtime)} | {', '.join(folded)} |"])
