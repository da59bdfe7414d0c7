"""The README's ONNX section says what the importer does: its op table is the importer's own, and an
unsupported op is refused the way it shows (one line, exit 2, the node and the op named)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tensortune.flows.cli import app
from tensortune.tasks.onnx_import import CONVERTERS, supported_ops_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_op_table_is_the_importers():
    text = README.read_text()
    block = re.search(r"<!-- onnx-ops:begin -->\n(.*?)\n<!-- onnx-ops:end -->", text, re.S)
    assert block, "README has no onnx-ops block"
    assert block.group(1) == supported_ops_table(), "README's op table is stale: paste supported_ops_table()"
    assert all(op in block.group(1) for op in CONVERTERS)


def test_an_unsupported_op_is_refused_as_the_readme_shows(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1.0, 1.0, 2.0, 2.0])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], [scales])
    path = tmp_path / "resize.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = CliRunner().invoke(app, ["extract", str(path)])
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert out.exit_code == 2 and len(lines) == 1, out.output
    assert lines[0].startswith("error: node Resize_0 (Resize): unsupported op 'Resize'; supported ops: Abs, Add, ")
    assert "error: node Resize_0 (Resize): unsupported op 'Resize'; supported ops: Abs, Add, ..." in README.read_text()
