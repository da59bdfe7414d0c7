"""Winograd forms in a network: extraction offers them beside the direct conv, the network build runs
the faster form of each group, and a network built with Winograd kernels equals the NCHW reference."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.network_runtime import build_network
from tensortune.schedule.default_schedule import default_schedule
from tensortune.tasks import winograd
from tensortune.tasks.extract import extract_tasks, winograd_eligible
from tensortune.tasks.models import make_network


@pytest.fixture(scope="module")
def graph():
    return make_network("resnet-18", image_size=32)


@pytest.fixture(scope="module")
def net(graph):
    return extract_tasks(graph, winograd_tiles=(2, 4))


def _default_records(net) -> dict[str, str]:
    return {t.workload_key: default_schedule(t.dag).steps_json() for t in net.tasks}


def _costs_preferring(net, position: int) -> dict[str, float]:
    """Costs under which form `position` of every form set (0 direct, 1 F(2,3), 2 F(4,3)) is fastest."""
    costs = {}
    for forms in net.form_sets():
        for j, t in enumerate(forms):
            costs[net.tasks[t].workload_key] = 1e-3 if j == position else 2e-3
    return costs


def test_without_tiles_extraction_is_unchanged(graph, net):
    plain = extract_tasks(graph)
    assert not plain.form_sets() and all(not g.alternatives for g in plain.groups)
    assert [plain.tasks[g.task].workload_key for g in plain.groups] == \
        [net.tasks[g.task].workload_key for g in net.groups]
    assert [g.inputs for g in plain.groups] == [g.inputs for g in net.groups]


def test_every_eligible_conv_gets_both_tile_sizes(net):
    simple = net.graph
    anchors = {n.name: n for n in simple.nodes}
    n_eligible = 0
    for g in net.groups:
        anchor = anchors[g.nodes[0]]
        if not winograd_eligible(simple, anchor):
            assert not g.alternatives
            continue
        n_eligible += 1
        assert [net.tasks[a.task].dag.name.split("_bias")[0] for a in g.alternatives] == \
            ["conv2d_winograd_f2_nhwc", "conv2d_winograd_f4_nhwc"]
        for a, m in zip(g.alternatives, (2, 4)):
            u = simple.constants[a.inputs[1]]
            np.testing.assert_array_equal(u, winograd.transform_weight_hwio(simple.constants[anchor.inputs[1]], m))
            assert a.inputs[0] == g.inputs[0] and a.inputs[2:] == g.inputs[2:]
    # ResNet-18: 3x3 stride-1 convs are all but the first conv of stages 2-4 (stride 2): 16 - 3 = 13
    assert n_eligible == 13
    assert all(len(f) == 3 for f in net.form_sets())


def test_resolve_forms_takes_the_fastest_record_else_direct(net):
    records = _default_records(net)
    none = net.resolve_forms({}, {})
    assert not any(t.dag.name.startswith("conv2d_winograd") for t in none.tasks)
    # costs without records, or records without costs: no comparison, so the direct form
    assert net.resolve_forms({}, _costs_preferring(net, 2)).tasks == none.tasks
    assert [t.workload_key for t in net.resolve_forms(records, {}).tasks] == [t.workload_key for t in none.tasks]
    f4 = net.resolve_forms(records, _costs_preferring(net, 2))
    names = [t.dag.name for t in f4.tasks]
    assert sum(n.startswith("conv2d_winograd_f4") for n in names) == len(net.form_sets())
    assert not any(g.alternatives for g in f4.groups)
    assert sum(t.weight for t in f4.tasks) == len(f4.groups)
    # a record for the Winograd form only: it is the one that has been measured
    only = {k: v for k, v in records.items() if k in {net.tasks[f[1]].workload_key for f in net.form_sets()}}
    costs = {k: 1e-3 for k in only}
    picked = net.resolve_forms(only, costs)
    assert sum(t.dag.name.startswith("conv2d_winograd_f2") for t in picked.tasks) == len(net.form_sets())


@pytest.mark.parametrize("position", [1, 2])
def test_network_with_winograd_kernels_equals_reference(net, position):
    compiled = build_network(net, _default_records(net), costs=_costs_preferring(net, position))
    tag = f"conv2d_winograd_f{2 * position}"
    assert sum(k.name.startswith(tag) for k in compiled.kernels) == len(net.form_sets())
    result = compiled.check(seed=3)
    assert result.passed, str(result)


def test_build_without_costs_runs_the_direct_form(net):
    compiled = build_network(net)
    assert not any(k.name.startswith("conv2d_winograd") for k in compiled.kernels)
    assert compiled.check(seed=4).passed


def test_cli_extract_lists_the_winograd_forms():
    from typer.testing import CliRunner

    from tensortune.flows.cli import app
    runner = CliRunner()
    out = runner.invoke(app, ["extract", "resnet-18", "--image-size", "32", "--winograd", "4"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "resnet-18: 27 tasks" in out.output and "conv2d_winograd_f4_nhwc_bias_relu" in out.output
    for bad in ("3", "two"):
        res = runner.invoke(app, ["extract", "resnet-18", "--image-size", "32", "--winograd", bad])
        assert res.exit_code == 2 and "--winograd" in res.output, res.output


def test_tuned_network_runs_the_form_whose_stored_record_is_faster(tmp_path, graph, net):
    """measure_tuned_network (run-network, the flow's last step) and compile_tuned read the store's best
    records: where the Winograd form's is faster it runs, the estimate counts that form once."""
    from tensortune.codegen.target import parse_target
    from tensortune.flows.tuned_network import compile_tuned, measure_tuned_network
    from tensortune.storage.records import RecordStore
    from tensortune.storage.schema import MeasureRecord
    t = str(parse_target("llvm"))
    forms = net.form_sets()[0]
    direct, f4 = net.tasks[forms[0]], net.tasks[forms[2]]
    store = RecordStore(str(tmp_path / "records"))
    store.append([MeasureRecord(workload_key=k.workload_key, target=t, steps=default_schedule(k.dag).steps_json(),
                                task_name=k.name, network="resnet-18", latencies=[c], flops=k.flops)
                  for k, c in ((direct, 2e-3), (f4, 1e-3))])
    timing = measure_tuned_network(net, store, "llvm", repeat=1)
    assert timing.passed
    assert [x.name for x in timing.tasks if x.source == "record"] == [f4.name]
    assert not any(x.name == direct.name and x.source == "record" for x in timing.tasks)
    result, _, estimate, untuned = compile_tuned(net, store, "llvm", str(tmp_path / "lib"))
    assert f4.workload_key in {k.workload_key for k in result.kernels}
    assert direct.workload_key not in {k.workload_key for k in result.kernels}
    # the CLI's builds extract the forms the store has records of (none: nothing extra is computed)
    from typer.testing import CliRunner

    from tensortune.flows.cli import app
    from tensortune.flows.network_cli import stored_winograd_tiles
    assert stored_winograd_tiles(store) == (4,) and stored_winograd_tiles(None) == ()
    assert stored_winograd_tiles(RecordStore(str(tmp_path / "empty"))) == ()
    out = CliRunner().invoke(app, ["run-network", "resnet-18", "--image-size", "32", "--records",
                                   str(tmp_path / "records"), "--repeat", "1"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert f4.name in out.output and "OK" in out.output
