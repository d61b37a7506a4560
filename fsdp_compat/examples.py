"""A small GPT-style model used by the demo, the benchmarks and the tests.

It deliberately has what trips sharding code up: a vocabulary size that no world size divides
(uneven shards), an output head tied to the token embedding, a persistent buffer used in forward
and a non-persistent one (the causal mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Sizes of :class:`TinyGPT`. The defaults give about 30k parameters."""

    vocab_size: int = 37
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        # No qkv bias: the key bias gets a zero gradient (softmax ignores it), which Adam would
        # turn into pure rounding noise and spoil value-by-value comparisons.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        mask = torch.empty(config.block_size, config.block_size, dtype=torch.bool)
        self.register_buffer("causal_mask", mask, persistent=False)
        self.reset_parameters()

    causal_mask: torch.Tensor

    def reset_parameters(self) -> None:
        """Only the mask is this module's own state; it lets meta-device init rebuild it."""
        size = self.causal_mask.size(0)
        self.causal_mask.copy_(torch.tril(torch.ones(size, size, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    """The feed-forward part of a block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the usual auto-wrap unit."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT with tied input/output embeddings and a persistent ``logit_scale`` buffer."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.register_buffer("logit_scale", torch.empty(()))
        self.reset_parameters()

    logit_scale: torch.Tensor

    def reset_parameters(self) -> None:
        """Only the buffer is this module's own state; it lets meta-device init rebuild it."""
        self.logit_scale.fill_(0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.logit_scale

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (``forward`` then loss, for convenience)."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def synthetic_batch(step: int, batch_size: int, config: GPTConfig,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch of random tokens and next-token targets for ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
    return data[:, :-1].to(device), data[:, 1:].to(device)
