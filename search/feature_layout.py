"""The 164 features of one store statement, as TVM's feature.cc lays them out: one named table.

`LAYOUT` lists the groups in order (as TVM's FeatureSet); `OFFSET[group]` is where a group starts and
`COLUMN[group][field]` a field's place inside it, so no offset is written out anywhere else. The
buffer group repeats its fields for each of the MAX_N_BUFS accesses kept.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_N_BUFS = 5
CURVE_N = 10

OP_FIELDS = ("float_mad", "float_addsub", "float_mul", "float_divmod", "float_cmp", "float_mathfunc",
             "float_otherfunc", "int_mad", "int_addsub", "int_mul", "int_divmod", "int_cmp", "int_mathfunc",
             "int_otherfunc", "bool_op", "select_op")
POSITIONS = ("kPosNone", "kPosInnerSpatial", "kPosMiddleSpatial", "kPosOuterSpatial", "kPosInnerReduce",
             "kPosMiddleReduce", "kPosOuterReduce", "kPosMixed")
ANNOTATION_FIELDS = ("num", "prod", "len") + tuple(f"type.{p}" for p in POSITIONS)
GPU_FIELDS = ("is_gpu", "blockIdx_x_len", "blockIdx_y_len", "blockIdx_z_len", "threadIdx_x_len", "threadIdx_y_len",
              "threadIdx_z_len", "vthread_len")
BUFFER_FIELDS = ("acc_type.kRead", "acc_type.kWrite", "acc_type.kReadWrite", "bytes", "unique_bytes", "lines",
                 "unique_lines", "reuse_type.kLoopMultipleRead", "reuse_type.kSerialMultipleReadWrite",
                 "reuse_type.kNoReuse", "reuse_dis_iter", "reuse_dis_bytes", "reuse_ct", "bytes_d_reuse_ct",
                 "unique_bytes_d_reuse_ct", "lines_d_reuse_ct", "unique_lines_d_reuse_ct", "stride")
ALLOC_FIELDS = ("alloc_size", "alloc_prod", "alloc_outer_prod", "alloc_inner_prod", "outer_prod", "num_loops",
                "auto_unroll_max_step")


@dataclass(frozen=True)
class Group:
    name: str
    fields: tuple[str, ...]
    label: str                   # a column's name: formatted with group, field and copy
    copies: int = 1
    onehot: tuple[str, ...] = ()  # fields that are 0/1 flags (not log-scaled)

    @property
    def width(self) -> int:
        return len(self.fields) * self.copies

    def names(self) -> list[str]:
        return [self.label.format(group=self.name, field=f, copy=c) for c in range(self.copies) for f in self.fields]


_ANNOTATION_FLAGS = tuple(f"type.{p}" for p in POSITIONS)

LAYOUT = (
    Group("ops", OP_FIELDS, "{field}"),
    Group("vec", ANNOTATION_FIELDS, "{group}_{field}", onehot=_ANNOTATION_FLAGS),
    Group("unroll", ANNOTATION_FIELDS, "{group}_{field}", onehot=_ANNOTATION_FLAGS),
    Group("parallel", ANNOTATION_FIELDS, "{group}_{field}", onehot=_ANNOTATION_FLAGS),
    Group("gpu", GPU_FIELDS, "{field}", onehot=("is_gpu",)),
    Group("buffers", BUFFER_FIELDS, "B{copy}.{field}", MAX_N_BUFS,
          onehot=tuple(f for f in BUFFER_FIELDS if f.startswith(("acc_type.", "reuse_type.")))),
    Group("curve", tuple(str(i) for i in range(CURVE_N)), "arith_intensity_curve_{field}"),
    Group("alloc", ALLOC_FIELDS, "{field}"),
)

OFFSET: dict[str, int] = {}
_at = 0
for _g in LAYOUT:
    OFFSET[_g.name] = _at
    _at += _g.width
N_FEATURES = _at
assert N_FEATURES == 164, N_FEATURES

# a field's column inside its group (inside one copy, for the buffers)
COLUMN: dict[str, dict[str, int]] = {g.name: {f: j for j, f in enumerate(g.fields)} for g in LAYOUT}
BUF = COLUMN["buffers"]


def feature_names() -> list[str]:
    return [n for g in LAYOUT for n in g.names()]


def onehot_mask() -> list[bool]:
    """Columns that are one-hot flags (kept as 0/1); every other feature is log2(1 + |x|) * sign(x)."""
    return [g.fields[j % len(g.fields)] in g.onehot for g in LAYOUT for j in range(g.width)]
