"""The bundled example models: shapes, single-tensor outputs, the tied GPT head."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from planner.errors import ModelError
from planner.examples import gpt, resnet, unet


@pytest.fixture(scope="module")
def gpts():
    return {f.__name__: f() for f in (gpt.gpt_tiny, gpt.gpt_small, gpt.gpt_medium)}


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt_small", "gpt_medium"])
def test_gpt_factories_return_token_ids_and_a_tied_head(gpts, name):
    model, inputs = gpts[name]
    assert len(inputs) == 1
    idx = inputs[0]
    assert idx.dtype == torch.int64 and idx.dim() == 2
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == model.cfg.n_layer
    assert model.lm_head.weight is model.wte.weight
    assert int(idx.max()) < model.cfg.vocab_size


def test_gpt_tiny_returns_logits():
    model, (idx,) = gpt.gpt_tiny()
    logits = model(idx)
    assert logits.shape == (*idx.shape, model.cfg.vocab_size)


def test_gpt_sizes_grow(gpts):
    counts = [sum(p.numel() for p in gpts[n][0].parameters()) for n in ("gpt_tiny", "gpt_small", "gpt_medium")]
    assert counts == sorted(counts) and counts[0] < 100_000 < counts[1]


def test_factories_are_deterministic():
    (a, (x,)), (b, (y,)) = gpt.gpt_tiny(), gpt.gpt_tiny()
    assert torch.equal(x, y)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_resnet_small_gives_class_logits():
    model, (x,) = resnet.resnet_small()
    assert model(x).shape == (x.shape[0], 10)


def test_unet_small_keeps_the_image_shape_and_has_long_skips():
    model, (x,) = unet.unet_small()
    assert model(x).shape == x.shape
    assert len(model.down) == len(model.dec)


@pytest.mark.parametrize("name", ["gpt2_small", "bert_small", "llama_small"])
def test_hugging_face_examples_return_logits(name):
    pytest.importorskip("transformers")
    from planner.examples import hf

    model, (idx,) = getattr(hf, name)()
    with torch.no_grad():
        out = model(idx)
    assert isinstance(out, torch.Tensor) and out.shape[:2] == idx.shape
    assert model.model.config.use_cache is False


def test_hugging_face_examples_need_transformers(monkeypatch):
    from planner.examples import hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelError, match="transformers"):
        hf.gpt2_small()
