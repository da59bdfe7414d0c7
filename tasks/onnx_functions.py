"""ONNX ops that the importer has no converter for, replaced by their ONNX function bodies.

Many ONNX ops (Attention, RMSNormalization, MeanVarianceNormalization, Celu, Mish, ...) are defined by
the standard as functions of simpler ops, and `onnx.defs` carries those bodies (fixed, or built for the
node's attributes and input types: "context-dependent"). Importing such a node by its body gives the
op's exact ONNX semantics from ONNX's own definition, rather than from a converter written here, and
the body's ops are what the extractor fuses and the search schedules anyway.

How: each such node becomes a call of a model-local function holding its body, and
`onnx.inliner.inline_local_functions` substitutes the calls (renaming the body's values, binding
attribute references); bodies that call other function ops are expanded again, a few rounds at most.
"""
from __future__ import annotations

from typing import Any

LOCAL_DOMAIN = "tensortune.expanded"
MAX_ROUNDS = 4


def _onnx() -> Any:
    import onnx  # the caller (onnx_import) has already checked that onnx is installed
    import onnx.inliner  # noqa: F401 - a submodule `import onnx` does not load
    return onnx


def _input_types(onnx: Any, model: Any) -> dict[str, Any]:
    """Every value's TypeProto that shape inference can tell (graph inputs, initializers, node outputs)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type for v in list(g.input) + list(g.value_info) + list(g.output)}
    for t in g.initializer:
        if t.name not in types:
            types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types


def _body(onnx: Any, node: Any, opset: int, types: dict[str, Any]) -> Any | None:
    """The FunctionProto of `node`'s op at `opset` (None: the op has no function body)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    if schema.has_function:
        body = schema.get_function_with_opset_version(opset) or schema.function_body
        fn = onnx.FunctionProto()                # bytes, or a proto of the schema's own class: copy by bytes
        fn.ParseFromString(body if isinstance(body, bytes) else body.SerializeToString())
        return fn
    if schema.has_context_dependent_function:
        if any(i and i not in types for i in node.input):
            return None                          # an input's type is unknown: cannot build the body
        empty = onnx.TypeProto()
        blob = schema.get_context_dependent_function_with_opset_version(
            opset, node.SerializeToString(), [(types[i] if i else empty).SerializeToString() for i in node.input])
        if not blob:
            return None
        fn = onnx.FunctionProto()
        fn.ParseFromString(blob)
        return fn
    return None


def _with_defaults(onnx: Any, node: Any, schema: Any) -> None:
    """Give `node` every attribute its schema defaults and it does not set: a body refers to them
    (`@axes`), and an old-style function body does not carry the defaults itself (MVN's axes)."""
    have = {a.name for a in node.attribute}
    for name, spec in schema.attributes.items():
        default = spec.default_value
        if name not in have and default is not None and default.type != onnx.AttributeProto.UNDEFINED:
            attr = onnx.AttributeProto()
            attr.ParseFromString(default.SerializeToString())
            attr.name = name
            node.attribute.append(attr)


def expand_functions(model: Any, supported: set[str]) -> Any:
    """A copy of `model` in which every default-domain node whose op is not in `supported` and has an
    ONNX function body is replaced by that body (the model itself is returned when nothing changes)."""
    onnx = _onnx()
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    current = model
    for round_ in range(MAX_ROUNDS):
        nodes = current.graph.node
        wanted = [i for i, n in enumerate(nodes) if n.domain in ("", "ai.onnx") and n.op_type not in supported]
        if not wanted:
            break
        types = _input_types(onnx, current)
        bodies = {i: fn for i in wanted if (fn := _body(onnx, nodes[i], opset, types)) is not None}
        if not bodies:
            break
        expanded = onnx.ModelProto()
        expanded.CopyFrom(current)
        for i, fn in bodies.items():
            node = expanded.graph.node[i]
            _with_defaults(onnx, node, onnx.defs.get_schema(node.op_type, opset, ""))
            local = onnx.FunctionProto()
            local.CopyFrom(fn)
            local.domain, local.name = LOCAL_DOMAIN, f"{node.op_type}_{round_}_{i}"
            node.domain, node.op_type = LOCAL_DOMAIN, local.name
            expanded.functions.append(local)
        if not any(o.domain == LOCAL_DOMAIN for o in expanded.opset_import):
            expanded.opset_import.append(onnx.helper.make_opsetid(LOCAL_DOMAIN, 1))
        current = onnx.inliner.inline_local_functions(expanded)
    return current
