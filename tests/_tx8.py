"""An 8-layer transformer none of the bundled examples resembles (issue 22's memory-tight case): `plan profile tests/_tx8.py:tx8 --estimate <every catalog type>` (scripts/update_golden.sh --profiles) wrote tests/golden/profiles/tx8.json."""
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d); self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d); self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

class TX(nn.Module):
    def __init__(self, vocab=2048, d=256, h=4, n=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, h) for _ in range(n)])
        self.ln = nn.LayerNorm(d); self.head = nn.Linear(d, vocab)
    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx))))

def tx8():
    torch.manual_seed(0)
    return TX(), (torch.randint(0, 2048, (4, 64)),)
