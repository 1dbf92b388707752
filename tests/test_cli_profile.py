"""``plan profile`` through typer's CliRunner: output, --json, and one clean error line for bad input."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.formats.profile import load_profile

runner = CliRunner()
TINY = "planner.examples.gpt:gpt_tiny"


def invoke(*args: str):
    result = runner.invoke(app, ["profile", *args])
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    return errors[0]


def test_profile_writes_a_valid_file_and_prints_a_summary(tmp_path):
    out = tmp_path / "p.json"
    code, stdout, stderr = invoke(TINY, "-o", str(out), "--repeats", "2", "--estimate", "h100-sxm,a100-80g",
                                  "--estimate-precision", "bf16")
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.device_types == ("a100-80g", "cpu", "h100-sxm")
    assert profile.extra["estimate_precision"] == "bf16"
    assert "Top 10 ops" in stdout and "sum of ops / whole" in stdout and "uncounted" in stdout
    assert f"wrote {out}" in stdout


def test_json_output_is_machine_readable(tmp_path):
    out = tmp_path / "p.json"
    code, stdout, stderr = invoke(TINY, "-o", str(out), "--repeats", "2", "--json", "--top", "3")
    assert code == 0, stderr
    data = json.loads(stdout)["profile"]
    assert data["output"] == str(out) and data["device_type"] == "cpu" and len(data["top_ops"]) == 3
    assert data["nodes"] == len(load_profile(out).nodes)
    assert set(data["whole_model"]) >= {"fwd_s", "bwd_s", "sum_ops_fwd_s", "sum_ops_bwd_s", "ratio_total"}


def test_module_only_factory_with_input_spec_and_fx_tracer(tmp_path):
    model = tmp_path / "conv.py"
    model.write_text(textwrap.dedent("""
        from torch import nn
        def build():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    """))
    out = tmp_path / "p.json"
    code, _, stderr = invoke(f"{model}:build", "--input", "float32[2,3,8,8]", "--microbatch-size", "3",
                             "--tracer", "fx", "--repeats", "1", "-o", str(out), "--json")
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.extra["tracer"] == "fx" and profile.model["microbatch_size"] == 3
    assert [n.op for n in profile.nodes][1] == "module:torch.nn.modules.conv.Conv2d"


HF_FILE = """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config), (torch.randint(0, 256, (2, 16)),)
"""


@pytest.mark.slow
def test_hugging_face_model_from_a_file_outside_the_repo(tmp_path):
    pytest.importorskip("transformers")
    model = tmp_path / "mymodel.py"
    model.write_text(textwrap.dedent(HF_FILE))
    out = tmp_path / "p.json"
    code, _, stderr = invoke(f"{model}:build", "--repeats", "1", "-o", str(out), "--json")
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.extra["tracer"] == "export" and "measure_failures" not in profile.extra
    assert any(g["params"] == ["lm_head.weight", "transformer.wte.weight"] for g in profile.extra["tied_parameters"])


UNCAPTURABLE = """
    import torch
    from torch import nn

    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    def build():
        return Branchy(), (torch.randn(4),)

    def broken():
        raise ValueError("no weights here")
"""


def bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    model = tmp_path / "bad_model.py"
    model.write_text(textwrap.dedent(UNCAPTURABLE))
    return {
        "module not found": (["no_such_pkg.models:build"], "module 'no_such_pkg.models' not found"),
        "file not found": ([f"{tmp_path}/missing.py:build"], "not found"),
        "factory not found": ([f"{TINY}_nope"], "has no callable 'gpt_tiny_nope'"),
        "factory raises": ([f"{model}:broken"], "raised ValueError: no weights here"),
        "uncapturable": ([f"{model}:build"], "neither tracer"),
        "export only": ([f"{model}:build", "--tracer", "export"], "--tracer fx"),
        "input mismatch": ([TINY, "--input", "float32[2,16]"], "do not fit the model"),
        "malformed input": ([TINY, "--input", "int64(2,16)"], "input spec"),
        "unknown device": ([TINY, "--estimate", "h100-sxm,h900"], "unknown device type 'h900'"),
        "unknown precision": ([TINY, "--estimate", "a100-80g", "--estimate-precision", "fp8"],
                              "unknown estimate precision 'fp8'"),
        "unknown tracer": ([TINY, "--tracer", "jit"], "--tracer must be one of"),
        "bad repeats": ([TINY, "--repeats", "0"], "--repeats must be"),
        "no model": ([], "missing MODEL"),
        "one rank": (["--probe-links"], "at least 2 ranks"),
    }


@pytest.mark.parametrize("case", ["module not found", "file not found", "factory not found", "factory raises",
                                  "uncapturable", "export only", "input mismatch", "malformed input",
                                  "unknown device", "unknown precision", "unknown tracer", "bad repeats", "no model", "one rank"])
def test_bad_input_gives_one_error_line_and_no_file(tmp_path, monkeypatch, case):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args, expected = bad_cases(tmp_path)[case]
    out = tmp_path / "out.json"
    code, _, stderr = invoke("-o", str(out), "--repeats", "1", *args)
    assert code != 0
    assert expected in one_error_line(stderr)
    assert not out.exists()


def test_unwritable_output_is_refused_before_measuring(tmp_path):
    out = tmp_path / "no_such_dir" / "p.json"
    code, _, stderr = invoke("planner.examples.gpt:gpt_medium", "-o", str(out))  # would take long if measured
    assert code != 0 and "does not exist" in one_error_line(stderr)
    assert not out.exists()


def test_probe_with_a_model_needs_a_cluster_path(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, stderr = invoke(TINY, "--probe-links", "-o", str(tmp_path / "p.json"))
    assert code == 2 and "--cluster-out" in one_error_line(stderr)
