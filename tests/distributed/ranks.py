"""Start a job's ranks as spawned processes and wait for them, naming the ones that hang."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(target, args_of, world: int, timeout_s: float) -> list[int]:
    """Run ``target(*args_of(rank))`` in ``world`` spawned processes and wait up to ``timeout_s``
    for all of them; those still running then are killed and the test fails naming them.
    Returns the exit codes in rank order."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not alive, f"ranks {alive} did not end within {timeout_s:.0f} s"
    return [p.exitcode for p in procs]


def gloo_cases(rank: int, world: int, store_path: str, out: str, cases) -> None:
    """In a spawned rank: join a gloo group (a FileStore at ``store_path``), run ``cases``
    (``[(name, zero-argument callable)]``, each returning a JSON-able result) in order, and
    write ``{name: result}`` to ``<out>/rank<rank>.json`` (what ran so far, also on an error)."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    res = {}
    try:
        for name, run in cases:
            res[name] = run()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
