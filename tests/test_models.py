"""Model builders: every network runs end to end from its compiled tasks and matches the NumPy
reference (small sizes here, full sizes under -m slow); weights are deterministic; BatchNorm folding
is exact; the registry rejects what a builder does not take."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.network_runtime import NETWORK_TOLERANCE, build_network
from tensortune.tasks.extract import extract_tasks
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.graph_ops import GraphError
from tensortune.tasks.models import fold_batch_norm, make_network, network_names, network_options

SMALL = {
    "resnet-18": dict(image_size=32, base_width=16, batch_size=2),
    "resnet-50": dict(image_size=32, base_width=8),
    "mobilenet-v2": dict(image_size=32, width_mult=0.35),
    "bert-base": dict(seq_len=16, num_layers=1, vocab_size=500),
    "dcgan": dict(ngf=8, nz=20, batch_size=2),
}


def _run_end_to_end(graph, seed: int = 0):
    compiled = build_network(extract_tasks(graph))
    result = compiled.check(seed=seed)
    assert result.passed, f"{graph.name}: {result}"
    return compiled, result


@pytest.mark.parametrize("name", sorted(SMALL))
def test_network_runs_end_to_end_and_matches_reference(name):
    graph = make_network(name, **SMALL[name])
    compiled, result = _run_end_to_end(graph)
    # a second run on other inputs reuses the planned buffers and is still right
    assert compiled.check(seed=1).passed
    for out in graph.outputs:
        assert result.errors[out] < NETWORK_TOLERANCE


def test_output_shapes_and_batch_size():
    assert make_network("resnet-50", batch_size=3, image_size=64).values["fc"].shape == (3, 1000)
    assert make_network("resnet-18", image_size=32).values["fc"].shape == (1, 1000)
    mb = make_network("mobilenet-v2", batch_size=2, image_size=64)
    assert mb.values[mb.outputs[0]].shape == (2, 1000)
    bert = make_network("bert-base", batch_size=2, seq_len=8, num_layers=2, vocab_size=100)
    assert [bert.values[o].shape for o in bert.outputs] == [(2, 8, 768), (2, 768)]
    assert bert.inputs["input_ids"].dtype == "int64"
    assert sum(n.op == "layer_norm" for n in bert.nodes) == 1 + 2 * 2
    gen = make_network("dcgan", batch_size=4)
    assert gen.values[gen.outputs[0]].shape == (4, 3, 64, 64)


def test_full_size_architectures():
    """Parameter counts of the real architectures (no run): torchvision's / the PyTorch DCGAN example's
    counts less one per BatchNorm channel (its scale folds into the conv weights, its shift is the bias)."""
    assert make_network("resnet-18").num_params == 11_689_512 - 4_800
    assert make_network("resnet-50").num_params == 25_557_032 - 26_560
    assert make_network("mobilenet-v2").num_params == 3_504_872 - 17_056
    assert make_network("dcgan").num_params == 3_576_704 - 960
    bert = make_network("bert-base", seq_len=128)
    assert bert.name == "bert-base" and sum(n.op == "layer_norm" for n in bert.nodes) == 25
    # Hugging Face's bert-base-uncased count, with the position table cut to seq_len rows, the token
    # type table to the one row used, plus one attention-scale scalar per layer
    assert bert.num_params == 109_482_240 - (512 - 128) * 768 - (2 - 1) * 768 + 12


def test_weights_are_deterministic_per_seed():
    a = make_network("resnet-18", image_size=32, seed=3)
    b = make_network("resnet-18", image_size=32, seed=3)
    c = make_network("resnet-18", image_size=32, seed=4)
    for k, v in a.constants.items():
        np.testing.assert_array_equal(v, b.constants[k])
    assert not np.array_equal(a.constants["fc.weight"], c.constants["fc.weight"])


def test_fold_batch_norm_is_exact():
    rng = np.random.default_rng(0)
    w, bias = rng.standard_normal((4, 3, 3, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, 4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    mean, var = rng.standard_normal(4).astype(np.float32), rng.uniform(0.5, 1.5, 4).astype(np.float32)
    g = GraphBuilder("bn")
    x = g.input("x", (1, 3, 5, 5))
    y = g.add("conv2d", [x, g.constant(w), g.constant(bias)], pads=(1, 1, 1, 1))
    y = g.add("batch_norm", [y] + [g.constant(a) for a in (gamma, beta, mean, var)])
    unfolded = g.build([y])
    fw, fb = fold_batch_norm(w, bias, gamma, beta, mean, var)
    g2 = GraphBuilder("folded")
    x2 = g2.input("x", (1, 3, 5, 5))
    folded = g2.build([g2.add("conv2d", [x2, g2.constant(fw), g2.constant(fb)], pads=(1, 1, 1, 1))])
    inputs = unfolded.random_inputs(0)
    np.testing.assert_allclose(folded.run_reference(inputs)["conv2d"], unfolded.run_reference(inputs)["batch_norm"],
                               rtol=1e-5, atol=1e-5)


def test_registry_errors():
    assert network_names() == ["bert-base", "dcgan", "mobilenet-v2", "resnet-18", "resnet-50"]
    assert "seq_len" in network_options("bert-base")
    with pytest.raises(GraphError, match=r"unknown network 'vgg'; known: bert-base, dcgan"):
        make_network("vgg")
    with pytest.raises(GraphError, match=r"'resnet-50' does not take seq_len; it takes batch_size"):
        make_network("resnet-50", seq_len=4)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        make_network("dcgan", batch_size=0)
    with pytest.raises(ValueError, match="hidden size 100 must be divisible by the number of heads 12"):
        make_network("bert-base", hidden=100)


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("resnet-18", {}), ("resnet-50", {}), ("mobilenet-v2", {}),
                                          ("bert-base", dict(seq_len=128)), ("dcgan", {})])
def test_full_size_network_end_to_end(name, options):
    _run_end_to_end(make_network(name, **options))
