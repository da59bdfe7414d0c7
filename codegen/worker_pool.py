"""Long-lived worker processes that survive what they run: a crash or a hang costs one job, not the pool.

Each worker runs one job at a time from a pipe. A worker that dies (segfault, abort) or runs past the
timeout is killed and replaced; its job comes back as an error, and the next job goes to a healthy
worker. Workers are fresh interpreters (`python -c ...` over a socket pair), so no lock or thread state
leaks in from the parent and the caller's main module is never re-imported.

A job's timeout covers the job, not the start of the interpreter that runs it: a new worker says when it
has imported its job function, and a job sent before that is timed from then. (Start-up, importing
numpy and llvmlite, took seconds on a loaded 2-core machine; counted against the job, it turned a
good program sent to a replacement worker into a timeout record, and a measured program is never
measured again.) A worker that does not start within `startup_timeout` fails its job.

A worker's stderr goes to a file of its own, not the terminal: what a crashing kernel leaves there
(faulthandler's dump of the fatal signal) becomes part of that job's error, so it lands in the job's record
and the log instead of interleaving with a command's output. Workers ignore SIGINT: Ctrl-C is the
parent's to handle, and it closes the pool (a worker whose parent is gone exits at the end of its pipe).
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence


@dataclass
class JobResult:
    ok: bool
    value: Any = None
    error: str = ""           # traceback text, or what killed the worker
    kind: str = ""            # "" | "exception" | "crash" | "timeout"
    seconds: float = 0.0


def _child_main() -> None:
    """Entry point of a worker interpreter: argv = [fd, job_path]."""
    import faulthandler
    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_main(Connection(int(sys.argv[1])), sys.argv[2])


_READY = ("ready",)            # a worker's first message: its job function is imported


def _worker_main(conn: Connection, job_path: str) -> None:
    module, _, name = job_path.partition(":")
    fn = getattr(importlib.import_module(module), name)
    conn.send(_READY)
    while True:
        try:
            payload = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            out = (True, fn(payload), "")
        except BaseException as err:  # noqa: BLE001 - every failure becomes a result
            out = (False, None, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}")
        try:
            conn.send(out + (time.perf_counter() - start,))
        except (BrokenPipeError, OSError):
            return


log = logging.getLogger(__name__)
STDERR_TAIL_BYTES = 4000       # of a dead worker's stderr, kept in its job's error


class _Worker:
    def __init__(self, job_path: str, env: dict):
        parent, child = socket.socketpair()
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tensortune.codegen.worker_pool import _child_main; _child_main()",
             str(child.fileno()), job_path],
            pass_fds=[child.fileno()], env={**os.environ, **env}, stdin=subprocess.DEVNULL, stderr=self.stderr)
        child.close()
        self.conn = Connection(parent.detach())
        self.job: int | None = None
        self.started = 0.0                    # when the current job's clock started
        self.spawned = time.perf_counter()
        self.ready = False                    # has said it imported its job function

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        """The end of what the worker wrote to stderr (a fatal signal's traceback, for one)."""
        try:
            size = self.stderr.seek(0, os.SEEK_END)
            self.stderr.seek(max(0, size - STDERR_TAIL_BYTES))
            return self.stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def kill(self) -> None:
        if self.alive:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
        self.stderr.close()


class WorkerPool:
    """`map(payloads)` runs `job_path` ("module:function") on each payload in isolated processes."""

    def __init__(self, job_path: str, n_workers: int = 1, timeout: float = 10.0, env: dict | None = None,
                 startup_timeout: float = 120.0):
        self.job_path, self.n_workers, self.timeout = job_path, max(1, n_workers), timeout
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self._workers: list[_Worker] = []
        self.restarts = 0

    def _ensure(self) -> None:
        for w in [w for w in self._workers if not w.alive]:
            w.kill()
            self._workers.remove(w)
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self.job_path, self.env))

    def pids(self) -> list[int]:
        self._ensure()
        return [w.proc.pid for w in self._workers]

    def map(self, payloads: Sequence[Any], timeout: float | None = None) -> list[JobResult]:
        timeout = self.timeout if timeout is None else timeout
        results: list[JobResult | None] = [None] * len(payloads)
        pending = list(range(len(payloads)))[::-1]
        self._ensure()
        busy: list[_Worker] = []
        while pending or busy:
            for w in list(self._workers):
                if w.job is None and pending:
                    w.job = pending.pop()
                    w.started = time.perf_counter()
                    try:
                        w.conn.send(payloads[w.job])
                        busy.append(w)
                    except (BrokenPipeError, OSError):
                        pending.append(w.job)
                        self._replace(w)
            if not busy:
                continue
            now = time.perf_counter()
            wait_for = max(0.0, min(self._deadline(w, timeout) - now for w in busy))
            ready = wait([w.conn for w in busy], timeout=wait_for)
            for w in list(busy):
                job = w.job
                if job is None:
                    raise RuntimeError("a busy worker holds no job")   # busy workers were given one above
                if w.conn in ready and not w.ready:
                    try:
                        if w.conn.recv() == _READY:   # started: the job, already in its pipe, is timed from now
                            w.ready, w.started = True, time.perf_counter()
                            continue
                    except (EOFError, OSError):
                        pass
                if w.conn in ready:
                    try:
                        ok, value, err, secs = w.conn.recv()
                        results[job] = JobResult(ok, value, err, "" if ok else "exception", secs)
                        w.job = None
                        busy.remove(w)
                        continue
                    except (EOFError, OSError):
                        pass
                if w.conn in ready:
                    try:
                        code = w.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        code = None
                    how = f"signal {-code} ({signal.Signals(-code).name})" if code and code < 0 else f"exit {code}"
                    dump = w.stderr_tail()
                    log.info("worker process %s died (%s); its stderr:\n%s", w.proc.pid, how, dump or "(empty)")
                    results[job] = JobResult(False, None, f"worker process died ({how}) while running this job"
                                               + (f"; its stderr:\n{dump}" if dump else ""),
                                               "crash", time.perf_counter() - w.started)
                    busy.remove(w)
                    self._replace(w)
                elif time.perf_counter() >= self._deadline(w, timeout):
                    msg = (f"timed out after {timeout:.1f} s" if w.ready else
                           f"the worker process did not start within {self.startup_timeout:.1f} s")
                    results[job] = JobResult(False, None, msg, "timeout", timeout)
                    busy.remove(w)
                    self._replace(w)
        done = [r for r in results if r is not None]
        if len(done) != len(results):
            raise RuntimeError("a job finished without a result")   # the loop runs until none is pending
        return done

    def _deadline(self, w: _Worker, timeout: float) -> float:
        return w.started + timeout if w.ready else w.spawned + self.startup_timeout

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.restarts += 1
        self._workers.remove(w)
        self._workers.append(_Worker(self.job_path, self.env))

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
