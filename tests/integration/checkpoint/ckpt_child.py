"""Training programs that checkpoint integration tests run in child processes and SIGKILL.

Not a test module. Run as a *fork server* (``python ckpt_child.py``): it imports torch and
cfdist once, then reads one JSON command per line on stdin and answers one JSON line on stdout:

* ``{"op": "start", "prog": "crash"|"bitexact"|"zoo", "args": {...}}`` -> ``{"pid": N}``: forks a
  child that runs the program and ``_exit``\\ s (0 on success, 1 with ``<out>/error-<run>.txt``);
  with ``args["group"]`` the child leads its own process group (a job that forks its ranks);
* ``{"op": "poll", "pid": N}`` -> ``{"pid": N, "code": rc}``: ``rc`` is None while it runs, the
  exit status once it ended (``-9`` after SIGKILL; the child is reaped, its status kept);
* ``{"op": "quit"}``.

A forked child is a real process with its own threads (the checkpointer's snapshot and persist
threads start after the fork), so SIGKILL stops it at an arbitrary instant, writes in flight
included; forking saves the ~2 s torch import per run that 20+ restarts would otherwise cost.
Children report through small JSON files under ``args["out"]``, written atomically.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import traceback
import warnings

import numpy as np
import torch

import cfdist
from cfdist.checkpoint import discovery
from cfdist.checkpoint.format import TMP_MARK, parse_step_dir
from cfdist.cluster.exits import exit_process
from cfdist.storage import open_storage


def report(out: str, name: str, data: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(out, name))


def leftovers(url: str, options: dict) -> list[str]:
    """Staging dirs and uncommitted step dirs at the root of ``url``."""
    st = open_storage(url, **options)
    committed = set(discovery.committed_steps(st))
    return [n for n in st.listdir("") if TMP_MARK in n
            or (parse_step_dir(n) is not None and parse_step_dir(n) not in committed)]


# ---- crash consistency -----------------------------------------------------------------------

class IndexedSamples(torch.utils.data.Dataset):
    """Sample i is (x_i, i): x_i drawn from a generator seeded by i, so it needs no storage."""

    def __init__(self, n: int, dim: int):
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.randn(self.dim, generator=torch.Generator().manual_seed(i)), i


def crash(a: dict) -> None:
    """An MLP under Adam (``a["hidden"]`` 1024: 1M parameters, about 12 MB per checkpoint), ``Every(k)``.

    Restores, reports what it restored, then trains until killed (or ``a["steps"]`` more steps,
    then closes and reports again). Without ``a["data"]`` batches come from a generator seeded
    by the step number, so the run needs no data state. With ``a["data"]`` (a sample count) a
    ``ResumableLoader`` over that many indexed samples (batch 4) is part of the checkpoint and
    every step appends what it consumed to ``<out>/a<run>-r0.jsonl`` (the format of
    ``cluster_loops.check_exactly_once``; flushed per step, so a SIGKILL loses none of it).
    ``a["options"]``: storage options (an S3 endpoint); ``a["backend"]``: the persist backend;
    ``a["stats_every"]``: report ``stats-<run>.json`` every that many steps; ``a["buffers"]``: sets
    of snapshot buffers (2: double buffering); ``a["host_memory"]``: a snapshot budget (streamed);
    ``a["codecs"]``: ``[[name in cfdist.codecs, {arguments}], ...]``.
    """
    torch.manual_seed(0)
    hidden, opts = a.get("hidden", 1024), a.get("options") or {}
    model = torch.nn.Sequential(torch.nn.Linear(512, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt}
    loader = None
    if a.get("data"):
        from cfdist.data import ResumableLoader
        loader = state["data"] = ResumableLoader(IndexedSamples(a["data"], 512), 4, seed=5, rank=0, world_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = cfdist.Checkpointer(state, a["url"], cfdist.Every(a["k"]), keep=a.get("keep", 1),
                                   storage_options=opts, persist=cfdist.PersistOptions(backend=a.get("backend", "thread")),
                                   buffers=a.get("buffers", 1), host_memory=a.get("host_memory"),
                                   codecs=[getattr(cfdist.codecs, n)(**kw) for n, kw in a.get("codecs", [])])
        left = leftovers(a["url"], opts)
        restored = ckpt.restore()
    osd = opt.state_dict()["state"]
    report(a["out"], f"restore-{a['run']}.json", {
        "restored": restored, "leftovers_after_start": left,
        "warnings": [str(w.message) for w in caught],
        "adam_steps": sorted({int(s["step"].item()) for s in osd.values()}),
    })
    start = restored or 0
    end = start + a["steps"] if a.get("steps") else None
    i = start
    log = None
    if loader is not None:
        log = open(os.path.join(a["out"], f"a{a['run']}-r0.jsonl"), "a")
        log.write(json.dumps({"restored": start, "world_size": 1}) + "\n")
        log.flush()

    def batches():
        while True:
            if loader is None:
                x = torch.randn(4, 512, generator=torch.Generator().manual_seed(i))
                yield x, None
            else:
                yield from loader

    every = a.get("stats_every")
    it = batches()
    while end is None or i < end:
        x, ids = next(it)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        ckpt.step(opt)
        i += 1
        if log is not None:
            log.write(json.dumps({"step": i, "epoch": loader.epoch, "ids": ids.tolist(),
                                  "pad": loader.last_batch_is_padding}) + "\n")
            log.flush()
        if every and i % every == 0:
            report(a["out"], f"stats-{a['run']}.json", _plain(ckpt.stats) | {"step": i})
    raised = None
    try:
        ckpt.close()
    except Exception as e:  # noqa: BLE001 - wait() re-raises an earlier persist's failure once: reported
        raised = f"{type(e).__name__}: {e}"
    if log is not None:
        log.close()
    report(a["out"], f"done-{a['run']}.json", {"step": i, "stats": _plain(ckpt.stats), "close_raised": raised})


def _plain(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}


# ---- bit-exact resume ------------------------------------------------------------------------

N_SAMPLES, BATCH, DIM = 48, 8, 16


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


class AugmentedData:
    """A tiny resumable data iterator: ``state_dict``/``load_state_dict``/``__iter__`` only.

    Each batch is augmented with noise from the *global* torch RNG (as transforms do), so the
    RNG state the checkpoint holds must be the one before the next batch is fetched. The order
    of an epoch is a function of (seed, epoch); the position is the batch index in the epoch.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.x, self.y = dataset(seed)
        self.epoch, self.pos = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])

    def __iter__(self):
        if self.pos * BATCH >= N_SAMPLES:
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        while self.pos * BATCH < N_SAMPLES:
            idx = perm[self.pos * BATCH:(self.pos + 1) * BATCH]
            self.pos += 1
            yield self.x[idx] + 0.1 * torch.randn(len(idx), DIM), self.y[idx]


