"""The model zoo of the bit-exact resume tests: small versions of models people train.

Not a test module. Each builder returns a :class:`Spec`: the state to checkpoint and one
training iteration (forward, backward, and the update through ``ckpt.step`` or, in the
uninterrupted reference, the plain optimizer/scaler calls). Batches are a pure function of
``(seed, step, micro-batch, rank)``, so the runs need no data state; the randomness a resume
must reproduce is the model's own (dropout, per rank) and the optimizer, scheduler, scaler and
BatchNorm state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Spec:
    model: nn.Module
    """What training calls (DDP or ``torch.compile`` wrappers included)."""
    optim: torch.optim.Optimizer
    sched: object | None
    batch: Callable[[torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    scaler: torch.amp.GradScaler | None = None
    micro: int = 1
    """Micro-batches per update (gradient accumulation; ``no_sync`` on all but the last)."""
    autocast: torch.dtype | None = None
    extra: dict = field(default_factory=dict)

    def state(self) -> dict:
        s = {"model": self.model, "optim": self.optim}
        if self.sched is not None:
            s["sched"] = self.sched
        if self.scaler is not None:
            s["scaler"] = self.scaler
        return s

    def iteration(self, step: int, seed: int, rank: int, ckpt) -> None:
        """One update: ``micro`` forward/backward passes, then the optimizer step."""
        for m in range(self.micro):
            g = torch.Generator().manual_seed(((seed * 1009 + step) * 31 + m) * 17 + rank)
            data = self.batch(g)
            last = m == self.micro - 1
            sync = self.model.no_sync() if (not last and hasattr(self.model, "no_sync")) else _Null()
            with sync:
                if self.autocast is not None:
                    with torch.autocast("cpu", dtype=self.autocast):
                        loss = self.loss(self.model, data)
                else:
                    loss = self.loss(self.model, data)
                loss = loss / self.micro
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if ckpt is not None:
            ckpt.step(self.optim, scaler=self.scaler)
        elif self.scaler is not None:
            self.scaler.step(self.optim)
            self.scaler.update()
        else:
            self.optim.step()
        if self.sched is not None:
            self.sched.step()
        self.optim.zero_grad()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _ddp(model: nn.Module, world: int) -> nn.Module:
    """DDP on the job's gloo group (one rank too: ``no_sync`` and the wrapper's state dict keys).

    Above two ranks ``find_unused_parameters=True``: by default DDP rebuilds its gradient buckets
    after its first backward, so a job started from a checkpoint sums some gradient elements in
    another order on its first step than the uninterrupted job does on that step (a ring
    all-reduce adds the ranks in an order that depends on an element's position in its bucket;
    with two ranks ``a + b == b + a``). The flag keeps the construction-time layout. Plain DDP
    shows this without cfdist; docs/guarantees.md (bit-exact resume on CPU) documents it.
    """
    if not torch.distributed.is_initialized():
        return model
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=world > 2)


def _ce(model, data):
    x, y = data
    return F.cross_entropy(model(x).float(), y)


def cnn(total: int, world: int) -> Spec:
    """A CNN with BatchNorm and Dropout, AdamW and OneCycleLR."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4))
    model = _ddp(net, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=total)
    return Spec(model, opt, sched, lambda g: (torch.randn(8, 3, 8, 8, generator=g),
                                              torch.randint(0, 4, (8,), generator=g)), _ce)


class _Tiny(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


def transformer(total: int, world: int) -> Spec:
    """A small transformer encoder with dropout, AdamW and warm-up + cosine (SequentialLR)."""
    torch.manual_seed(0)
    model = _ddp(_Tiny(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warm = 4
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm)], milestones=[warm])

    def batch(g):
        x = torch.randint(0, 50, (4, 12), generator=g)
        return x, torch.roll(x, 1, dims=1)

    def loss(m, data):
        x, y = data
        return F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())

    return Spec(model, opt, sched, batch, loss)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))


def _mlp_batch(g):
    x = torch.randn(8, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def amp(total: int, world: int) -> Spec:
    """fp16 autocast on the CPU with a GradScaler (its scale grows and backs off during the run)."""
    torch.manual_seed(0)
    model = _ddp(_mlp(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
    return Spec(model, opt, sched, _mlp_batch, _ce, scaler=scaler, autocast=torch.float16)


def accum(total: int, world: int) -> Spec:
    """Gradient accumulation: 3 micro-batches per update, ``no_sync`` on the first two."""
    torch.manual_seed(0)
    model = _ddp(_mlp(), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return Spec(model, opt, sched, _mlp_batch, _ce, micro=3)


class _SkipGram(nn.Module):
    def __init__(self, vocab: int = 200, d: int = 16):
        super().__init__()
        self.words = nn.Embedding(vocab, d, sparse=True)
        self.contexts = nn.Embedding(vocab, d, sparse=True)

    def forward(self, u, v):
        return (F.dropout(self.words(u), 0.1, self.training) * self.contexts(v)).sum(-1)


def sparse(total: int, world: int) -> Spec:
    """An embedding model with sparse gradients (``Embedding(sparse=True)``) and SparseAdam."""
    torch.manual_seed(0)
    model = _SkipGram()
    if world > 1:
        raise ValueError("the sparse model runs on one rank")
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)

    def batch(g):
        u = torch.randint(0, 200, (32,), generator=g)
        v = torch.randint(0, 200, (32,), generator=g)
        return u, v, ((u + v) % 3 == 0).float()

    def loss(m, data):
        u, v, y = data
        return F.binary_cross_entropy_with_logits(m(u, v), y)

    return Spec(model, opt, None, batch, loss)


def compiled(total: int, world: int) -> Spec:
    """``torch.compile`` (inductor) of an MLP with LayerNorm and Dropout, Adam."""
    torch.manual_seed(0)
    model = torch.compile(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return Spec(model, opt, sched, _mlp_batch, _ce)


MODELS = {"cnn": cnn, "transformer": transformer, "amp": amp, "accum": accum, "sparse": sparse,
          "compile": compiled}
