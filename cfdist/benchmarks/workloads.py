"""The models the benchmark trains: an MLP, a ResNet-like CNN, a GPT-like transformer, a DLRM.

Each :func:`build` call returns a :class:`Workload`: a model, an Adam optimizer and a batch
function, sized so that model + Adam state is about ``state_mb`` megabytes (Adam keeps two
moments per parameter, so the state is ~12 bytes per parameter). Sizes are reached by
scaling one width; compute per step stays small enough for a 2-core CPU machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

WORKLOADS = ("mlp", "cnn", "gpt", "dlrm")
BYTES_PER_PARAM = 12   # fp32 parameter + Adam's exp_avg and exp_avg_sq


@dataclass
class Workload:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple]
    """``batch(i)`` -> the inputs of step ``i`` (a few fixed tensors, cycled)."""
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    describe: str

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def state_bytes(self) -> int:
        """Bytes of model + optimizer tensors, as a checkpoint holds them."""
        n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for s in self.optimizer.state.values():
            n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        return n


def _cycle(tensors: list[tuple]) -> Callable[[int], tuple]:
    return lambda i: tensors[i % len(tensors)]


def mlp(state_mb: float, seed: int) -> tuple[nn.Module, Callable, Callable, str]:
    """16 square Linear layers (16 x 1024^2 is ~200 MB with Adam)."""
    layers = 16
    width = max(32, round(math.sqrt(state_mb * 1e6 / BYTES_PER_PARAM / layers) / 32) * 32)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())],
                          nn.Linear(width, 1))
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(64, width, generator=g),) for _ in range(4)]
    return model, _cycle(data), lambda m, b: m(b[0]).square().mean(), f"MLP {layers} x {width}^2, batch 64"


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(x + self.b2(self.c2(y)))


def cnn(state_mb: float, seed: int):
    """ResNet-like: a stem, 4 residual blocks with BatchNorm at 4x4, a classifier; 4 images of 8x8."""
    blocks = 4
    c = max(8, int(math.sqrt(state_mb * 1e6 / BYTES_PER_PARAM / (blocks * 18))))
    model = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                          *[_Block(c) for _ in range(blocks)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(c, 10))
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(4)]
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])   # noqa: E731
    return model, _cycle(data), loss, f"ResNet-like CNN, {blocks} blocks x {c} channels + BatchNorm, batch 4x3x8x8"


class _GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, nhead=max(1, d // 64), dim_feedforward=4 * d, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))


def gpt(state_mb: float, seed: int):
    """GPT-like decoder: 4 pre-norm causal layers, vocab 8192 (1024 below 64 MB); 4 sequences of 32 tokens."""
    layers, vocab, seq = 4, 8192 if state_mb >= 64 else 1024, 32
    # params ~= layers * 12 d^2 + 2 * vocab * d
    per = state_mb * 1e6 / BYTES_PER_PARAM
    d = int((-2 * vocab + math.sqrt(4 * vocab ** 2 + 48 * layers * per)) / (24 * layers))
    d = max(64, d // 64 * 64)
    model = _GPT(vocab, d, layers, seq)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randint(0, vocab, (4, seq + 1), generator=g),) for _ in range(4)]

    def loss(m, b):
        logits = m(b[0][:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[0][:, 1:].reshape(-1))

    return model, _cycle(data), loss, f"GPT-like, {layers} layers, d={d}, vocab {vocab}, batch 4x{seq}"


class _DLRM(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, dense: int):
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense, sparse):
        z = [self.bottom(dense)] + [e(sparse[:, j]) for j, e in enumerate(self.emb)]
        t = torch.stack(z, 1)
        inter = t @ t.transpose(1, 2)
        i, j = torch.triu_indices(t.shape[1], t.shape[1], 1)
        return self.top(torch.cat([z[0], inter[:, i, j]], 1)).squeeze(1)


def dlrm(state_mb: float, seed: int):
    """DLRM-like: 8 embedding tables (dense gradients, Adam) + bottom/top MLPs; batch 128."""
    tables, dim, dense = 8, 64, 16
    rows = max(64, int(state_mb * 1e6 / BYTES_PER_PARAM / (tables * dim)))
    model = _DLRM(tables, rows, dim, dense)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(128, dense, generator=g), torch.randint(0, rows, (128, tables, 4), generator=g),
             torch.rand(128, generator=g)) for _ in range(4)]
    loss = lambda m, b: nn.functional.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2])   # noqa: E731
    return model, _cycle(data), loss, f"DLRM-like, {tables} tables x {rows} x {dim} + MLPs, batch 128"


_BUILDERS = {"mlp": mlp, "cnn": cnn, "gpt": gpt, "dlrm": dlrm}


def build(name: str, state_mb: float, *, seed: int = 0, rank: int = 0) -> Workload:
    """A fresh model (same weights on every rank) with Adam; inputs differ per rank."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if not state_mb > 0:
        raise ValueError(f"state_mb must be > 0 (megabytes of model + Adam state), got {state_mb!r}")
    torch.manual_seed(seed)
    model, batch, loss, describe = _BUILDERS[name](state_mb, seed + 1000 * (rank + 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return Workload(name=name, model=model, optimizer=opt, batch=batch, loss=loss, describe=describe)
