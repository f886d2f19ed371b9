"""Training functions and checks shared by the ``cfdist.fit`` integration tests.

The loop is deterministic on CPU (fixed seeds, gloo, SGD with momentum, no dropout), so an
interrupted run must end with the uninterrupted run's parameters bit for bit. Every rank
appends what it consumed to ``<out>/a<attempt>-r<rank>.jsonl`` (step, epoch, sample ids), which
:func:`check_exactly_once` replays to prove each sample was used once per epoch.

Shipped to the Ray workers by value (``ray.cloudpickle.register_pickle_by_value``), so workers
need not import the tests package.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from collections import Counter

import torch

N_SAMPLES = 48
BATCH = 3


class Indexed(torch.utils.data.Dataset):
    """Sample i is (x_i, y_i, i): a fixed random regression set that reports its indices."""

    def __init__(self, n: int = N_SAMPLES):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def train_loop(ctx, *, steps: int, out_dir: str, every: int = 4, step_sleep_s: float = 0.05,
               hold_small: tuple[int, int, str] | None = None, freeze_at: tuple[int, int] | None = None,
               ckpt_kwargs: dict | None = None, hold_end: str | None = None,
               spin_at: tuple[int, int] | None = None, die_on_notice: tuple[int, int] | None = None,
               hold_for_halt: tuple[int, str] | None = None, kill_in: tuple[int, int, str] | None = None,
               halt_in: tuple[int, dict] | None = None):
    """Train a linear model with DDP for ``steps`` optimizer steps; rank 0 returns its state.

    ``freeze_at=(rank, step)``: in the first attempt, that rank's process SIGSTOPs itself right
    after logging that step (a frozen process: a hung driver call, a stuck NFS read).
    ``ckpt_kwargs``: further Checkpointer arguments (``buffers``, ``codecs``).
    ``spin_at=(rank, step)``: in the first attempt, that rank loops for ever after that step
    (its process still answers the driver).
    ``die_on_notice=(rank, step)``: in the first attempt, that rank waits after that step until
    its node's preemption notice arrived (``ctx.preempted``), then SIGKILLs itself.
    ``hold_for_halt=(step, event_log)``: in the first attempt, every rank waits after that step
    until the driver logged a ``halt`` (a pool notice's group trains on until its margin; a
    fast machine would otherwise end the run first).
    ``halt_in=(step, {rank: where})``: in the first attempt, each rank named waits during that
    step until the halt of a notice that names every node reached it (the flag ``ctx`` sets for
    it): ``"update"`` after the step's backward (its all-reduce done), before ``ckpt.step``;
    ``"boundary"`` after the step's update, before the next fetch.
    ``hold_end=event_log``: in the first attempt, rank 1 leaves the loop after its last step only
    once the driver logged a failure, while rank 0 goes on to the end of its run (its final
    checkpoint then waits for rank 1's RNG states of the last step): an injected failure of
    rank 1 lands at rank 0's very end.

    ``kill_in=(rank, step, phase)``: in the first attempt, that rank SIGKILLs itself during that
    step, in ``phase``: ``"forward"`` (the model's forward), ``"backward"`` (the weight's gradient
    hook, before its bucket's all-reduce can start), ``"allreduce"`` (DDP's comm hook, right after
    it launched its all-reduce), ``"optimizer"`` (inside ``optimizer.step()``: the rank's
    weight half updated, the rest not) or ``"orphaning"`` (in the forward, after forking a child
    that keeps its sockets open: ``<out_dir>/orphan.pid`` names it).

    ``hold_small=(world_size, step, event_log)``: a group of that world size does not train past
    ``step`` until the driver logged its decision to grow (a node that returns takes seconds to
    start; without the hold, a slow machine ends the run before the group can grow)."""
    import cfdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = cfdist.ResumableLoader(Indexed(), BATCH, seed=3)
    ckpt = ctx.checkpointer({"model": model, "optim": opt, "data": loader}, policy=cfdist.Every(every),
                            **(ckpt_kwargs or {}))
    ckpt.restore()
    doing = {"step": 0}   # the step in progress
    if kill_in is not None and ctx.attempt == 0 and ctx.rank == kill_in[0]:
        _arm_kill(model, opt, kill_in[2], lambda: doing["step"] == kill_in[1], out_dir)
    elif kill_in is not None and kill_in[2] == "allreduce":
        model.register_comm_hook(None, _allreduce_hook(None))   # every rank runs the same hook
    log = open(os.path.join(out_dir, f"a{ctx.attempt}-r{ctx.rank}.jsonl"), "a")
    log.write(json.dumps({"restored": ckpt.step_count, "world_size": ctx.world_size}) + "\n")
    while ckpt.step_count < steps:
        for x, y, idx in loader:
            # the batch, before its step: a rank killed after the step's all-reduce (its gradient
            # is in the update the survivors keep) but before its log line still shows what it used
            log.write(json.dumps({"fetched": ckpt.step_count + 1, "epoch": loader.epoch, "ids": idx.tolist(),
                                  "pad": loader.last_batch_is_padding}) + "\n")
            log.flush()
            doing["step"] = ckpt.step_count + 1
            torch.nn.functional.mse_loss(model(x), y).backward()
            if halt_in is not None and ctx.attempt == 0 and doing["step"] == halt_in[0] \
                    and halt_in[1].get(ctx.rank) == "update":
                wait_for(lambda: ctx._halt.is_set(), 180.0, every_s=0.005)
            ckpt.step(opt)
            opt.zero_grad()
            log.write(json.dumps({"step": ckpt.step_count, "epoch": loader.epoch, "ids": idx.tolist(),
                                  "pad": loader.last_batch_is_padding}) + "\n")
            log.flush()
            ctx.report(step_rank=ctx.rank)
            if halt_in is not None and ctx.attempt == 0 and ckpt.step_count == halt_in[0] \
                    and halt_in[1].get(ctx.rank) == "boundary":
                wait_for(lambda: ctx._halt.is_set(), 180.0, every_s=0.005)
            if freeze_at == (ctx.rank, ckpt.step_count) and ctx.attempt == 0:
                os.kill(os.getpid(), signal.SIGSTOP)
            if spin_at == (ctx.rank, ckpt.step_count) and ctx.attempt == 0:
                while True:   # a hang in the loop's own code: the process still answers
                    time.sleep(0.05)
            time.sleep(step_sleep_s)
            if die_on_notice == (ctx.rank, ckpt.step_count) and ctx.attempt == 0:
                wait_for(lambda: ctx.preempted, 180.0, every_s=0.005)
                os.kill(os.getpid(), signal.SIGKILL)
            if hold_for_halt is not None and ctx.attempt == 0 and ckpt.step_count == hold_for_halt[0]:
                _wait_for_decision(hold_for_halt[1], "", event="halt")
            if hold_small is not None and ctx.world_size == hold_small[0] and ckpt.step_count == hold_small[1]:
                _wait_for_decision(hold_small[2], "grow_at_next_checkpoint")
            if ckpt.step_count >= steps:
                break
    if hold_end is not None and ctx.rank == 1 and ctx.attempt == 0:
        _wait_for_decision(hold_end, "", event="failure")
    log.close()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _die():
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)   # SIGKILL is delivered before this returns


def _allreduce_hook(armed):
    """DDP's all-reduce as a comm hook (``default_hooks.allreduce_hook``'s arithmetic: divide,
    then sum; exact for 2 ranks, so runs with and without it agree bit for bit); with ``armed``,
    the rank dies right after launching the all-reduce of an armed step."""
    import torch.distributed as dist

    def hook(state, bucket):
        tensor = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        if armed is not None and armed():
            _die()
        return fut.then(lambda f: f.value()[0])
    return hook


def _die_orphaning(pidfile: str):
    """Fork a child that inherits every descriptor of this process (its gloo connections too:
    they stay open, as when a data-loader worker forked after the group was formed outlives
    its rank) and sleeps; write its pid to ``pidfile`` (the test kills it); then SIGKILL this
    process. The peers' sockets then never see this process's end."""
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    with open(pidfile, "w") as f:
        f.write(str(child))
    _die()


def _arm_kill(model, opt, phase: str, armed, out_dir: str = ".") -> None:
    """Make this rank SIGKILL itself in ``phase`` of the step for which ``armed()`` is true."""
    if phase == "forward":
        model.module.register_forward_hook(lambda *a: _die() if armed() else None)
    elif phase == "orphaning":   # in the forward, leaving a child that holds its sockets open
        model.module.register_forward_hook(
            lambda *a: _die_orphaning(os.path.join(out_dir, "orphan.pid")) if armed() else None)
    elif phase == "backward":
        model.module.weight.register_hook(lambda grad: _die() if armed() else None)
    elif phase == "allreduce":
        model.register_comm_hook(None, _allreduce_hook(armed))
    elif phase == "optimizer":
        step = opt.step

        def torn_step(*args, **kwargs):
            if armed():
                with torch.no_grad():
                    w = model.module.weight
                    w[: w.shape[0] // 2].add_(w.grad[: w.shape[0] // 2], alpha=-0.05)   # half an update
                _die()
            return step(*args, **kwargs)
        opt.step = torn_step
    else:
        raise ValueError(f"kill_in: unknown phase {phase!r}")


def _wait_for_decision(event_log: str, what: str, timeout_s: float = 180.0, event: str = "decision") -> None:
    """Until the driver logged ``event`` (with ``what``, for a decision)."""
    def decided():
        if not os.path.exists(event_log):
            return False
        with open(event_log) as f:
            for line in f:
                if line.strip().endswith("}"):
                    rec = json.loads(line)
                    if rec.get("event") == event and (event != "decision" or rec.get("what") == what):
                        return True
        return False
    try:
        wait_for(decided, timeout_s, every_s=0.1)
    except TimeoutError:
        raise TimeoutError(f"the driver logged no {what!r} decision in {event_log} within {timeout_s:.0f} s") from None


def check_exactly_once(out_dir: str, final_step: int) -> dict[int, int]:
    """Replay the per-attempt logs: the step ``s`` that counts is the one of the last attempt
    that executed it. A rank of that attempt with no record of ``s`` (killed after the step's
    all-reduce, before its log line) counts the batch it fetched for ``s`` when a later attempt
    restored ``s`` or a newer step: the group completed ``s`` with that rank's gradient (live
    recovery restores the survivors' last step). Asserts each epoch's samples are all used
    exactly once (the last epoch may be partial: no sample twice). Returns ``{epoch: samples used}``."""
    attempts: dict[int, dict] = {}
    for path in glob.glob(os.path.join(out_dir, "a*-r*.jsonl")):
        a, r = map(int, re.match(r"a(\d+)-r(\d+)\.jsonl", os.path.basename(path)).groups())
        recs = [json.loads(line) for line in open(path) if line.strip()]
        att = attempts.setdefault(a, {"restored": recs[0]["restored"], "steps": {}, "fetched": {}})
        for rec in recs[1:]:
            if "fetched" in rec:
                att["fetched"].setdefault(rec["fetched"], {})[r] = rec
            else:
                att["steps"].setdefault(rec["step"], {})[r] = rec
    per_epoch: dict[int, Counter] = {}
    for s in range(1, final_step + 1):
        owner = max(a for a, att in attempts.items() if att["restored"] < s and s in att["steps"])
        used = dict(attempts[owner]["fetched"].get(s, {}))
        kept = any(att["restored"] >= s for a, att in attempts.items() if a > owner)
        used = {r: rec for r, rec in used.items() if kept} | attempts[owner]["steps"][s]
        for rec in used.values():
            if not rec["pad"]:
                per_epoch.setdefault(rec["epoch"], Counter()).update(rec["ids"])
    epochs = sorted(per_epoch)
    for e in epochs:
        twice = {i: c for i, c in per_epoch[e].items() if c > 1}
        assert not twice, f"epoch {e}: samples used more than once: {twice}"
        if e != epochs[-1]:
            assert set(per_epoch[e]) == set(range(N_SAMPLES)), (
                f"epoch {e}: samples never used: {sorted(set(range(N_SAMPLES)) - set(per_epoch[e]))}")
    return {e: sum(per_epoch[e].values()) for e in epochs}


def wait_for(pred, timeout_s: float = 60.0, every_s: float = 0.05):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError("condition not met in time")
        time.sleep(every_s)
