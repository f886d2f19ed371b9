"""Codecs under a host-memory budget on 2 gloo ranks, with ``writers=True`` (each rank keeps its own
copy, as ``local_rank == 0`` does on each node) and double buffering, and with one writer whose
disk hangs so that a framed persist is given up (``PersistOptions.timeout_s``).

Real: 2 spawned processes in a gloo process group (FileStore in tmp_path), DDP over an embedding
table and an MLP under Adagrad, the Checkpointer's persist pipeline with its thread backend,
``file://`` storage in tmp_path with fsync and renames, ``cfdist.load`` decoding. Faked: in the
second case rank 0's disk hangs under step 4 (``cfdist.testing.hang``), as a dead NFS server would.
"""

from __future__ import annotations

import json
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.codecs import Incremental, Zstd
from cfdist.storage import open_storage
from cfdist.testing import hang
from tests.distributed.ranks import gloo_cases, run_ranks

STEPS, EVERY, HUNG = 10, 2, 4


class _Net(torch.nn.Module):
    """An embedding table (a few rows change per step) and a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mlp = torch.nn.Embedding(2000, 16), torch.nn.Linear(16, 4)

    def forward(self, ids):
        return self.mlp(self.emb(ids))


def _worker(rank: int, world: int, store_path: str, root: str, out: str) -> None:
    gloo_cases(rank, world, store_path, out,
               [(c, lambda c=c: _case(rank, f"{root}/{c}", c)) for c in ("copies", "hung")])


def _case(rank: int, path: str, case: str) -> dict:
    m = _Net()
    ddp = DDP(m)
    opt = torch.optim.Adagrad(ddp.parameters(), lr=0.05)
    url = f"file://{path}/rank{rank}" if case == "copies" else f"file://{path}"
    st = open_storage(url)
    if case == "hung" and rank == 0:
        st = hang(st, hang_after_bytes=0, only=f"step-{HUNG:09d}")
    ckpt = cfdist.Checkpointer({"model": ddp, "optim": opt}, st, cfdist.Every(EVERY), keep=100,
                               writers=True if case == "copies" else "node", buffers=2 if case == "copies" else 1,
                               host_memory=0.25, codecs=[Incremental(full_every=3), Zstd()],
                               persist=cfdist.PersistOptions(timeout_s=None if case == "copies" else 3.0),
                               group=cfdist.GroupOptions(agree_timeout_s=120))
    want = {}
    for i in range(STEPS):
        ids = torch.randint(0, 2000, (8,), generator=torch.Generator().manual_seed(100 * i + rank))
        ddp(ids).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
        if ckpt.step_count % EVERY == 0:
            want[ckpt.step_count] = {k: v.clone() for k, v in ddp.state_dict().items()}
    try:
        ckpt.close()
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test process
        raised = f"{type(e).__name__}: {e}"
    res = {"errors": ckpt.stats["errors"], "writer": ckpt.writer, "close_raised": raised}
    if case == "hung" and rank == 0:
        st.release()
        for t in [t for t in threading.enumerate() if t.name == f"cfdist-persist-{HUNG}"]:
            t.join(60)
    dist.barrier()
    if ckpt.writer:
        res["committed"] = committed_steps(open_storage(url))
        res["exact"] = {s: all(torch.equal(cfdist.load(url, step=s)["state"]["model"][k], t) for k, t in w.items())
                        for s, w in want.items() if s in res["committed"]}
    return res


def test_codecs_under_a_budget_on_two_ranks_copies_and_a_given_up_persist(tmp_path):
    """``writers=True`` with ``buffers=2``: both ranks commit every checkpoint to their own roots,
    each loading bit-exact; one writer whose disk hangs under step 4: the framed persist is given
    up after ``timeout_s`` (its chunks back to the pool, its chain update never applied), and
    every other step commits and decodes bit-exact (the steps after it included)."""
    out = tmp_path / "out"
    out.mkdir()
    codes = run_ranks(_worker, lambda r: (r, 2, str(tmp_path / "store"), str(tmp_path / "ckpt"), str(out)),
                      world=2, timeout_s=300)
    assert codes == [0, 0], codes
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    steps = list(range(EVERY, STEPS + 1, EVERY))
    for r in range(2):   # writers=True: each rank's own copy, every checkpoint, bit-exact
        c = res[r]["copies"]
        assert c["writer"] and c["errors"] == 0 and c["close_raised"] is None, c
        assert c["committed"] == steps and all(c["exact"].values()), c
    h = res[0]["hung"]   # step 4 given up on the writer; the others committed, bit-exact
    assert h["errors"] == 1 and f"step {HUNG}" in (h["close_raised"] or ""), h
    assert h["committed"] == [s for s in steps if s != HUNG] and all(h["exact"].values()), h
    assert not res[1]["hung"]["writer"] and res[1]["hung"]["errors"] == 0, res[1]["hung"]
