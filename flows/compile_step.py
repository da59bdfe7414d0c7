"""The nightly flow's last step: the tuned network compiled into one library, written beside the records.

A Prefect task kept out of tune_flow.py so the flow only calls it; the work is
`tuned_network.compile_into_store` (compile, check with tensortune.runtime, copy into the store).
"""
from __future__ import annotations

from datetime import datetime, timezone

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tensortune.flows import artifacts
from tensortune.flows.tuned_network import StoredLibrary, compile_into_store


@task(name="compile-network", cache_policy=NONE, persist_result=False)
def compile_network_step(net, network: str, target: str, records: str) -> StoredLibrary:
    """Build the night's library from the store's best records into `<records>/_compiled/<network>/<time>/`
    and link it from the flow run's artifacts; a library that fails its check fails the step."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    library = compile_into_store(net, records, target, artifacts.network_label(network), stamp)
    artifacts.publish_library(network, target, library)
    get_run_logger().info(library.line())
    if not library.passed:
        raise RuntimeError(f"{network}: the compiled library gives wrong outputs ({library.check}); "
                           f"it is kept in {library.folder}")
    return library
