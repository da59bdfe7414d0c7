"""The 164 features hold the right numbers, not just the right shape: for a handful of hand-made programs
every buffer-access feature (bytes, unique bytes, cache lines, reuse type, distance and count, stride),
the loop and annotation features and the allocation features equal values worked out by hand from
TVM's definitions (src/auto_scheduler/feature.cc; the first program is the one of TVM's own
tests/python/unittest/test_auto_scheduler_feature.py), where search/feature.py's docstring lists the
few places it differs on purpose.

Features are stored as log2(1 + x) (sign kept); `rows` undoes that, so the numbers below are raw.
Cache lines are 64 bytes on the CPU target, elements are float32 (4 bytes).
"""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.target import make_task
from tensortune.schedule.state import State
from tensortune.search.feature import _ONEHOT, FeatureExtractor
from tensortune.search.feature_layout import MAX_N_BUFS, feature_names
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.workload_registry import make_dag

NAMES = feature_names()
LINE = 64
FIELDS = ("acc_type.kRead", "acc_type.kWrite", "acc_type.kReadWrite", "bytes", "unique_bytes", "lines",
          "unique_lines", "reuse_type.kLoopMultipleRead", "reuse_type.kSerialMultipleReadWrite",
          "reuse_type.kNoReuse", "reuse_dis_iter", "reuse_dis_bytes", "reuse_ct", "bytes_d_reuse_ct",
          "unique_bytes_d_reuse_ct", "lines_d_reuse_ct", "unique_lines_d_reuse_ct", "stride")


def rows(state: State) -> dict[str, dict[str, float]]:
    """Each stage's feature row by stage name, as raw numbers keyed by feature name."""
    task = make_task(state.dag)
    assert task.hardware.cache_line_bytes == LINE
    (feats,) = FeatureExtractor(task)([state])
    stages = [s.name for s in state.stages if not s.is_placeholder and s.compute_at != "inline"]
    assert feats.shape == (len(stages), len(NAMES))
    raw = np.where(_ONEHOT, feats, np.sign(feats) * (np.exp2(np.abs(feats)) - 1))
    return {name: dict(zip(NAMES, map(float, r))) for name, r in zip(stages, raw)}


def buf(acc: str, bytes_: float, unique: float, lines: float, unique_lines: float, stride: float,
        reuse: tuple[float, float, float] | None) -> dict[str, float]:
    """One buffer's 18 features; reuse = (distance in iterations, distance in bytes, count) of a
    loop-multiple-read reuse, or None. The four x_d_reuse_ct are x / count, or x * 2 without reuse."""
    f = dict.fromkeys(FIELDS, 0.0)
    f[f"acc_type.{acc}"] = 1.0
    f.update(bytes=bytes_, unique_bytes=unique, lines=lines, unique_lines=unique_lines, stride=stride)
    if reuse is None:
        f["reuse_type.kNoReuse"] = 1.0
        ct, scale = 0.0, 2.0
    else:
        f["reuse_type.kLoopMultipleRead"] = 1.0
        f["reuse_dis_iter"], f["reuse_dis_bytes"], ct = reuse
        f["reuse_ct"], scale = ct, 1.0 / ct
    for x in ("bytes", "unique_bytes", "lines", "unique_lines"):
        f[f"{x}_d_reuse_ct"] = f[x] * scale
    return f


def assert_buffers(row: dict[str, float], expected: dict[str, dict[str, float]]) -> None:
    """The row's buffer slots hold exactly the expected accesses (any order among equal (lines, bytes)),
    sorted by (lines, bytes) descending, then zero-filled."""
    slots = [{x: row[f"B{b}.{x}"] for x in FIELDS} for b in range(MAX_N_BUFS)]
    used = [s for s in slots if any(s[f"acc_type.{a}"] for a in ("kRead", "kWrite", "kReadWrite"))]
    assert len(used) == len(expected) and all(not any(s.values()) for s in slots[len(used):]), slots
    keys = [(s["lines"], s["bytes"]) for s in used]
    assert keys == sorted(keys, reverse=True), keys
    left = list(used)
    for label, want in expected.items():
        hit = [s for s in left if all(s[k] == pytest.approx(v, rel=1e-6, abs=1e-9) for k, v in want.items())]
        assert hit, f"{label}: no buffer slot holds {want}\nslots: {used}"
        left.remove(hit[0])


def assert_entries(row: dict[str, float], **expected: float) -> None:
    for name, want in expected.items():
        assert row[name] == pytest.approx(want, rel=1e-6, abs=1e-9), f"{name}: {row[name]} != {want}"


def annotation(kind: str, loops: list[int] | None) -> dict[str, float]:
    """vec/unroll/parallel: number of such loops, product and innermost extent, position kPosMixed;
    kPosNone without any."""
    if not loops:
        return {f"{kind}_num": 0, f"{kind}_prod": 0, f"{kind}_len": 0, f"{kind}_type.kPosNone": 1,
                f"{kind}_type.kPosMixed": 0}
    return {f"{kind}_num": len(loops), f"{kind}_prod": float(np.prod(loops)), f"{kind}_len": loops[-1],
            f"{kind}_type.kPosNone": 0, f"{kind}_type.kPosMixed": 1}


def test_tvm_cpu_matmul():
    """TVM's test_cpu_matmul, same schedule and shapes:

        parallel i.0 (0,32)
          parallel j.0 (0,64)
            unroll k (0,512)
              vectorize j.1 (0,8)
                for i.1 (0,16)
                  C[i.0*16 + i.1, j.0*8 + j.1] += A[i.0*16 + i.1, k] * B[k, j.0*8 + j.1]
    """
    s = State(make_dag("matmul", 512, 512, 512)).split("C", 0, [16]).split("C", 2, [8])
    s = s.reorder("C", [0, 2, 4, 3, 1]).vectorize("C", 3).parallel("C", 0).parallel("C", 1).unroll("C", 2)
    row = rows(s)["C"]
    n = 32 * 64 * 512 * 8 * 16                            # 2**27 iterations of the store
    assert_entries(row, outer_prod=n, num_loops=5, float_mul=n, float_addsub=n, float_divmod=0, float_cmp=0,
                   float_mathfunc=0, auto_unroll_max_step=0, is_gpu=0, vthread_len=1, blockIdx_x_len=1,
                   threadIdx_x_len=1, alloc_size=0, alloc_prod=0, alloc_outer_prod=0, alloc_inner_prod=0,
                   **annotation("vec", [8]), **annotation("unroll", [512]), **annotation("parallel", [32, 64]))
    whole = 512 * 512 * 4                                 # each matrix is touched whole: 1 MiB
    assert_buffers(row, {
        # C: innermost loop i.1 moves dim 0, so stride = 1 * 512 (TVM's test: log2(512**3 * 4 + 1) bytes).
        # Lines: every iteration starts a line (512 * 4 >= 64). Unique lines: the innermost full dimension
        # is 512 wide (2 KiB contiguous), so 1 MiB / 64. Reuse: k is the innermost loop C does not use;
        # inside it j.1 x i.1 = 128 iterations touch C 16*8, A 16 and B 8 elements (TVM's (128+16+8)*4),
        # and k runs 512 times.
        "C": buf("kReadWrite", n * 4, whole, n, whole / LINE, 512, (8 * 16, (16 * 8 + 16 + 8) * 4, 512)),
        # A[i, k]: i.1 is innermost, stride 512 again. Reuse at j.1 (8 times): inside it i.1 alone
        # touches C 16, A 16, B 1 elements.
        "A": buf("kRead", n * 4, whole, n, whole / LINE, 512, (16, (16 + 16 + 1) * 4, 8)),
        # B[k, j]: i.1 is not used; j.1 (one loop out) moves dim 1, stride 1, but the stride feature is
        # kept only for the innermost loop, so 0. Lines: n / 16 (the skipped i.1) * (1 * 4 / 64).
        # Reuse at i.1, the innermost loop (16 times): distance 1 iteration and one element of each of
        # the three accesses.
        "B": buf("kRead", n * 4, whole, n / 16 * 4 / LINE, whole / LINE, 0, (1, 3 * 4, 16)),
    })
    # the arithmetic intensity at the outermost level: 2 flops per iteration over the 3 MiB touched
    assert row["arith_intensity_curve_9"] == pytest.approx(2 * n / (3 * whole))


def _producer_consumer():
    a = te.placeholder((64, 32), name="A")
    b = te.compute((64, 32), lambda i, j: a[i, j] + 1.0, name="B")
    c = te.compute((64, 32), lambda i, j: b[i, j] * 2.0, name="C")
    return ComputeDAG([a, c])


