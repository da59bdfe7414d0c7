"""The workloads tensortune and TVM's auto_scheduler share, and how their names and arguments map.

TVM names a registered workload by a JSON key, `["name", arg, ...]` (workload_registry.py's
make_workload_key; tuples become lists). A program in TVM's log only means something here when the
named function computes what one of ours computes, stage for stage and axis for axis, because TVM's
steps address stages and iterators by position. These do:

- TVM `matmul(n, m, k[, in_dtype, out_dtype])` (meta_schedule's te_workload, which auto_scheduler's
  tune_te registers) is our `matmul(N=n, M=m, K=k)`;
- TVM `matmul_auto_scheduler_test(N, M, K)` (tvm.testing.auto_scheduler) is our `matmul(N, M, K)`;
- TVM `matmul_add(N, L, M, dtype)` (the auto-scheduler tutorial) is our `matmul_add(N, M=M, K=L, dtype)`;
- TVM `conv2d_nchw(n, h, w, ci, co, kh, kw, stride, padding[, dilation, in_dtype, out_dtype])`
  (te_workload; topi.nn.conv2d_nchw) is our `conv2d(N, H, W, CI, CO, KH, KW, stride, padding,
  dilation, layout="NCHW")`;
- TVM `conv2d_layer(N, H, W, CO, CI, KH, KW, stride, padding)` (the CUDA conv2d tutorial:
  conv2d_nchw + a (1, CO, 1, 1) bias + relu) is our `conv2d_relu(N, H, W, CI, CO, KH, KW, stride,
  padding, bias=True)`: CO comes before CI in TVM's order, and our bias holds the same values as a
  (CO,) vector.

Conditions: float32 only where TVM's function has no dtype; stride, padding and dilation equal in
both dimensions (TVM's [1, 1] and 1 both read). At padding 0 topi's conv2d still makes its `pad_temp`
stage, a plain copy, where ours reads the data directly: `Resolved.tvm_dag` is then our DAG with that
copy put back, so TVM's stage numbers can be computed, and schedule.tvm_steps drops TVM's inlining
of it (and writes one for TVM). Export writes the first TVM name of each of ours (the te_workload
names, `matmul_add`, and `conv2d_layer` for conv2d_relu with bias, as its tutorial spells stride and
padding: [s, s]).

TVM keys a task extracted from a Relay/Relax network by an MD5 hash of its own printed DAG
(`["<hash>", shapes...]`), text tensortune cannot reproduce; such keys are not shared.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.te import Load, Tensor
from tensortune.tasks.workload_registry import make_dag


class UnsharedWorkload(ValueError):
    """A TVM workload key, or a tensortune task, that has no counterpart in the other tool (says why)."""


Args = dict[str, Any]


@dataclass(frozen=True)
class SharedWorkload:
    """One TVM workload function and the tensortune workload that computes the same."""

    tvm_name: str
    name: str                                      # ours, in tasks.workload_registry
    tvm_params: tuple[tuple[str, Any], ...]        # TVM's parameters in order, with defaults (REQUIRED: none)
    to_ours: Callable[[Args], Args]                # TVM's bound arguments -> our keyword arguments
    to_tvm: Callable[[Args], list]                 # our keyword arguments -> TVM's argument list
    exported: bool = True                          # the TVM name export writes for `name`

    def bind(self, args: list) -> Args:
        if len(args) > len(self.tvm_params):
            raise UnsharedWorkload(f"{self.tvm_name} takes {len(self.tvm_params)} arguments, the key gives "
                                   f"{len(args)}")
        bound = dict(zip((p for p, _ in self.tvm_params), args))
        for param, default in self.tvm_params[len(args):]:
            if default is REQUIRED:
                raise UnsharedWorkload(f"{self.tvm_name}: the key lacks argument {param!r}")
            bound[param] = default
        return bound


REQUIRED = object()


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsharedWorkload(f"{what} must be an integer, got {value!r}")
    return value


def _same_pair(value: Any, what: str) -> int:
    """TVM's stride/padding/dilation: an int or [a, b]; ours is one int for both dimensions."""
    if isinstance(value, list):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsharedWorkload(f"{what} {value} differs between height and width; tensortune's conv2d "
                                   "takes one value for both")
        value = value[0]
    return _int(value, what)


