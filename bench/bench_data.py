"""Cost of resumable data loading, side by side with a plain DataLoader, in one run.

    python bench/bench_data.py                 # defaults: a few seconds on a laptop core
    python bench/bench_data.py --n 1000000 --batch 256 --world 8

Table 1, per-batch overhead: a full epoch through ``torch.utils.data.DataLoader(shuffle=True)``
and through ``ResumableLoader`` over the same in-memory tensors (``num_workers=0``, so the
loader's own bookkeeping is not hidden behind workers); best of ``--repeats`` epochs.

Table 2, resume time vs position in the epoch: ``load_state_dict`` + the first batch with
``ResumableLoader`` (builds the rest of the plan; reads no skipped sample), against replaying
a plain DataLoader up to the same batch (what resuming without a partition function costs).
The first should be flat in the position, the second linear.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from cfdist.data import ResumableLoader


class Rows(Dataset):
    """``n`` rows of ``dim`` float32 features and an int label, in memory."""

    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def epoch_seconds(loader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(1 for _ in loader)
    return time.perf_counter() - t0, n


def per_batch_overhead(ds: Rows, batch: int, repeats: int) -> None:
    plain = DataLoader(ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    ours = ResumableLoader(ds, batch, seed=0, rank=0, world_size=1)
    best = {"DataLoader(shuffle=True)": float("inf"), "ResumableLoader": float("inf")}
    batches = 0
    for _ in range(repeats):  # interleaved, so both see the same machine load
        for name, loader in (("DataLoader(shuffle=True)", plain), ("ResumableLoader", ours)):
            s, batches = epoch_seconds(loader)
            best[name] = min(best[name], s / batches)
    base = best["DataLoader(shuffle=True)"]
    print(f"\nper-batch time, {len(ds)} samples, batch {batch}, {batches} batches/epoch, best of {repeats}")
    print(f"{'loader':<26}{'us/batch':>10}{'overhead us':>13}{'ratio':>8}")
    for name, s in best.items():
        print(f"{name:<26}{s * 1e6:>10.1f}{(s - base) * 1e6:>13.1f}{s / base:>8.3f}")


def resume_vs_position(ds: Rows, batch: int, world: int, fractions: list[float]) -> None:
    full = ResumableLoader(ds, batch, seed=0, rank=0, world_size=world)
    steps = len(full)
    print(f"\nresume time vs position, {len(ds)} samples, batch {batch} x {world} ranks, {steps} steps/epoch")
    print(f"{'position':>9}{'step':>7}{'ResumableLoader ms':>20}{'replay DataLoader ms':>22}{'ratio':>8}")
    for frac in fractions:
        k = min(int(frac * steps), steps - 1)
        src = ResumableLoader(ds, batch, seed=0, rank=0, world_size=world)
        it = iter(src)
        for _ in range(k):  # get a real state at step k (not timed)
            next(it)
        state = src.state_dict()

        t0 = time.perf_counter()
        resumed = ResumableLoader(ds, batch, seed=0, rank=0, world_size=world)
        resumed.load_state_dict(state)
        next(iter(resumed))
        ours = time.perf_counter() - t0

        t0 = time.perf_counter()
        plain = DataLoader(ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
        pit = iter(plain)
        for _ in range(k + 1):  # replay: read and discard every batch before the resume point
            next(pit)
        replay = time.perf_counter() - t0
        print(f"{frac:>8.0%}{k:>7}{ours * 1e3:>20.2f}{replay * 1e3:>22.2f}{replay / ours:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="samples in the dataset")
    p.add_argument("--dim", type=int, default=16, help="features per sample")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    p.add_argument("--world", type=int, default=1, help="ranks sharing the epoch (resume table)")
    p.add_argument("--repeats", type=int, default=3, help="epochs per loader for table 1")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = Rows(args.n, args.dim)
    per_batch_overhead(ds, args.batch, args.repeats)
    resume_vs_position(ds, args.batch, args.world, [0.0, 0.1, 0.25, 0.5, 0.75, 0.99])


if __name__ == "__main__":
    main()