def test_stage_computed_at_an_outer_loop_reads_a_new_row_each_time():
    """B computed at C's row loop (TVM's test_cpu_fusion, one level out):

        for i (0,64)
          allocate B[1, 32] (local)
          for i' (0,1)                 # B's own loops over its region: i' has extent 1, so it is no
            for j' (0,32)              # loop in the code (TVM's lowering drops it) and num_loops is 2
              B[i', j'] = A[i + i', j'] + 1
          for j (0,32)
            C[i, j] = B[0, j] * 2

    A is read at row i + i': a new row every iteration of i, so it has no reuse and all of A is
    touched; B is written and read at the same 32 places every iteration of i."""
    r = rows(State(_producer_consumer()).compute_at("B", "C", 0))
    n = 64 * 32
    b, c = r["B"], r["C"]
    # B: alloc 32 floats once per i (64 times), the store runs 32 times per allocation
    assert_entries(b, outer_prod=n, num_loops=2, float_addsub=n, float_mul=0, alloc_size=32 * 4,
                   alloc_outer_prod=64, alloc_prod=32 * 64, alloc_inner_prod=32, **annotation("vec", None),
                   **annotation("parallel", None), **annotation("unroll", None))
    assert_buffers(b, {
        # region [1, 32] is its whole shape: 32 contiguous floats (128 bytes = 2 lines) touched; i is
        # the innermost loop B does not use: inside it 32 iterations touch 32 of B and 32 of A; i runs
        # 64 times
        "B": buf("kWrite", n * 4, 32 * 4, n * 4 / LINE, 32 * 4 / LINE, 1, (32, (32 + 32) * 4, 64)),
        # A: stride 1 along j', one line per 16 iterations; all 64 rows are touched, no reuse
        "A": buf("kRead", n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None),
    })
    assert_entries(c, outer_prod=n, num_loops=2, float_mul=n, float_addsub=0, alloc_size=0)
    assert_buffers(c, {
        "C": buf("kWrite", n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None),
        # B[0, j]: the same 32 floats for every i, read 64 times; inside i, 32 iterations touch 32 of
        # C and 32 of B
        "B": buf("kRead", n * 4, 32 * 4, n * 4 / LINE, 32 * 4 / LINE, 1, (32, (32 + 32) * 4, 64)),
    })


def test_cache_write_tile_reads_its_operands_through_the_outer_tile_loops():
    """A 32x32x32 matmul with an 8x8 register tile (cache_write, then computed at C's tile loop):

        for i.0 (0,4)
          for j.0 (0,4)
            allocate C.local[8, 8]
            for i (0,8)  for j (0,8)  for k (0,32)
              C.local[i, j] += A[i.0*8 + i, k] * B[k, j.0*8 + j]
            for i.1 (0,8)  for j.1 (0,8)
              C[i.0*8 + i.1, j.0*8 + j.1] = C.local[i.1, j.1]
    """
    s = State(make_dag("matmul", 32, 32, 32)).cache_write("C", "local")
    s = s.split("C", 0, [8]).split("C", 2, [8]).reorder("C", [0, 2, 1, 3]).compute_at("C.local", "C", 1)
    r = rows(s)
    n = 4 * 4 * 8 * 8 * 32
    loc = r["C.local"]
    assert_entries(loc, outer_prod=n, num_loops=5, float_mul=n, float_addsub=n, alloc_size=64 * 4,
                   alloc_outer_prod=16, alloc_prod=64 * 16, alloc_inner_prod=n / 16)
    whole = 32 * 32 * 4
    assert_buffers(loc, {
        # B[k, j.0*8 + j]: k, the innermost loop, moves dim 0: stride 32, and every iteration starts
        # a line (32 * 4 >= 64). All of B is touched over the outer tile loops. Reuse at i (8 times):
        # inside it j x k = 256 iterations touch C.local 8, A 32 (one row) and B 32x8 elements.
        "B": buf("kRead", n * 4, whole, n, whole / LINE, 32, (8 * 32, (8 + 32 + 32 * 8) * 4, 8)),
        # A[i.0*8 + i, k]: stride 1 along k; all 32 rows are touched across i.0. Reuse at j (8 times):
        # inside it k alone touches C.local 1, A 32 and B 32 elements.
        "A": buf("kRead", n * 4, whole, n * 4 / LINE, whole / LINE, 1, (32, (1 + 32 + 32) * 4, 8)),
        # C.local[i, j]: k is skipped (lines / 32), then j moves dim 1 with stride 1, not the innermost
        # loop, so the stride feature is 0. The whole 8x8 tile (32 contiguous bytes per row) is touched.
        # Reuse at k, the innermost loop (32 times): 1 iteration, one element of each access.
        "C.local": buf("kReadWrite", n * 4, 64 * 4, n / 32 * 4 / LINE, 64 * 4 / (8 * 4), 0, (1, 3 * 4, 32)),
    })
    c = r["C"]
    m = 32 * 32
    assert_entries(c, outer_prod=m, num_loops=4, float_mul=0, float_addsub=0, arith_intensity_curve_9=0,
                   alloc_size=0)
    assert_buffers(c, {
        "C": buf("kWrite", m * 4, m * 4, m * 4 / LINE, m * 4 / LINE, 1, None),
        # C.local[i.1, j.1]: the tile, the same 64 floats for each (i.0, j.0); j.0 is the innermost loop
        # it does not use: inside it i.1 x j.1 = 64 iterations touch 64 of C and 64 of C.local
        "C.local": buf("kRead", m * 4, 64 * 4, m * 4 / LINE, 64 * 4 / (8 * 4), 1, (64, (64 + 64) * 4, 4)),
    })