def _padding(value: Any) -> int:
    pad = _same_pair(value, "padding")
    if pad < 0:
        raise UnsharedWorkload(f"padding {pad} is negative")
    return pad


def _dtype(bound: Args, *names: str) -> str:
    dtypes = {bound[n] for n in names}
    if len(dtypes) != 1:
        raise UnsharedWorkload(f"mixed dtypes {sorted(dtypes)}: tensortune's workload has one dtype")
    return dtypes.pop()


def _sizes(bound: Args, mapping: dict[str, str]) -> Args:
    return {ours: _int(bound[tvm], tvm) for ours, tvm in mapping.items()}


def _matmul_te(bound: Args) -> Args:
    return {**_sizes(bound, {"N": "n", "M": "m", "K": "k"}), "dtype": _dtype(bound, "in_dtype", "out_dtype")}


def _matmul_te_back(ours: Args) -> list:
    args: list = [ours["N"], ours["M"], ours["K"]]
    return args if ours["dtype"] == "float32" else args + [ours["dtype"], ours["dtype"]]


def _matmul_test(bound: Args) -> Args:
    return {**_sizes(bound, {"N": "N", "M": "M", "K": "K"}), "dtype": "float32"}


def _float32_only(ours: Args) -> None:
    if ours.get("dtype", "float32") != "float32":
        raise UnsharedWorkload(f"dtype {ours['dtype']}: the TVM workload is float32 only")


def _matmul_test_back(ours: Args) -> list:
    _float32_only(ours)
    return [ours["N"], ours["M"], ours["K"]]


def _matmul_add(bound: Args) -> Args:
    return {**_sizes(bound, {"N": "N", "M": "M", "K": "L"}), "dtype": bound["dtype"]}


def _matmul_add_back(ours: Args) -> list:
    return [ours["N"], ours["K"], ours["M"], ours["dtype"]]


_CONV_SIZES = {"N": "n", "H": "h", "W": "w", "CI": "ci", "CO": "co", "KH": "kh", "KW": "kw"}


def _conv2d_te(bound: Args) -> Args:
    return {**_sizes(bound, _CONV_SIZES), "stride": _same_pair(bound["stride"], "stride"),
            "padding": _padding(bound["padding"]), "dilation": _same_pair(bound["dilation"], "dilation"),
            "layout": "NCHW", "dtype": _dtype(bound, "in_dtype", "out_dtype")}


def _conv2d_te_back(ours: Args) -> list:
    if ours["layout"] != "NCHW":
        raise UnsharedWorkload(f"layout {ours['layout']}: the shared conv2d is NCHW")
    _padding(ours["padding"])
    args = [ours[k] for k in _CONV_SIZES] + [ours["stride"], ours["padding"], ours["dilation"]]
    return args if ours["dtype"] == "float32" else args + [ours["dtype"], ours["dtype"]]


_LAYER_SIZES = {"N": "N", "H": "H", "W": "W", "CI": "CI", "CO": "CO", "KH": "KH", "KW": "KW"}


def _conv2d_layer(bound: Args) -> Args:
    return {**_sizes(bound, _LAYER_SIZES), "stride": _same_pair(bound["stride"], "stride"),
            "padding": _padding(bound["padding"]), "bias": True, "dtype": "float32"}


def _conv2d_layer_back(ours: Args) -> list:
    _float32_only(ours)
    if not ours["bias"]:
        raise UnsharedWorkload("conv2d_relu without bias: TVM's conv2d_layer adds a bias")
    _padding(ours["padding"])
    return [ours["N"], ours["H"], ours["W"], ours["CO"], ours["CI"], ours["KH"], ours["KW"],
            [ours["stride"]] * 2, [ours["padding"]] * 2]