class AugmentedSet(torch.utils.data.Dataset):
    """The same samples for ``ResumableLoader``; ``__getitem__`` augments with the global RNG."""

    def __init__(self, seed: int):
        self.x, self.y = dataset(seed)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(DIM), self.y[i]


def bitexact(a: dict) -> None:
    """Deterministic training: dropout, Adam, ExponentialLR stepped after ``ckpt.step``.

    ``a["url"]`` None: the uninterrupted reference with a plain ``opt.step()``. Otherwise a
    checkpointed run (``Every(k)``) that restores first and, if ``a["die"] = [step, phase]``,
    SIGKILLs itself at that step: ``"mid"`` after backward (before the optimizer step),
    ``"post"`` right after ``ckpt.step`` (a snapshot or persist may be in flight). A run that
    reaches ``a["total"]`` steps saves its final state to ``<out>/final-<run>.pt``.
    """
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a["seed"])
    random.seed(a["seed"])
    np.random.seed(a["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.93)
    if a["loader"] == "resumable":
        from cfdist.data import ResumableLoader
        data = ResumableLoader(AugmentedSet(a["seed"]), BATCH, seed=a["seed"], rank=0, world_size=1)
    else:
        data = AugmentedData(a["seed"])
    ckpt, step = None, 0
    if a["url"] is not None:
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched, "data": data},
                                   a["url"], cfdist.Every(a["k"]), keep=2)
        step = ckpt.restore() or 0
        report(a["out"], f"restore-{a['run']}.json", {"restored": step})
    die = a.get("die")
    while step < a["total"]:
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if die and die[0] == step + 1 and die[1] == "mid":
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt is not None:
                ckpt.step(opt)
            else:
                opt.step()
            sched.step()
            step += 1
            if die and die[0] == step and die[1] == "post":
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= a["total"]:
                break
    if ckpt is not None:
        ckpt.close()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "data": data.state_dict(), "rng": torch.get_rng_state()},
               os.path.join(a["out"], f"final-{a['run']}.pt"))


# ---- the model zoo: whole jobs (one or several gloo ranks) killed and restarted -----------------