def test_loops_of_extent_one_are_no_loops():
    """A 64³ matmul whose 8-row tile sits outside k, under a split that leaves an innermost loop of
    extent 1, and its twin with the tile inside k:

        for i.0 (0,8)  for j (0,64)  for i.1 (0,8)  for k (0,64)  for i.2 (0,1)      (i.1 outside k)
        for i.0 (0,8)  for j (0,64)  for i.1 (0,1)  for k (0,64)  for i.2 (0,8)      (i.2 inside k)

    TVM's lowering drops loops of extent 1, so its features see i.0, j, i.1, k and i.0, j, k, i.2.
    Taken as loops, i.2 of the first made B's reuse (at the innermost loop B does not use) 1 iteration
    away and 1 time, and A's stride that of a row: both programs had one feature row, and on Zen 4 such
    twins ran at 164 and 20 GFLOP/s."""
    base = State(make_dag("matmul", 64, 64, 64))
    outside = rows(base.split("C", 0, [8, 1]).reorder("C", [0, 3, 1, 4, 2]))["C"]
    inside = rows(base.split("C", 0, [1, 8]).reorder("C", [0, 3, 1, 4, 2]))["C"]
    n = 64 ** 3
    whole = 64 * 64 * 4
    assert_entries(outside, outer_prod=n, num_loops=4)
    assert_buffers(outside, {
        # C[i, j]: i.1 moves dim 0 (64 elements), not the innermost real loop: stride feature 0; the
        # lines skip k. Reuse at k (64 times), the extent-1 i.2 inside it: one element of each access.
        "C": buf("kReadWrite", n * 4, whole, n / 64, whole / LINE, 0, (1, 3 * 4, 64)),
        # A[i, k]: k is the innermost real loop and moves dim 1: stride 1 (i.2 would have made it 64).
        # Reuse at j (64 times): inside it i.1 x k = 512 iterations touch C 8, A 8x64 and B 64 elements.
        "A": buf("kRead", n * 4, whole, n * 4 / LINE, whole / LINE, 1, (512, (8 + 512 + 64) * 4, 64)),
        # B[k, j]: k moves dim 0: stride 64. Reuse at i.1 (8 times), 64 iterations of k away, which
        # touch C 1, A 64 and B 64 elements.
        "B": buf("kRead", n * 4, whole, n, whole / LINE, 64, (64, (1 + 64 + 64) * 4, 8)),
    })
    assert_entries(inside, outer_prod=n, num_loops=4)
    assert_buffers(inside, {
        # C[i, j]: i.2 moves dim 0 innermost: stride 64, a new line every iteration. Reuse at k (64
        # times): inside it i.2 touches C 8, A 8 and B 1 elements.
        "C": buf("kReadWrite", n * 4, whole, n, whole / LINE, 64, (8, (8 + 8 + 1) * 4, 64)),
        "A": buf("kRead", n * 4, whole, n, whole / LINE, 64, (512, (8 + 512 + 64) * 4, 64)),
        # B[k, j]: reuse at i.2, the innermost loop, 8 times, 1 iteration away
        "B": buf("kRead", n * 4, whole, n / 8, whole / LINE, 0, (1, 3 * 4, 8)),
    })


