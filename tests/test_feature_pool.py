"""Features computed by helper processes are exactly those computed in-process, and a helper that
dies (or a parent that dies) costs nothing but time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest

from tensortune.codegen.target import make_task
from tensortune.search.feature import FeatureExtractor
from tensortune.search.feature_pool import Featurizer
from tensortune.search.helper_pool import SHARING_SWITCH_INTERVAL, callers_share
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.tasks.workload_registry import make_dag


@pytest.fixture(scope="module")
def population():
    task = make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1))
    return task, SketchPolicy(task, seed=3).sample(400)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.astype(np.float32), y.astype(np.float32))
                                    for x, y in zip(a, b))


def _helper_pids(featurizer: Featurizer) -> list[int]:
    return featurizer.helpers.pids()


def test_helpers_compute_the_same_features(population):
    task, programs = population
    expected = FeatureExtractor(task)(programs)
    featurizer = Featurizer(processes=1, min_batch=1)
    try:
        assert _same(featurizer(task, programs), expected)
        assert _helper_pids(featurizer), "the helper process was not used"
        assert _same(featurizer(task, programs), expected)        # every part kept from the first call
    finally:
        featurizer.close()


def test_a_killed_helper_costs_nothing(population):
    task, programs = population
    # three calls of programs not met before (a call evaluates only parts it has not met: part_rows)
    first, second, third = programs[:130], programs[130:260], programs[260:]
    featurizer = Featurizer(processes=1, min_batch=1)
    try:
        featurizer(task, first)
        (pid,) = _helper_pids(featurizer)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        assert _same(featurizer(task, second), FeatureExtractor(task)(second))    # its share is computed here
        assert _same(featurizer(task, third), FeatureExtractor(task)(third))      # and a fresh helper takes over
        assert _helper_pids(featurizer) and pid not in _helper_pids(featurizer)
    finally:
        featurizer.close()


def test_helpers_exit_with_a_killed_parent(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from tensortune.codegen.target import make_task
        from tensortune.search.feature_pool import Featurizer
        from tensortune.search.sketch_policy import SketchPolicy
        from tensortune.tasks.workload_registry import make_dag
        if __name__ == "__main__":
            task = make_task(make_dag("matmul", 64, 64, 64))
            f = Featurizer(processes=1, min_batch=1)
            f(task, SketchPolicy(task, seed=0).sample(64))
            print(*f.helpers.pids(), flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        helpers = [int(p) for p in parent.stdout.readline().split()]
        assert helpers
    finally:
        parent.kill()
        parent.wait()
    # a helper polls its parent once a second; the bound is only how long to wait for a slow exit on a
    # loaded machine, so it is generous (a passing run waits a second or two)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(_alive(p) for p in helpers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in helpers), "a helper outlived its parent"


def test_a_helper_shut_down_skips_the_interpreter_teardown(tmp_path):
    """A helper leaves by the first exit handler (_start_helper): it never frees its heap object by
    object. Shown without a clock: an object whose finaliser writes a file (as the teardown of the
    helper's module globals would call it) has not written it once the helper is gone; a plain pool
    process, the control, has."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tensortune.search.helper_pool import _start_helper
    for helper in (True, False):
        mark = tmp_path / f"finalised-{helper}"
        kw = {"initializer": _start_helper, "initargs": (os.getpid(),)} if helper else {}
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), **kw) as pool:
            pid = pool.submit(_keep_a_finaliser, str(mark)).result()
        while _alive(pid):                  # shutdown(wait=True) joined it; a zombie is reaped here
            time.sleep(0.05)
        assert mark.exists() != helper


class _WritesWhenFinalised:
    def __init__(self, path: str):
        self.path = path

    def __del__(self, _open=open):     # bound now: at teardown the builtins may be gone
        with _open(self.path, "w") as f:
            f.write("finalised")


_KEPT: list = []


