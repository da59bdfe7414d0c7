"""The arithmetic of the store's queries, on plain DataFrames: which row is best, how the best moved.

Kept apart from file access so compaction (which must pick the same "best" rows) and the record store
share one definition, and so the rules can be read without any I/O around them.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from tensortune.storage.schema import error_name


def ok_expression() -> pc.Expression:
    """The pyarrow filter for a successful measurement: no error and a finite, positive latency."""
    latency = pc.field("mean_latency")
    return (pc.field("error_code") == 0) & pc.is_finite(latency) & (latency > 0)


def ok_mask(frame: pd.DataFrame) -> np.ndarray:
    """Which rows of `frame` are successful measurements (the pandas twin of ok_expression)."""
    latency = frame["mean_latency"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        return (frame["error_code"].to_numpy() == 0) & np.isfinite(latency) & (latency > 0)


def best_positions(frame: pd.DataFrame, by: list[str]) -> np.ndarray:
    """Positions of the best successful row of each `by` group (ties: earliest, then smallest id)."""
    ok = np.flatnonzero(ok_mask(frame))
    if len(ok) == 0:
        return ok
    keys = frame.iloc[ok][[*by, "mean_latency", "timestamp", "record_id"]].copy()
    keys["_position"] = ok
    keys = keys.sort_values(["mean_latency", "timestamp", "record_id"], kind="stable")
    return keys.drop_duplicates(by, keep="first")["_position"].to_numpy()


def competing_mask(frame: pd.DataFrame, by: list[str], retimings: pd.DataFrame | None = None) -> np.ndarray:
    """Which rows of `frame` compete for their `by` group's best: those at or after the group's newest
    re-timing (a `retiming` row of `retimings`, by default of `frame` itself; every row of a group that
    has none).

    A run that resumes times its tasks' stored best programs again (flows.tuning.retime_stored_bests),
    all of one task's at one timestamp, because a timing from another night is not comparable with
    tonight's: on a shared VM the same kernel ran 1.5-1.9 times slower in one hour than in another, and
    a stored figure from a fast hour stays below everything a slow night measures. From that re-timing
    on, the task's older records are history (they still count as measured and train the cost model)
    but no longer its best: the re-timed programs carry the stored bests forward at tonight's speed.
    One rule for both readers, the best-record query and a resumed search."""
    retimings = frame if retimings is None else retimings
    if frame.empty or retimings.empty or not retimings["retiming"].to_numpy(dtype=bool).any():
        return np.ones(len(frame), dtype=bool)
    retimed = retimings[retimings["retiming"].to_numpy(dtype=bool)]
    newest = retimed.groupby(by, observed=True)["timestamp"].max().rename("_baseline").reset_index()
    baseline = frame[by].merge(newest, on=by, how="left")["_baseline"]
    stamps = frame["timestamp"].reset_index(drop=True)
    return (baseline.isna() | (stamps >= baseline)).to_numpy(dtype=bool)


def fastest_programs(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(steps, kernel) of one task's distinct programs among its competing successful records (frame:
    that task's records on one target), fastest first: a resumed run times the first few again."""
    if frame.empty:
        return []
    live = frame[competing_mask(frame, ["workload_key"]) & ok_mask(frame)]
    ranked = live.sort_values(["mean_latency", "timestamp"], kind="stable").drop_duplicates("steps")
    # a program's kernel as its newest record names it (a record from before kernels were named has "")
    named = frame[frame["kernel"] != ""].drop_duplicates("steps", keep="last")
    kernels = dict(zip(named["steps"], named["kernel"]))
    return [(str(steps), str(kernels.get(steps, ""))) for steps in ranked["steps"]]


def task_counts(table: pa.Table, by: list[str]) -> pd.DataFrame:
    """Records and errors per `by` group (table needs `by` and `error_code`); grouped in Arrow, which
    is several times faster than pandas on a million string keys."""
    errors = pc.cast(pc.not_equal(table.column("error_code"), 0), pa.int64())
    work = table.select(by).append_column("_error", errors)
    counted = work.group_by(by).aggregate([("_error", "count"), ("_error", "sum")])
    frame = counted.to_pandas()
    return frame.rename(columns={"_error_count": "n_records", "_error_sum": "n_errors"})[
        [*by, "n_records", "n_errors"]]


