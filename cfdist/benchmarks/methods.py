"""The checkpointing methods the benchmark compares, each behind one small interface.

A method owns what happens in the *optimizer phase* of an iteration (:meth:`Method.phase`):
the optimizer step plus its checkpoint work and waits. The runner times that call from the
outside, identically for every method. Methods (names as in ``results.json``):

* ``none``: no checkpointing, the baseline;
* ``torch.save``: rank 0 ``torch.save`` of model + optimizer state, then fsync (synchronous);
* ``dcp.save``: ``torch.distributed.checkpoint.save`` on every rank (synchronous, collective);
* ``dcp.async``: DCP's best CPU configuration: ``async_save`` with a long-lived
  ``DefaultStager(use_async_staging=True)``; the next optimizer step waits on the previous
  save's ``staging_completion``, the next save on its ``upload_completion``;
* ``dcp.async-await``: the same long-lived stager with staging done inside the call
  (``use_async_staging=False``: staging awaited at once);
* ``dcp.no_dist``: rank 0 only, ``async_save(no_dist=True)`` with background staging (rank-local);
* ``cfdist``: ``cfdist.Checkpointer`` (writer thread), ``cfdist.process`` (writer process),
  ``cfdist.rootsN`` (striped over N storage roots), ``cfdist.auto`` (``Auto(max_overhead=0.035, profile_steps=10)``), ``cfdist.auto.budget25`` (the same
  under ``host_memory=0.25``).

Every method keeps one committed checkpoint (the previous one is deleted once a newer exists).
cfdist's snapshot modes: on a CPU machine there is one (host memory); the ``gpu`` mode (a copy
into spare GPU memory) and pinned copies on a side stream run in ``bench/gpu_check.py``.
"""

from __future__ import annotations

import os
import shutil

import torch

CORE = ["none", "torch.save", "dcp.save", "dcp.async", "dcp.async-await", "dcp.no_dist", "cfdist",
        "cfdist.process", "cfdist.roots2", "cfdist.roots4"]
DCP = ["dcp.save", "dcp.async", "dcp.async-await", "dcp.no_dist"]
PEERS = ["torch.save"] + DCP


def state_dict(model, opt) -> dict:
    m = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {"model": m.state_dict(), "optim": opt.state_dict()}


class Method:
    """One method's optimizer phase. Built on every rank, in the same order."""

    name = "none"

    def __init__(self, *, model, opt, outdir: str, rank: int, world: int, k: int, pg=None):
        self.model, self.opt, self.outdir, self.rank, self.world, self.k, self.pg = \
            model, opt, outdir, rank, world, k, pg
        self.taken = 0

    def is_checkpoint(self, step: int) -> bool:
        """Steps 1, k+1, 2k+1, ...: the first checkpoint warms the method's buffers up."""
        return (step - 1) % self.k == 0

    def phase(self, step: int) -> bool:
        """Optimizer step + checkpoint work; returns whether a checkpoint was started."""
        self.opt.step()
        if self.is_checkpoint(step):
            self.taken += 1
            self.save(step)
            return True
        return False

    def save(self, step: int) -> None:
        pass

    def drain(self) -> None:
        """Block until every checkpoint started has committed."""

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class TorchSave(Method):
    name = "torch.save"

    def save(self, step: int) -> None:
        if self.rank != 0:
            return
        path = os.path.join(self.outdir, f"ckpt-{step}.pt")
        torch.save(state_dict(self.model, self.opt), path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        prev = os.path.join(self.outdir, f"ckpt-{step - self.k}.pt")
        if os.path.exists(prev):
            os.remove(prev)


class DCPSave(Method):
    name = "dcp.save"

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state_dict(self.model, self.opt), checkpoint_id=os.path.join(self.outdir, f"dcp-{step}"),
                 process_group=self.pg)
        self._retire(step)

    def _retire(self, step: int) -> None:
        # the previous checkpoint goes once this one committed (rank 0 deletes)
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.outdir, f"dcp-{step - self.k}"), ignore_errors=True)


