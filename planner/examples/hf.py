"""Hugging Face models built from ``transformers`` configs: random weights, ``use_cache=False``, small sizes.

Each factory returns ``(module, (input_ids,))``; the module's forward returns the logits tensor
(a thin wrapper unpacks the ``ModelOutput``), so every bundled model yields a single tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.errors import ModelError


class LogitsOnly(nn.Module):
    """Wraps a ``transformers`` model so that ``forward(input_ids)`` returns the logits tensor only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError("the Hugging Face examples need the transformers package; install it with "
                         "`pip install 'planner[hf]'` or `pip install transformers`") from None
    return transformers


def _build(config: Any, model_cls: str, vocab: int, batch: int, seq: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    transformers = _transformers()
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    idx = torch.randint(0, vocab, (batch, seq), dtype=torch.int64)
    return LogitsOnly(model), (idx,)


def gpt2_small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """GPT-2 architecture at 4 layers, width 256, vocab 4096; batch 2 x 64 tokens."""
    cfg = _transformers().GPT2Config(vocab_size=4096, n_positions=256, n_embd=256, n_layer=4, n_head=4, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    return _build(cfg, "GPT2LMHeadModel", 4096, 2, 64)


def bert_small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """BERT architecture (masked-LM head) at 4 layers, width 256, vocab 4096; batch 2 x 64 tokens."""
    cfg = _transformers().BertConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, max_position_embeddings=256, use_cache=False)
    return _build(cfg, "BertForMaskedLM", 4096, 2, 64)


def llama_small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Llama architecture (RMSNorm, rotary, SwiGLU, grouped KV heads) at 4 layers, width 256; batch 2 x 64."""
    cfg = _transformers().LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      use_cache=False)
    return _build(cfg, "LlamaForCausalLM", 4096, 2, 64)


def llama_deep() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``llama_small`` at 12 layers: deep enough for 8 pipeline stages (``bench/export.py``)."""
    cfg = _transformers().LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=12,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      use_cache=False)
    return _build(cfg, "LlamaForCausalLM", 4096, 2, 64)


def llama_1b_slice() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """TinyLlama-1.1B's shape (width 2048, SwiGLU 5632, 32 heads over 4 KV heads, vocab 32000) at 2 of its 22 layers;
    batch 1 x 512 tokens. ``bench/synth.py`` repeats its second layer to 22 for the memory-bound zero-bubble case
    (``bench/schedules.py``): 1.1B parameters, more than a 16 GB device holds with Adam."""
    cfg = _transformers().LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                      use_cache=False)
    return _build(cfg, "LlamaForCausalLM", 32000, 1, 512)
