"""``PersistOptions.timeout_s`` on 2 and 3 gloo ranks, for every ``writers`` x ``buffers``.

Real: 2 or 3 spawned processes in a gloo process group (FileStore in tmp_path), DDP over a small
MLP under Adam, the Checkpointer's persist pipeline with its thread backend, ``file://`` storage
in tmp_path with fsync and renames; with ``backend="process"``, the spawned writer processes.
Faked: rank 0's disk hangs (``hang``: every write under step 4's directory blocks until
released), as a dead NFS server or an object store that stops answering would; with the process
backend, rank 0's writer process is SIGSTOPped instead (a write stuck in the kernel).

The points, for each of ``writers="node"|"all"`` x ``buffers=1|2`` (and sliced, double-buffered
writes in writer processes; and under a host-memory budget, where the gate itself waits for the
hung writer's chunks): every rank trains to the end
while rank 0's write of step 4 is still blocked (so the timeout, not the storage coming back,
let it go on: before the persist pipeline, rank 0 waited for ever in its next ``ckpt.step`` and
the others in their backward); step 4 is declared failed on every writer (``stats``), the
other steps commit, and the late writer, released after training, never commits step 4.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.storage import open_storage
from cfdist.testing import hang
from tests.distributed.ranks import gloo_cases, run_ranks

COMBOS = [("node", 1, "thread", None), ("node", 2, "thread", None), ("all", 1, "thread", None),
          ("all", 2, "thread", None), ("all", 2, "process", None),
          # under a host-memory budget (a quarter of the state: raised to the 16 KiB minimum,
          # about half of it) the next update waits for chunks only a persist gives back
          ("node", 1, "thread", 0.25), ("all", 2, "thread", 0.25), ("node", 1, "process", 0.25)]
STEPS, EVERY, HUNG, TIMEOUT_S = 10, 2, 4, 3.0


def _worker(rank: int, world: int, store_path: str, root: str, out: str) -> None:
    gloo_cases(rank, world, store_path, out, [
        (f"{w}-{b}-{be}-{bu}", lambda w=w, b=b, be=be, bu=bu: _combo(rank, f"{root}/{w}-{b}-{be}-{bu}", w, b, be, bu))
        for w, b, be, bu in COMBOS])


def _combo(rank: int, path: str, writers: str, buffers: int, backend: str, budget: float | None) -> dict:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    st = open_storage(f"file://{path}")
    if rank == 0 and backend == "thread":   # only rank 0's disk hangs, and only under step 4
        st = hang(st, hang_after_bytes=0, only=f"step-{HUNG:09d}")
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, st, cfdist.Every(EVERY), writers=writers,
                               buffers=buffers, host_memory=budget,
                               persist=cfdist.PersistOptions(backend=backend, timeout_s=TIMEOUT_S),
                               keep=100, group=cfdist.GroupOptions(agree_timeout_s=120))
    stopped = None
    for i in range(STEPS):
        if rank == 0 and backend == "process" and i == HUNG - 1:
            ckpt.wait()                                      # step 2 is in: the writer is up
            (stopped,) = ckpt.backend.writer_pids()
            os.kill(stopped, signal.SIGSTOP)                 # a write stuck in the kernel, from step 4 on
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * i + rank))
        ddp(x).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
    try:
        ckpt.close()           # re-raises the persist's failure, once
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test process
        raised = f"{type(e).__name__}: {e}"
    res = {"stats": {k: ckpt.stats[k] for k in ("errors", "last_error", "checkpoints", "latest_step")},
           "trained": ckpt.step_count, "writer": ckpt.writer, "close_raised": raised,
           "chunk_waits": ckpt.stats.get("chunk_waits")}
    if rank == 0 and backend == "thread":
        res["still_hung_after_training"] = st.hung > 0   # nobody released it: the timeout let training go on
        st.release()
        _join_threads(f"cfdist-persist-{HUNG}")           # the late writer has returned
    elif rank == 0:
        res["still_hung_after_training"] = _stopped_or_gone(stopped)   # never continued: killed
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    dist.barrier()
    res["committed"] = committed_steps(open_storage(f"file://{path}"))
    return res


def _stopped_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "Z", "X")
    except FileNotFoundError:
        return True


def _join_threads(name: str, timeout_s: float = 60.0) -> None:
    for t in [t for t in threading.enumerate() if t.name == name]:
        t.join(timeout_s)
        if t.is_alive():
            raise AssertionError(f"the late writer thread {name} did not return within {timeout_s} s of the "
                                 f"disk being released")


@pytest.mark.parametrize("world", [2, 3])
def test_a_hung_persist_is_given_up_on_every_rank_for_every_writers_and_buffers(tmp_path, world):
    out = tmp_path / "out"
    out.mkdir()
    codes = run_ranks(_worker, lambda r: (r, world, str(tmp_path / "store"), str(tmp_path / "ckpt"), str(out)),
                      world, 300)   # a rank still running then: a hung persist blocked training
    assert codes == [0] * world
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for writers, buffers, backend, budget in COMBOS:
        combo = f"{writers}-{buffers}-{backend}-{budget}"
        r0 = res[0][combo]
        assert r0["still_hung_after_training"], f"{combo}: the hang was over before training ended"
        for r in range(world):
            got = res[r][combo]
            assert got["trained"] == STEPS, (combo, r)
            assert got["committed"] == [2, 6, 8, 10], f"{combo}, rank {r}: committed {got['committed']}"
            if got["writer"]:   # every writer declared step 4 failed, and only step 4
                s = got["stats"]
                assert s["errors"] == 1 and s["latest_step"] == STEPS, (combo, r, s)
                assert f"step {HUNG}" in s["last_error"], (combo, r, s)
                assert f"step {HUNG}" in got["close_raised"], (combo, r, got["close_raised"])
            else:
                assert got["close_raised"] is None, (combo, r, got["close_raised"])
        assert "PersistOptions.timeout_s" in r0["stats"]["last_error"], r0
        if budget is not None:   # the budget was the limit: copies waited for chunks
            assert r0["chunk_waits"] > 0, r0
