"""Model specs, factories, input specs and micro-batch rescaling."""

from __future__ import annotations

import textwrap

import pytest
import torch

from planner.errors import ModelError, UsageError
from planner.profile.loader import InputSpec, load_factory, parse_input_spec, rescale_batch


def test_parse_input_spec_golden():
    assert parse_input_spec("float32[4,3,64,64],int64[4]") == (
        InputSpec(torch.float32, (4, 3, 64, 64)), InputSpec(torch.int64, (4,)))
    assert parse_input_spec(" int64[8, 128]<50257 ") == (InputSpec(torch.int64, (8, 128), 50257),)
    assert parse_input_spec("float32[]") == (InputSpec(torch.float32, ()),)


@pytest.mark.parametrize("text", ["int64(8,128)", "float32[4,3", "", "int64[8],,"])
def test_malformed_input_specs(text):
    with pytest.raises(UsageError, match="input spec"):
        parse_input_spec(text)


def test_unknown_dtype():
    with pytest.raises(UsageError, match="unknown dtype 'f32'"):
        parse_input_spec("f32[2]")


def write(tmp_path, body: str):
    path = tmp_path / "model_file.py"
    path.write_text(textwrap.dedent(body))
    return path


MODULE_ONLY = """
    import torch
    from torch import nn

    def build():
        return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 4))

    def broken():
        raise RuntimeError("weights file missing")
"""


def test_module_only_factory_needs_an_input_spec(tmp_path):
    path = write(tmp_path, MODULE_ONLY)
    with pytest.raises(UsageError, match="--input"):
        load_factory(f"{path}:build")
    module, (x,) = load_factory(f"{path}:build", "int64[3,5]")
    assert x.shape == (3, 5) and x.dtype == torch.int64 and int(x.max()) < 50  # bounded by num_embeddings
    assert module(x).shape == (3, 5, 4)


def test_package_factory_and_microbatch_size():
    module, (idx,) = load_factory("planner.examples.gpt:gpt_tiny", microbatch_size=5)
    assert idx.shape == (5, 16)
    _, (orig,) = load_factory("planner.examples.gpt:gpt_tiny")
    assert torch.equal(idx[:2], orig) and torch.equal(idx[2:4], orig)


def test_rescale_leaves_non_batch_tensors_alone():
    a, b = torch.zeros(4, 2), torch.zeros(3)
    out = rescale_batch((a, b), 2)
    assert out[0].shape == (2, 2) and out[1] is b


@pytest.mark.parametrize("spec,pattern", [
    ("no_such_package.models:build", "module 'no_such_package.models' not found"),
    ("planner.examples.gpt:no_such_factory", "has no callable 'no_such_factory'"),
    ("/nonexistent/model.py:build", "not found"),
    ("planner.examples.gpt", "must be 'package.module:factory'"),
])
def test_bad_model_specs(spec, pattern):
    with pytest.raises((ModelError, UsageError), match=pattern):
        load_factory(spec)


def test_factory_that_raises(tmp_path):
    path = write(tmp_path, MODULE_ONLY)
    with pytest.raises(ModelError, match="raised RuntimeError: weights file missing"):
        load_factory(f"{path}:broken")