SHARED: tuple[SharedWorkload, ...] = (
    SharedWorkload("matmul", "matmul", (("n", REQUIRED), ("m", REQUIRED), ("k", REQUIRED),
                                        ("in_dtype", "float32"), ("out_dtype", "float32")),
                   _matmul_te, _matmul_te_back),
    SharedWorkload("matmul_auto_scheduler_test", "matmul", (("N", REQUIRED), ("M", REQUIRED), ("K", REQUIRED)),
                   _matmul_test, _matmul_test_back, exported=False),
    SharedWorkload("matmul_add", "matmul_add", (("N", REQUIRED), ("L", REQUIRED), ("M", REQUIRED),
                                                ("dtype", REQUIRED)), _matmul_add, _matmul_add_back),
    SharedWorkload("conv2d_nchw", "conv2d", tuple((p, REQUIRED) for p in _CONV_SIZES.values()) + (
        ("stride", REQUIRED), ("padding", REQUIRED), ("dilation", 1), ("in_dtype", "float32"),
        ("out_dtype", "float32")), _conv2d_te, _conv2d_te_back),
    SharedWorkload("conv2d_layer", "conv2d_relu", (("N", REQUIRED), ("H", REQUIRED), ("W", REQUIRED),
                                                   ("CO", REQUIRED), ("CI", REQUIRED), ("KH", REQUIRED),
                                                   ("KW", REQUIRED), ("stride", REQUIRED), ("padding", REQUIRED)),
                   _conv2d_layer, _conv2d_layer_back),
)
BY_TVM_NAME = {w.tvm_name: w for w in SHARED}
EXPORTED = {w.name: w for w in SHARED if w.exported}


@dataclass(frozen=True)
class Resolved:
    """A TVM workload key resolved to our workload: its name, arguments and DAG, and the DAG as TVM's
    function builds it where that has a stage ours lacks (else ours)."""

    shared: SharedWorkload
    args: Args
    dag: ComputeDAG
    tvm_dag: ComputeDAG

    @property
    def name(self) -> str:
        return self.shared.name


def with_copy_stage(dag: ComputeDAG, source: str, reader: str, name: str) -> ComputeDAG:
    """`dag` with the plain copy stage TVM's graph has between `source` and its reader `reader` (topi's
    pad at padding 0, named `name`), every later tensor rebuilt over it."""
    src = dag.tensor(source)
    copy = te.compute(src.shape, lambda *i: src[i], name=name)
    remap: dict[Tensor, Tensor] = {}
    for t in dag.tensors:
        if t.body is None:
            continue
        targets = {src: copy} if t.name == reader else {}
        targets.update(remap)
        body = te.transform(t.body, lambda n: Load(targets[n.tensor], n.indices)
                            if isinstance(n, Load) and n.tensor in targets else None)
        if body is not t.body:
            remap[t] = Tensor(t.name, t.shape, t.dtype, t.axes, body, t.attrs)
    return ComputeDAG([remap.get(a, a) for a in dag.args], name=dag.name)


def tvm_form(name: str, args: Args, dag: ComputeDAG) -> ComputeDAG:
    """The DAG of our workload `name(**args)` as TVM's shared function builds it (stage for stage)."""
    if name in ("conv2d", "conv2d_relu") and args["padding"] == 0:
        conv = next(t for t in dag.tensors if t.name.startswith("conv2d_nchw"))
        return with_copy_stage(dag, dag.inputs[0].name, conv.name, "pad_temp")
    return dag


def tvm_key(name: str, args: list) -> str:
    """TVM's workload key for a registered function and its arguments (json.dumps of [name, *args])."""
    return json.dumps([name, *args])


def from_tvm_key(key: str) -> Resolved:
    """Our workload for a TVM workload key; UnsharedWorkload says why there is none."""
    try:
        parsed = json.loads(key)
    except json.JSONDecodeError:
        raise UnsharedWorkload(f"workload key {key!r:.80} is not JSON") from None
    if not isinstance(parsed, list) or not parsed or not isinstance(parsed[0], str):
        raise UnsharedWorkload(f"workload key {key!r:.80} is not [name, args...]")
    name, args = parsed[0], parsed[1:]
    if re.fullmatch(r"[0-9a-f]{32}", name):
        raise UnsharedWorkload("a ComputeDAG hash key (a task TVM extracted from a network, keyed by the MD5 of "
                               "its own DAG text, which tensortune cannot recompute)")
    shared = BY_TVM_NAME.get(name)
    if shared is None:
        raise UnsharedWorkload(f"TVM workload {name!r} has no tensortune counterpart; shared: "
                               f"{', '.join(sorted(BY_TVM_NAME))}")
    ours = shared.to_ours(shared.bind(args))
    try:
        dag = make_dag(shared.name, **ours)
    except (TypeError, ValueError) as err:
        raise UnsharedWorkload(f"{name}{args}: {err}") from None
    return Resolved(shared, ours, dag, tvm_form(shared.name, ours, dag))


