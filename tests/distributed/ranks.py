"""Start a job's ranks as spawned processes and wait for them, naming the ones that hang."""

from __future__ import annotations

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