def test_annotated_loops_of_extent_one_are_no_loops():
    """B = A * 2 on [64, 32], i split by 64 and j by 1, the loops of extent 1 annotated:

        parallel i.0 (0,1)  for i.1 (0,64)  for j.0 (0,32)  vectorize j.1 (0,1)

    TVM lowers a loop of extent 1 to a let whatever its annotation, so feature.cc sees neither the
    parallel nor the vectorised loop: the row is that of the same splits unannotated (kPosNone, no
    count, product or length). A vectorised loop of extent 8 beside a parallel one of extent 1 counts."""
    a = te.placeholder((64, 32), name="A")
    b = te.compute((64, 32), lambda i, j: a[i, j] * 2.0, name="B")
    split = State(ComputeDAG([a, b])).split("B", 0, [64]).split("B", 2, [1])
    annotated = rows(split.parallel("B", 0).vectorize("B", 3))["B"]
    assert_entries(annotated, num_loops=2, **annotation("vec", None), **annotation("parallel", None))
    assert annotated == rows(split)["B"]
    wide = State(ComputeDAG([a, b])).split("B", 0, [64]).split("B", 2, [8]).parallel("B", 0).vectorize("B", 3)
    assert_entries(rows(wide)["B"], num_loops=3, **annotation("vec", [8]), **annotation("parallel", None))


def test_strides_skipped_loops_and_partial_rows():
    """out[i, j, k] = A[i, 2k] + W[j, 0] with A [8, 64], W [16, 16], out [8, 16, 32], loops reordered:

        for j (0,16)  for i (0,8)  for k (0,32)
          out[i, j, k] = A[i, 2*k] + W[j, 0]
    """
    a, w = te.placeholder((8, 64), name="A"), te.placeholder((16, 16), name="W")
    out = te.compute((8, 16, 32), lambda i, j, k: a[i, 2 * k] + w[j, 0], name="out")
    row = rows(State(ComputeDAG([a, w, out])).reorder("out", [1, 0, 2]))["out"]
    n = 16 * 8 * 32
    assert_entries(row, outer_prod=n, num_loops=3, float_addsub=n, float_mul=0)
    assert_buffers(row, {
        # A[i, 2k]: k moves dim 1 by 2: stride 2, a new line every 8 iterations. The touched box is
        # 8 x 63 (2*31 + 1) elements; its innermost dimension (63) is not A's whole row (64), dim 0
        # (8) is, so TVM's "contiguous" run is 8 elements (32 bytes): 2016 / 32 unique lines.
        # Reuse at j, the outermost loop (16 times): inside it i x k = 256 iterations touch out 8x32,
        # A 8x63 and W 1 elements.
        "A": buf("kRead", n * 4, 8 * 63 * 4, n * 2 * 4 / LINE, 8 * 63 * 4 / (8 * 4), 2,
                 (8 * 32, (8 * 32 + 8 * 63 + 1) * 4, 16)),
        "out": buf("kWrite", n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None),
        # W[j, 0]: k and i are skipped, j moves dim 0 by 1 row = 16 elements (64 bytes: each j a new
        # line). Lines = n / (8 * 32) (the skipped loops; TVM divides by the innermost extent twice,
        # 32 * 32: feature.py's docstring) = 16. Touched: 16 x 1, W's dim 0 is whole: 16 contiguous
        # elements = one line. Reuse at k (32 times), one iteration, one element of each access.
        "W": buf("kRead", n * 4, 16 * 4, n / (8 * 32) * min(1, 16 * 4 / LINE), 1, 0, (1, 3 * 4, 32)),
    })
    # The arithmetic-intensity curve: (ops, bytes touched) at each loop level, innermost first, one add
    # per iteration: k alone varies: 32 adds over out 32 + A 63 + W 1 elements; i and k: 8 * 32 adds
    # over out 8*32 + A 8*63 + W 1; everything: n adds over out n + A 8*63 + W 16. The curve samples
    # ops/bytes at ops = n/10, 2n/10, ..., n, interpolating linearly in ops between levels: every sample
    # lies past the second level (256 ops), so between the second and the third.
    levels = [(32, (32 + 63 + 1) * 4), (256, (8 * 32 + 8 * 63 + 1) * 4), (n, (n + 8 * 63 + 16) * 4)]
    (o1, b1), (o2, b2) = levels[1], levels[2]
    for t in range(10):
        x = n * (t + 1) / 10
        want = o1 / b1 + (o2 / b2 - o1 / b1) * (x - o1) / (o2 - o1)
        assert row[f"arith_intensity_curve_{t}"] == pytest.approx(want, rel=1e-5), t


