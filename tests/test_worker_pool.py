"""The isolated worker pools that build and time programs: a job's timeout is the job's own.

A fresh worker (the first, or the replacement of a crashed or hung one) spends seconds starting on a
loaded machine. Counted against the job it was sent, that start turned a good program into a timeout
record, and a program with a record is never measured again. Here the start is made slow on purpose
(the job module sleeps on import), so these checks do not depend on how busy the machine is."""
from __future__ import annotations

from tensortune.codegen.worker_pool import WorkerPool

START_S, TIMEOUT_S = 4.0, 2.0          # a start twice as long as the jobs' timeout


def _pool(**kw) -> WorkerPool:
    return WorkerPool("tests.slow_start_job:nap", 1, timeout=TIMEOUT_S, env={"SLOW_START_S": str(START_S)}, **kw)


def test_a_slow_worker_start_is_not_counted_against_its_job():
    with _pool() as pool:
        (first,) = pool.map([0.0])                             # sent to a worker that is still starting
        assert first.ok and first.value == 0.0, first.error
        (hung,) = pool.map([60.0])                             # a job past its timeout is still cut off
        assert hung.kind == "timeout" and f"timed out after {TIMEOUT_S:.1f} s" in hung.error
        assert pool.restarts == 1
        (after,) = pool.map([0.0])                             # by the replacement, again slow to start
        assert after.ok, after.error


def test_a_worker_that_never_starts_fails_its_job_and_is_replaced():
    with _pool(startup_timeout=1.0) as pool:
        pid = pool.pids()
        (res,) = pool.map([0.0])
        assert res.kind == "timeout" and "did not start within 1.0 s" in res.error
        assert pool.restarts == 1 and pool.pids() != pid


def test_a_crash_dump_goes_into_the_jobs_error_not_the_terminal(capfd):
    """What a dying worker writes (faulthandler's dump) is the job's error; the parent's stderr stays clean."""
    with WorkerPool("tests.slow_start_job:crash", 1, timeout=30.0) as pool:
        (res,) = pool.map([None])
    assert res.kind == "crash" and "signal 11 (SIGSEGV)" in res.error
    assert "Fatal Python error: Segmentation fault" in res.error and "in crash" in res.error
    out, err = capfd.readouterr()
    assert "Segmentation fault" not in out + err


def test_workers_leave_ctrl_c_to_their_parent():
    """SIGINT (Ctrl-C reaches the whole process group) does not kill a worker or print its traceback."""
    import os
    import signal
    import time
    with WorkerPool("tests.slow_start_job:nap", 1, timeout=30.0) as pool:
        (pid,) = pool.pids()
        assert pool.map([0.0])[0].ok                   # started: its handler is installed
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        (res,) = pool.map([0.0])
        assert res.ok and pool.pids() == [pid] and pool.restarts == 0
        assert "KeyboardInterrupt" not in pool._workers[0].stderr_tail()