class DCPAsync(DCPSave):
    """``async_save`` with a long-lived ``DefaultStager`` (DCP's best configuration on CPU)."""

    name = "dcp.async"
    background_staging = True
    no_dist = False

    def __init__(self, **kw):
        super().__init__(**kw)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # pinned memory and non-blocking copies need an accelerator; shared memory only
        # serves the process executor: off on CPU with the thread executor.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=self.background_staging,
                                                   use_non_blocking_copy=False))
        self.staging = None
        self.upload = None
        self.upload_step = None

    def phase(self, step: int) -> bool:
        if self.staging is not None:   # the gate: the copy must finish before the update
            self.staging.result()
            self.staging = None
        return super().phase(step)

    def writes(self) -> bool:
        return not self.no_dist or self.rank == 0

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if not self.writes():
            return
        self._finish_upload()          # one save in flight, as DCP's docs require
        out = dcp.async_save(state_dict(self.model, self.opt),
                             checkpoint_id=os.path.join(self.outdir, f"dcp-{step}"),
                             process_group=None if self.no_dist else self.pg, async_stager=self.stager,
                             no_dist=self.no_dist)
        if hasattr(out, "staging_completion"):
            self.staging, self.upload = out.staging_completion, out.upload_completion
        else:
            self.upload = out
        self.upload_step = step

    def _finish_upload(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            self._retire(self.upload_step)

    def _retire(self, step: int) -> None:
        if self.writes() and self.rank == 0:
            shutil.rmtree(os.path.join(self.outdir, f"dcp-{step - self.k}"), ignore_errors=True)

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        self._finish_upload()

    def close(self) -> None:
        self.drain()
        self.stager.close()


class DCPAsyncAwait(DCPAsync):
    name = "dcp.async-await"
    background_staging = False


class DCPNoDist(DCPAsync):
    name = "dcp.no_dist"
    no_dist = True


class Cfdist(Method):
    name = "cfdist"
    backend = "thread"
    roots = 1
    auto = False
    host_memory: float | None = None

    def __init__(self, **kw):
        super().__init__(**kw)
        import cfdist

        urls = [f"file://{self.outdir}/root{j}" for j in range(self.roots)]
        # Auto profiles 10 steps (its minimum) instead of 50, so a short run reaches its k
        policy = (cfdist.Auto(max_overhead=0.035, profile_steps=10) if self.auto
                  else _FromStepOne(cfdist.Every(self.k)))
        self.ckpt = cfdist.Checkpointer({"model": self.model, "optim": self.opt},
                                        urls if self.roots > 1 else urls[0], policy=policy,
                                        host_memory=self.host_memory,
                                        persist=cfdist.PersistOptions(backend=self.backend))

    def phase(self, step: int) -> bool:
        before = self.ckpt._stats["snapshots"]   # counts every snapshot started, whatever the policy
        self.ckpt.step(self.opt)
        took = self.ckpt._stats["snapshots"] != before
        self.taken += took
        return took

    def drain(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()

    def stats(self) -> dict:
        s = self.ckpt.stats
        keep = ("k", "mode", "checkpoints", "bytes", "mean_persist_s", "mean_snapshot_s", "mean_stall_s",
                "total_stall_s", "errors", "last_error", "host_memory", "chunk_waits", "arena_bytes")
        return {k: s.get(k) for k in keep}


class _FromStepOne:
    """``Every(k)`` shifted to steps 1, k+1, 2k+1, ... like the other methods (see ``is_checkpoint``)."""

    def __init__(self, every):
        self.every = every

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return self.every.should_checkpoint(step + self.every.k - 1, epoch_end=epoch_end)

    def __getattr__(self, name):
        return getattr(self.every, name)


def _warm_child() -> None:
    import cfdist.checkpoint.persist  # noqa: F401 - the writer process's imports, done before timing


class CfdistProcess(Cfdist):
    name = "cfdist.process"
    backend = "process"

    def __init__(self, **kw):
        super().__init__(**kw)
        if self.ckpt.writer:   # start the writer process now: a long run pays its start-up once
            self.ckpt.backend._ex.submit(_warm_child).result()


class CfdistAuto(Cfdist):
    name = "cfdist.auto"
    auto = True


class CfdistAutoBudget(CfdistAuto):
    """``Auto`` under a host-memory budget of a quarter of the state: it profiles the streamed
    snapshot, chunk waits included, and picks its interval from those costs."""

    name = "cfdist.auto.budget25"
    host_memory = 0.25


def _roots(n: int):
    return type(f"CfdistRoots{n}", (Cfdist,), {"name": f"cfdist.roots{n}", "roots": n})


def _budget(percent: int):
    """cfdist under ``host_memory=percent/100`` of the state (streamed through a chunk pool)."""
    return type(f"CfdistBudget{percent}", (Cfdist,), {"name": f"cfdist.budget{percent}",
                                                      "host_memory": percent / 100})


BUDGETS = (100, 50, 25, 10)
"""Host-memory budgets (% of the state) ``cfdist bench`` measures the trade-off at."""

METHODS: dict[str, type[Method]] = {c.name: c for c in (
    Method, TorchSave, DCPSave, DCPAsync, DCPAsyncAwait, DCPNoDist, Cfdist, CfdistProcess, CfdistAuto, CfdistAutoBudget,
    _roots(2), _roots(3), _roots(4), *(_budget(p) for p in BUDGETS))}


def make(name: str, **kw) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name](**kw)
