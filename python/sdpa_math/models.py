"""A small Llama-style decoder whose attention calls aten::_scaled_dot_product_attention_math
and keeps the returned probability maps, for the end-to-end checks and the demo.

RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP, tied nothing. The
loss can add an attention-entropy term computed from the maps (an entropy regulariser, one of
the uses that needs P). With `sdpa_math.enable()` the same code runs on sdpa_math's kernels.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn


@dataclasses.dataclass
class TinyLlamaConfig:
    vocab_size: int = 1024
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    mlp_dim: int = 1024
    rope_theta: float = 10000.0
    init_std: float = 0.1

    @property
    def dim(self):
        return self.heads * self.head_dim

    @classmethod
    def for_device(cls, device):
        """The sizes of the end-to-end check: head dim 128 on the GPU, 16 on the CPU."""
        if str(device).startswith("cuda"):
            return cls()
        return cls(head_dim=16, mlp_dim=256)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(length, head_dim, theta, device, dtype):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.q = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def qkv(self, x, cos, sin):
        """Query (B, heads, L, D), key and value (B, kv_heads, L, D), rotary applied."""
        B, L, _ = x.shape
        c = self.cfg
        q = self.q(x).view(B, L, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, L, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, L, c.kv_heads, c.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        out, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(B, L, -1)), probs


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.gate = nn.Linear(cfg.dim, cfg.mlp_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.mlp_dim, bias=False)
        self.down = nn.Linear(cfg.mlp_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        a, probs = self.attn(self.attn_norm(x), cos, sin)
        x = x + a
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h)), probs


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(p.shape[1] / 64))

    def forward(self, ids):
        """Returns the logits and the attention maps P of every layer, (B, heads, L, L) each."""
        x = self.embed(ids)
        cos, sin = rotary_tables(ids.shape[1], self.cfg.head_dim, self.cfg.rope_theta, ids.device, x.dtype)
        maps = []
        for block in self.blocks:
            x, probs = block(x, cos, sin)
            maps.append(probs)
        return self.head(self.norm(x)), maps


def attention_entropy(maps):
    """Mean entropy (nats) of the attention rows over layers, heads and rows."""
    return torch.stack([-(p.float() * p.float().clamp_min(1e-30).log()).sum(-1).mean() for p in maps]).mean()


def loss_of(model, ids, entropy_weight=0.0):
    logits, maps = model(ids)
    ce = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return ce + entropy_weight * attention_entropy(maps) if entropy_weight else ce


@torch.no_grad()
def greedy(model, ids, new_tokens):
    """Greedy decoding by full recomputation (no cache): each step attends over the whole prefix."""
    for _ in range(new_tokens):
        logits, _ = model(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids
