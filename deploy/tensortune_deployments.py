"""The tune-network flow as deploy/prefect.yaml's deployments run it: with a run-time limit.

Prefect keeps a flow run's time limit on the flow (`@flow(timeout_seconds=...)`; a deployment in
prefect.yaml has no field for it), so each deployment's entrypoint is the flow with its own limit
(`with_options`), and the command line's `tensortune tune`, which calls the flow itself, has none. A run
that reaches its limit ends Failed with the state name TimedOut (deploy/automations.yaml notifies on
it); every batch it measured is already in the record store, and the next run resumes from there. The
limit matters because each deployment runs one flow at a time on the measure nodes: a run that hangs
would otherwise hold them and queue every later run behind it.
"""
from __future__ import annotations

from tensortune.flows.tune_flow import tune_network_flow

NIGHTLY_TIMEOUT_S = 6 * 3600          # the 02:00 UTC run ends by 08:00, long before the next night's
ON_DEMAND_TIMEOUT_S = 24 * 3600       # a large network's long run, but never one that holds the nodes for days

nightly = tune_network_flow.with_options(timeout_seconds=NIGHTLY_TIMEOUT_S)
on_demand = tune_network_flow.with_options(timeout_seconds=ON_DEMAND_TIMEOUT_S)