def zoo(a: dict) -> None:
    """A job of ``a["world"]`` ranks training zoo model ``a["model"]`` for ``a["total"]`` updates.

    With one rank the job is this process. With several, this process is the launcher: it
    forks the ranks (they share its process group, so the test kills the whole job with one
    ``killpg``), waits for them, and fails with the first failing rank's traceback. Each rank
    seeds its RNG with ``seed + rank`` (per-rank dropout masks). ``a["url"]`` None: the
    uninterrupted reference, no cfdist at all; else ``Every(a["k"])`` checkpoints and a restore
    first. Rank 0 reports ``restore-<run>.json`` and ``progress-<run>.json`` (updates done);
    every rank saves its final state to ``final-<run>-rank<r>.pt``.
    """
    world = a.get("world", 1)
    if world == 1:
        return zoo_rank(a, 0)
    ranks = {}
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                zoo_rank(a, r)
            except BaseException:  # noqa: BLE001 - reported to the launcher, which fails on it
                code = 1
                with open(os.path.join(a["out"], f"error-{a['run']}-rank{r}.txt"), "w") as f:
                    f.write(traceback.format_exc())
            exit_process(code)
        ranks[pid] = r
    failed = None
    while ranks:
        pid, status = os.wait()
        r = ranks.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and failed is None:
            failed = r
            for other in ranks:    # the others would wait in a collective forever
                os.kill(other, signal.SIGKILL)
    if failed is not None:
        path = os.path.join(a["out"], f"error-{a['run']}-rank{failed}.txt")
        raise RuntimeError(f"rank {failed} failed:\n" + (open(path).read() if os.path.exists(path) else "?"))


def zoo_rank(a: dict, rank: int) -> None:
    import zoo_models

    world, out, run = a.get("world", 1), a["out"], a["run"]
    torch.use_deterministic_algorithms(True)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/store-{run}",
                                         rank=rank, world_size=world)
    spec = zoo_models.MODELS[a["model"]](a["total"], world)   # the same weights on every rank
    torch.manual_seed(a["seed"] + rank)                      # then each rank its own dropout masks
    random.seed(a["seed"] + rank)
    np.random.seed(a["seed"] + rank)
    ckpt, step = None, 0
    if a["url"] is not None:
        ckpt = cfdist.Checkpointer(spec.state(), a["url"], cfdist.Every(a["k"]))
        step = ckpt.restore() or 0
        if rank == 0:
            report(out, f"restore-{run}.json", {"restored": step or None})
    while step < a["total"]:
        spec.iteration(step, a["seed"], rank, ckpt)
        step += 1
        if rank == 0:
            report(out, f"progress-{run}.json", {"step": step})
    if ckpt is not None:
        ckpt.close()
    model = getattr(spec.model, "_orig_mod", spec.model)
    model = getattr(model, "module", model)
    final = {"model": model.state_dict(), "optim": spec.optim.state_dict(), "rng": torch.get_rng_state(),
             "python_rng": random.getstate()[1], "numpy_rng": np.random.get_state()[1]}
    if spec.sched is not None:
        final["sched"] = spec.sched.state_dict()
    if spec.scaler is not None:
        final["scaler"] = spec.scaler.state_dict()
    torch.save(final, os.path.join(out, f"final-{run}-rank{rank}.pt"))
    torch.distributed.destroy_process_group()


PROGRAMS = {"crash": crash, "bitexact": bitexact, "zoo": zoo}


def _child(prog: str, args: dict) -> None:
    code = 0
    try:
        sys.stdin.close()
        PROGRAMS[prog](args)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        code = 1
        try:
            with open(os.path.join(args["out"], f"error-{args.get('run', 0)}.txt"), "w") as f:
                f.write(traceback.format_exc())
        except OSError:
            pass
    exit_process(code)


def warm_up() -> None:
    """Do once, before forking, what would otherwise cost every child seconds: the optimizers
    import torch._dynamo lazily on first use, the data loader initialises on its first batch.
    One thread, so no thread pool exists at fork."""
    torch.set_num_threads(1)
    lin = torch.nn.Linear(2, 2)
    for opt in (torch.optim.Adam(lin.parameters()), torch.optim.SGD(lin.parameters(), lr=0.1)):
        lin(torch.ones(1, 2)).sum().backward()
        opt.step()
        torch.optim.lr_scheduler.ExponentialLR(opt, 0.9).step()
    from cfdist.data import ResumableLoader   # its first iteration initialises torch.utils.data (~0.3 s)
    next(iter(ResumableLoader(IndexedSamples(8, 4), 4, seed=0, rank=0, world_size=1)))


def serve() -> None:
    warm_up()
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the command pipe
    ended: dict[int, int] = {}  # pid -> exit status of reaped children (poll may be asked again)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "start":
            group = bool(cmd["args"].get("group"))
            pid = os.fork()
            if pid == 0:
                if group:    # its own process group, so killpg stops the ranks it forks too
                    os.setpgid(0, 0)
                _child(cmd["prog"], cmd["args"])
            if group:        # also here: no answer leaves before the group exists
                try:
                    os.setpgid(pid, pid)
                except OSError:   # the child was first (EACCES) or already ended (ESRCH)
                    pass
            answer = {"pid": pid}
        elif cmd["op"] == "poll":
            if cmd["pid"] not in ended:
                pid, status = os.waitpid(cmd["pid"], os.WNOHANG)
                if pid:
                    ended[pid] = os.waitstatus_to_exitcode(status)
            answer = {"pid": cmd["pid"], "code": ended.get(cmd["pid"])}
        elif cmd["op"] == "quit":
            break
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