def test_fused_parallel_loop_vectorized_tail_and_auto_unroll():
    """B = A * 2 on [64, 32], j split by 8, (i, j.0) fused and parallel, j.1 vectorized, auto-unroll 16:

        parallel f (0,256)             # i = f // 4, j = (f % 4) * 8 + j.1
          vectorize j.1 (0,8)
            B[f // 4, (f % 4) * 8 + j.1] = A[f // 4, (f % 4) * 8 + j.1] * 2

    The fused loop enters the indices through // and %: their ranges (f // 4 in [0, 63], (f % 4) * 8
    in [0, 24]) must come out whole, so each buffer is touched entirely."""
    a = te.placeholder((64, 32), name="A")
    b = te.compute((64, 32), lambda i, j: a[i, j] * 2.0, name="B")
    s = State(ComputeDAG([a, b])).split("B", 1, [8]).fuse("B", [0, 1]).parallel("B", 0).vectorize("B", 1)
    row = rows(s.pragma("B", 0, "auto_unroll_max_step$16"))["B"]
    n = 64 * 32
    assert_entries(row, outer_prod=n, num_loops=2, float_mul=n, auto_unroll_max_step=16,
                   **annotation("vec", [8]), **annotation("parallel", [256]), **annotation("unroll", None))
    # both: stride 1 along j.1, all 64 x 32 touched, no loop leaves them unused
    assert_buffers(row, {name: buf(acc, n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None)
                         for name, acc in (("B", "kWrite"), ("A", "kRead"))})


def test_op_counts_cover_every_kind_of_operation():
    """Each op counts once per iteration, times the loops around the store (feature.cc's MathOpCounter
    over the stored value, load indices included; max/min and comparisons are `cmp`, & | ! are `bool`):

        for j (0,32)
          out[j] = select(A[j] > 0 && j < 24, exp(A[j]) / (1 + W[(3j + 1) // 8]),
                          max(A[j], W[(3j + 1) // 8]) * 0.5 - 1)

    One-dimensional buffers, so there is no index flattening for feature.cc to count beyond these."""
    a, w = te.placeholder((32,), name="A"), te.placeholder((12,), name="W")
    out = te.compute((32,), lambda j: te.if_then_else(
        (a[j] > 0.0) & (j < 24), te.exp(a[j]) / (1.0 + w[(j * 3 + 1) // 8]),
        te.maximum(a[j], w[(j * 3 + 1) // 8]) * 0.5 - 1.0), name="out")
    row = rows(State(ComputeDAG([a, w, out])))["out"]
    n = 32
    assert_entries(row, outer_prod=n, num_loops=1,
                   float_addsub=2 * n,      # 1 + W, ... - 1
                   float_mul=n,             # * 0.5
                   float_divmod=n,          # exp(..) / (..)
                   float_cmp=2 * n,         # A > 0, max
                   float_mathfunc=n,        # exp
                   int_cmp=n,               # j < 24
                   int_mul=2 * n, int_addsub=2 * n, int_divmod=2 * n,    # (3j + 1) // 8, in each W load
                   bool_op=n,               # &
                   select_op=n,
                   float_mad=0, float_otherfunc=0, int_mad=0, int_mathfunc=0, int_otherfunc=0)
    # W[(3j + 1) // 8]: j in [0, 31] reads W[0..11], all of W; one loop, so the curve is one point:
    # 7 float ops per iteration over out 32 + A 32 + W 12 elements
    assert_entries(row, **{f"arith_intensity_curve_{t}": 7 * n / ((32 + 32 + 12) * 4) for t in range(10)})
    assert_buffers(row, {
        "out": buf("kWrite", n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None),
        "A": buf("kRead", n * 4, n * 4, n * 4 / LINE, n * 4 / LINE, 1, None),
    } | {"W": {"acc_type.kRead": 1, "bytes": n * 4, "unique_bytes": 12 * 4, "reuse_type.kNoReuse": 1}})