def to_tvm_key(name: str, args: Args) -> str:
    """The key TVM knows our workload `name(**args)` by (the exported TVM name of `name`)."""
    shared = EXPORTED.get(name)
    if shared is None:
        raise UnsharedWorkload(f"tensortune workload {name!r} has no TVM counterpart; shared: "
                               f"{', '.join(sorted(EXPORTED))}")
    return tvm_key(shared.tvm_name, shared.to_tvm(args))


# ------------------------------------------------------------------------------ records -> arguments


def _shapes(signature: str) -> list[tuple[int, ...]] | None:
    """The argument shapes of a ComputeDAG.shape_signature ('128x64, 64x32 -> 128x32'), inputs then
    outputs; None when the text is not one."""
    if "->" not in signature:
        return None
    out = []
    for part in re.split(r",\s*|\s*->\s*", signature.strip()):
        if not re.fullmatch(r"\d+(x\d+)*", part):
            return None
        out.append(tuple(int(d) for d in part.split("x")))
    return out


def _conv_candidates(shapes: list[tuple[int, ...]]) -> list[Args]:
    (n, ci, h, w), (co, _, kh, kw), *rest = shapes
    oh, ow = rest[-1][2], rest[-1][3]
    found = []
    for dilation in (1, 2, 3):
        for stride in range(1, max(kh, kw, 2) + 3):
            for pad in range(0, max(kh, kw) + 1):
                if (h + 2 * pad - dilation * (kh - 1) - 1) // stride + 1 == oh and \
                        (w + 2 * pad - dilation * (kw - 1) - 1) // stride + 1 == ow:
                    found.append({"N": n, "H": h, "W": w, "CI": ci, "CO": co, "KH": kh, "KW": kw,
                                  "stride": stride, "padding": pad, "dilation": dilation})
    return found


def candidates(name: str, signature: str) -> list[Args]:
    """Our arguments that could have made a task `name` with these argument shapes (the record store
    keeps the task's name and label, not its arguments); the caller confirms by the workload key."""
    shapes = _shapes(signature)
    if shapes is None:
        return []
    try:
        if name == "matmul" and len(shapes) == 3:
            (n, k), (_, m) = shapes[0], shapes[1]
            return [{"N": n, "M": m, "K": k, "dtype": "float32"}]
        if name == "matmul_add" and len(shapes) == 4:
            (n, k), (_, m) = shapes[0], shapes[1]
            return [{"N": n, "M": m, "K": k, "dtype": "float32"}]
        if name == "conv2d" and len(shapes) == 3:
            return [{**c, "layout": "NCHW", "dtype": "float32"} for c in _conv_candidates(shapes)]
        if name == "conv2d_relu" and len(shapes) == 4:
            return [{**{k: v for k, v in c.items() if k != "dilation"}, "bias": True, "dtype": "float32"}
                    for c in _conv_candidates(shapes) if c["dilation"] == 1]
    except (ValueError, IndexError):
        return []
    return []


def resolve_task(name: str, label: str, workload_key: str) -> Resolved:
    """Our workload `name` with the arguments of a stored task whose label reads `label` and whose key is
    `workload_key` (the key, a hash of the DAG, confirms the arguments)."""
    if name not in EXPORTED:
        raise UnsharedWorkload(f"tasks of {name or 'unnamed workloads'} have no TVM counterpart; shared: "
                               f"{', '.join(sorted(EXPORTED))}")
    signature = label[len(name):].strip() if label.startswith(name) else ""
    for args in candidates(name, signature):
        try:
            dag = make_dag(name, **args)
        except (TypeError, ValueError):
            continue
        if dag.workload_key == workload_key:
            return Resolved(EXPORTED[name], args, dag, tvm_form(name, args, dag))
    raise UnsharedWorkload(f"no arguments of {name} give workload key {workload_key} (label {label!r}; a record "
                           "written before labels were stored, or a shape the TVM workload cannot take)")
