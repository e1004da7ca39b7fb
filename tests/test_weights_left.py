"""int8/nf4 weights store convolutions, embeddings and 3-D expert weights quantized too, and name every large weight
they leave in full precision (here a matrix read by a plain matmul), with the ops that use it and why, in the pass's
intent, the report's warnings and the CLI summary."""
from __future__ import annotations

import json

import torch
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.weights_left import weights_left


class ConvEmbedMoE(nn.Module):
    """A convolution, an embedding table, a linear, a matrix read by a plain matmul and two experts held as one 3-D
    weight (bmm), as MoE code writes them."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 64, 3, padding=1)
        self.embed = nn.Embedding(512, 64)
        self.head = nn.Linear(64, 128)
        self.experts = nn.Parameter(torch.randn(2, 128, 64) * 0.05)
        self.table = nn.Parameter(torch.randn(64, 128) * 0.05)

    def forward(self, image, token):
        features = self.conv(image).mean((2, 3)) + self.embed(token)
        hidden = self.head(features) + features @ self.table
        mixed = torch.bmm(hidden.unsqueeze(0).expand(2, -1, -1), self.experts).mean(0)
        return mixed.sum(-1)


def inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 8, 8, 8, generator=generator), torch.tensor([3, 7])


def test_weights_left_names_non_linear_weights_largest_first():
    program = fxmem.capture(ConvEmbedMoE(), inputs(), check=False)
    rows = weights_left(program.module, min_params=4096)
    assert [row.name for row in rows] == ["embed.weight", "experts", "table", "conv.weight"]
    assert [row.used_by for row in rows] == [("embedding",), ("bmm",), ("matmul",), ("conv2d",)]
    assert rows[0].nbytes == 512 * 64 * 4
    assert all(row.name != "head.weight" for row in rows), "the linear's weight is what int8 takes"
    assert [row.name for row in weights_left(program.module, min_params=20000)] == ["embed.weight"]


def int8_result():
    return fxmem.transform(ConvEmbedMoE(), inputs(), policy="inference", passes__precision__weights="int8")


def test_int8_intent_and_report_say_which_weights_stay_in_full_precision():
    result = int8_result()
    (record,) = [r for r in result.report.passes if r.name == "precision"]
    (intent,) = [i for i in record.intents if i["setting"] == "passes.precision.weights"]
    assert intent["complete"] and intent["achieved"] == "quantized 4 of 4"
    assert intent["asked"] == "int8 weights on 1 linear(s) and 3 other weight(s)"
    assert intent["not_covered"].startswith("1 other large weight(s) stay in full precision (")
    assert intent["not_covered"].endswith("table (matmul): read by matmul: int8/4-bit storage covers linear, "
                                          "convolution and embedding weights and 3-D expert weights read by "
                                          "(batched or grouped) matmuls")
    (line,) = result.report.not_covered()
    assert line.startswith("precision: asked int8 weights on 1 linear(s) and 3 other weight(s), quantized 4 of 4; "
                           "not covered: 1 other")
    assert f"not covered by the policy: {line}" in result.report.to_markdown()
    assert json.loads(result.report.to_json())["warnings"]["not_covered"] == [line]


def test_cli_summary_names_the_weights_left(tmp_path, capsys):
    model_file = tmp_path / "conv_model.py"
    model_file.write_text(
        f"import sys\nsys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent.parent)!r})\n"
        "from tests.test_weights_left import ConvEmbedMoE, inputs\n\n"
        "def build_model():\n    return ConvEmbedMoE()\n\ndef example_inputs():\n    return inputs()\n")
    policy = tmp_path / "int8.yaml"
    policy.write_text("version: 1\nmode: inference\noptimizer: none\npasses:\n  precision:\n    weights: int8\n")
    code = main(["optimize", str(model_file), "--policy", str(policy), "--out", str(tmp_path / "out"), "--quiet"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert lines[1].startswith("NOT COVERED BY THE POLICY: precision: asked int8 weights on 1 linear(s) and 3 other")
    assert "table (matmul): read by matmul" in lines[1] and "conv.weight" not in lines[1]
