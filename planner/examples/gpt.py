"""A nanoGPT-style decoder (Karpathy's nanoGPT, brief): token + position embedding, pre-LN blocks,
final LayerNorm and an LM head whose weight is tied to the token embedding.

``forward(idx)`` maps token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    """Number of token ids."""
    block_size: int
    """Longest sequence (size of the position embedding)."""
    n_layer: int
    n_head: int
    n_embd: int
    """Width of the residual stream; divisible by ``n_head``."""
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2 and nanoGPT
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 x layers)
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: weights normal with std 0.02, biases zero. PyTorch's default N(0, 1) tied
        embedding gives huge logits (a first loss far above ln(vocab))."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(cfg: GPTConfig, batch: int, seq: int, seed: int = 0) -> tuple[GPT, tuple[torch.Tensor]]:
    """A GPT with seeded random weights and a seeded batch of token ids ``(batch, seq)``."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), dtype=torch.int64)
    return model, (idx,)


def gpt_tiny() -> tuple[GPT, tuple[torch.Tensor]]:
    """2 layers, width 32, batch 2 x 16 tokens: a few milliseconds per step, for tests."""
    return build(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32), batch=2, seq=16)


def gpt_small() -> tuple[GPT, tuple[torch.Tensor]]:
    """The bundled default: 6 layers, width 256, vocab 4096, batch 4 x 128 tokens (~9M parameters)."""
    return build(GPTConfig(vocab_size=4096, block_size=256, n_layer=6, n_head=8, n_embd=256), batch=4, seq=128)


def gpt_medium() -> tuple[GPT, tuple[torch.Tensor]]:
    """12 layers, width 512, vocab 8192, batch 4 x 256 tokens (~42M parameters)."""
    return build(GPTConfig(vocab_size=8192, block_size=512, n_layer=12, n_head=8, n_embd=512), batch=4, seq=256)


def gpt_bytes() -> tuple[GPT, tuple[torch.Tensor]]:
    """Byte-level (vocab 256) for the text corpus (``planner.data.text``): 4 layers, width 128, context 64,
    batch 8 x 64 bytes (~0.8M parameters)."""
    return build(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), batch=8, seq=64)