def history_table(frame: pd.DataFrame, per: str, retimings: pd.DataFrame) -> pd.DataFrame:
    """The best latency of each task per flow run (per="run") or per round (per="round"), in time
    order, with the best so far: across everything before it since the task's newest re-timing before
    it (a run that timed the stored bests again starts the count anew, as competing_mask has it).
    `retimings`: the re-timing rows (target, workload_key, timestamp) to count, of every network (a
    history of one network counts another's re-timings, as the best-record query does)."""
    if per not in ("run", "round"):
        raise ValueError(f"per={per!r}: use 'run' or 'round'")
    keys = ["target", "workload_key", "flow_run_id"] + (["round"] if per == "round" else [])
    columns = [*keys, "task_name", "task_label", "network", "timestamp", "mean_latency", "gflops", "error_code"]
    if frame.empty:
        return pd.DataFrame(columns=[*keys, "task_name", "task_label", "start", "end", "n_records", "n_errors",
                                     "best_latency", "best_gflops", "best_so_far"])
    work = frame[columns].copy()
    ok = ok_mask(work)
    work["_latency"] = np.where(ok, work["mean_latency"], np.nan)
    work["_gflops"] = np.where(ok, work["gflops"], np.nan)
    work["_error"] = work["error_code"] != 0
    table = (work.groupby(keys, observed=True, sort=False)
             .agg(task_name=("task_name", "first"), task_label=("task_label", "last"), start=("timestamp", "min"),
                  end=("timestamp", "max"), n_records=("timestamp", "size"),
                  n_errors=("_error", "sum"), best_latency=("_latency", "min"),
                  best_gflops=("_gflops", "max"))
             .reset_index()
             .sort_values(["target", "workload_key", "start"], kind="stable"))
    utc = "datetime64[ns]"         # tz-aware UTC as plain numpy times, comparable with each other
    stamps = {key: np.sort(group["timestamp"].to_numpy(dtype=utc)) for key, group in
              retimings.groupby(["target", "workload_key"], observed=True)}
    # the re-timings a row's records come after (its newest at or after them): its count since
    epoch = [int(np.searchsorted(stamps[(t, k)], end, side="right")) if (t, k) in stamps else 0
             for t, k, end in zip(table["target"], table["workload_key"], table["end"].to_numpy(dtype=utc))]
    table["best_so_far"] = table.groupby(["target", "workload_key", np.asarray(epoch)],
                                         sort=False)["best_latency"].cummin()
    return table.reset_index(drop=True)


def error_table(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """How many measurements ended with each error code, per `by` group, most frequent first."""
    keys = [*by, "error_code"]
    table = frame.groupby(keys, observed=True).size().rename("count").reset_index()
    table.insert(len(keys), "error_name", [error_name(c) for c in table["error_code"]])
    return table.sort_values([*by, "count"], ascending=[True] * len(by) + [False],
                             kind="stable").reset_index(drop=True)


def runs_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per flow run: when, which networks and targets, how many tasks, records and errors."""
    if frame.empty:
        return pd.DataFrame(columns=["flow_run_id", "start", "end", "networks", "targets", "n_tasks",
                                     "n_records", "n_errors"])
    work = frame.assign(_error=frame["error_code"] != 0)
    joined = lambda values: ",".join(sorted({str(v) for v in values if str(v)}))  # noqa: E731
    table = (work.groupby("flow_run_id", observed=True)
             .agg(start=("timestamp", "min"), end=("timestamp", "max"),
                  networks=("network", joined), targets=("target", joined),
                  n_tasks=("workload_key", "nunique"), n_records=("timestamp", "size"),
                  n_errors=("_error", "sum"))
             .reset_index())
    return table.sort_values("start", kind="stable").reset_index(drop=True)