def _keep_a_finaliser(path: str) -> int:
    _KEPT.append(_WritesWhenFinalised(path))
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_helpers_leave_the_proposals_as_they_were():
    """A policy proposes the same programs whether its model's features come from a helper (float32)
    or from this process alone."""
    from tensortune.search.cost_model import XGBModel
    from tensortune.search.params import SearchParams
    task = make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1))
    train = SketchPolicy(task, seed=9).sample(80)
    costs = [1e-3 * (1 + zlib.crc32(c.steps_json.encode()) % 97 / 97) for c in train]
    params = SearchParams(population=256, sample_init_population=256, num_iters=2)
    batches = []
    for processes in (0, 1):
        featurizer = Featurizer(processes=processes, min_batch=64)
        try:
            model = XGBModel(num_warmup_sample=0, features=featurizer, max_rounds=20)
            model.update(task, train, costs)
            policy = SketchPolicy(task, model, params, seed=4)
            policy.preload(train, costs)
            batches.append([c.steps_json for c in policy.next_batch(32)])
            if processes:
                assert _helper_pids(featurizer)
        finally:
            featurizer.close()
    assert batches[0] == batches[1] and len(batches[0]) == 32


def test_helpers_that_die_as_they_start_are_given_up_with_one_warning(tmp_path):
    """A script that exits when imported as a module (as one does that tunes at module level without a
    main guard: spawned helpers import it) kills each helper as it starts: after the second, the pool
    stops restarting them (a process start per call) and says why, once; the features are still right."""
    script = textwrap.dedent("""
        import logging
        import numpy as np
        from tensortune.codegen.target import make_task
        from tensortune.search.feature import FeatureExtractor
        from tensortune.search.feature_pool import Featurizer
        from tensortune.search.sketch_policy import SketchPolicy
        from tensortune.tasks.workload_registry import make_dag
        if __name__ != "__main__":
            raise SystemExit(0)
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        task = make_task(make_dag("matmul", 64, 64, 64))
        f = Featurizer(processes=1, min_batch=1)
        for seed in range(5):     # programs not met before each time: a call evaluates only new parts
            programs = SketchPolicy(task, seed=seed).sample(64)
            want = FeatureExtractor(task)(programs)
            got = f(task, programs)
            assert all(np.array_equal(a, b.astype(np.float32)) for a, b in zip(got, want))
        print("helpers", f.helpers.processes, flush=True)
    """)
    path = tmp_path / "unguarded.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["helpers", "0"]
    assert done.stderr.count("die as they start") == 1
    assert done.stderr.count("doing its share here") == 1, done.stderr


def test_the_callers_share_hands_the_gil_over_quickly_and_restores_the_interval():
    """While the caller computes its share, the executor's threads must send the helpers' jobs: the
    switch interval is short inside `callers_share` (nested too) and back to what it was after, and
    unchanged where nothing was submitted."""
    def short() -> bool:            # the interpreter keeps it in microseconds
        return sys.getswitchinterval() == pytest.approx(SHARING_SWITCH_INTERVAL)

    before = sys.getswitchinterval()
    assert not short()
    with callers_share():
        assert short()
        with callers_share():
            assert short()
        assert short()
    assert sys.getswitchinterval() == before
    with callers_share(False):
        assert sys.getswitchinterval() == before


def _tenfold_in(share: int) -> tuple[int, int]:
    if share == 4:
        raise ValueError("a bug in the helper's job")
    return share * 10, os.getpid()


def test_run_shares_keeps_order_and_computes_here_what_no_helper_returned():
    """Shares dealt to the helper come back from it and the others are computed here, inside the caller's
    share (the switch interval short while the helper's job is in flight), all in the shares' order; a
    share whose job failed in the helper is computed here, and without a pool every share is."""
    from tensortune.search.helper_pool import HelperPool, run_shares
    seen_short: list[bool] = []

    def here(share: int) -> tuple[int, int]:
        seen_short.append(sys.getswitchinterval() == pytest.approx(SHARING_SWITCH_INTERVAL))
        return share * 10, os.getpid()

    def deal(pool: HelperPool | None) -> list[tuple[int, int]]:
        return run_shares(pool, [1, 2, 3, 4], lambda i: 0 if i % 2 else None, lambda s: (_tenfold_in, (s,)), here)

    pool = HelperPool(1)
    try:
        got = deal(pool)
    finally:
        pool.close()
    me = os.getpid()
    assert [v for v, _ in got] == [10, 20, 30, 40]
    assert got[1][1] != me and [pid for _, pid in (got[0], got[2], got[3])] == [me] * 3
    assert seen_short == [True, True, False]          # the failed share was computed after the caller's own
    assert deal(None) == [(10, me), (20, me), (30, me), (40, me)]
