"""Consistent snapshot (invariant 3): each checkpoint is the state at the end of its iteration."""

from __future__ import annotations

import copy

import pytest
import torch

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.storage import open_storage
from cfdist.testing import throttle


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def _run(ckpt, model, opt, sched, steps: int, every: int) -> dict[int, dict]:
    """The ordinary loop; at every checkpoint step i, deep copies of what the checkpoint must hold:
    the state right after optimizer step i, the scheduler after its step i, the RNG before forward i+1."""
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    want: dict[int, dict] = {}
    for i in range(1, steps + 1):
        x = torch.randn(8, 16, generator=g).to(device)   # no draw from the global RNG: only dropout draws
        if i - 1 in want:
            want[i - 1].update(_rng(device))
        model(x).pow(2).mean().backward()
        ckpt.step(opt)
        if i % every == 0:
            want[i] = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict()["state"])}
        sched.step()
        if i % every == 0:
            want[i]["sched"] = copy.deepcopy(sched.state_dict())
            want[i]["lr"] = [grp["lr"] for grp in opt.param_groups]
        opt.zero_grad()
    want[steps].update(_rng(device))
    ckpt.close()
    return want


def _rng(device) -> dict:
    out = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(device)
    return out


def _assert_checkpoint_is(got: dict, want: dict, step: int) -> None:
    for name, t in want["model"].items():
        assert torch.equal(got["state"]["model"][name], t.cpu()), f"step {step}: {name} is not the one after update {step}"
    for i, s in want["optim"].items():
        for key, t in s.items():
            assert torch.equal(got["state"]["optim"]["state"][i][key], t.cpu()), f"step {step}: optimizer {i}.{key}"
    assert got["state"]["sched"] == want["sched"], f"step {step}: scheduler is not the one after its step {step}"
    assert [grp["lr"] for grp in got["state"]["optim"]["param_groups"]] == want["lr"]
    assert torch.equal(got["rng"]["torch"], want["rng"]), f"step {step}: RNG is not the one before forward {step + 1}"
    if "cuda_rng" in want:
        assert torch.equal(got["rng"]["cuda"][want.get("cuda_index", 0)], want["cuda_rng"]), f"step {step}: CUDA RNG"


def test_snapshot_is_the_end_of_its_iteration_while_training_runs_ahead(memory_url):
    """Checkpoints taken while training continues hold exactly the end of their own iteration.

    Real: the Checkpointer with its snapshot thread and thread persist backend, a model with
    dropout, Adam, StepLR stepped after ``ckpt.step(opt)``, ``memory://`` storage.
    Faked: a slow disk (``throttle``, 8 MB/s), so each persist spans several training steps
    and training keeps mutating the parameters while the checkpoint is still being written.
    The point: every committed checkpoint equals deep copies taken right after its optimizer
    step (parameters, Adam moments), the scheduler (and the lr) after its step, and the RNG as
    it was before the next forward.
    """
    model = _model(128)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    slow = throttle(open_storage(memory_url), bytes_per_s=8e6)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, slow, cfdist.Every(3), keep=100)
    want = _run(ckpt, model, opt, sched, steps=15, every=3)
    assert slow.slept_s > 0.05       # the disk was slow enough for steps to run ahead of persists
    assert committed_steps(slow) == [3, 6, 9, 12, 15]
    for step, w in want.items():
        _assert_checkpoint_is(cfdist.load(memory_url, step=step), w, step)


@pytest.mark.parametrize("rounds", [3])
def test_checkpoint_every_step_never_mixes_or_drops_a_step(memory_url, rounds):
    """``Every(1)`` on a fast store: every step is committed, each one exactly that step.

    Real: the Checkpointer's snapshot thread, its copy-finished callback that submits the persist,
    the persist thread, and ``memory://`` storage; SGD with momentum so each update is quick and
    the next checkpoint begins as soon as possible after the previous copy finished.
    Faked: nothing.
    The point: all steps are committed (none abandoned: one persist in flight, never lost) and
    each checkpoint equals the copy of its own step, never one mutated by the next update.
    """
    steps = 25
    for r in range(rounds):
        url = f"{memory_url}/r{r}"
        model = _model(256)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(1),
                                   keep=1000)
        want = _run(ckpt, model, opt, sched, steps=steps, every=1)
        assert ckpt.stats["checkpoints"] == steps and ckpt.stats["errors"] == 0
        assert committed_steps(open_storage(url)) == list(range(1, steps + 1))
        for step, w in want.items():
            _assert_checkpoint_is(cfdist.load(url, step=step), w, step)


def test_save_persists_each_step_once(memory_url, caplog):
    """``save()`` right after a checkpoint step (its persist maybe in flight) adds no second one.

    Real: the Checkpointer with the thread backend on ``memory://``. Faked: nothing.
    The point: saving at step 2 (an ``Every(2)`` step) and twice at step 3 gives exactly the
    commits 2 and 3, each once: a second persist of a step would have to un-commit the first.
    """
    model = _model(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, cfdist.Every(2), keep=10)
    for i in range(3):
        model(torch.ones(2, 16)).sum().backward()
        ckpt.step(opt)
        if i == 1:
            assert ckpt.save(block=True).step == 2
    assert ckpt.save().wait() == 3
    assert ckpt.save(block=True).step == 3
    ckpt.close()
    assert ckpt.stats["checkpoints"] == 2 and ckpt.stats["errors"] == 0
    assert committed_steps(open_storage(memory_url)) == [2, 3]
    assert "replacing step" not in caplog.text


class _GpuEvery:
    """``Every(k)`` whose snapshots go to spare GPU memory (``mode="gpu"``), as ``cfdist.Auto`` may choose."""

    mode = "gpu"

    def __init__(self, k: int):
        self.k = k

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return step % self.k == 0

    def observe(self, m) -> None:
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_snapshot_is_the_end_of_its_iteration(memory_url):
    """A CUDA model snapshotted into spare GPU memory, staged to host while training continues.

    Real: a CUDA model and Adam, the device-to-device snapshot on a side stream, the background
    device-to-host staging, the thread persist backend, ``memory://``. Faked: the policy (a
    fixed ``Every(2)`` that asks for GPU snapshots).
    The point: each committed checkpoint equals the state right after its optimizer step
    (parameters, Adam moments), the scheduler after its step, the CPU and CUDA RNG before the
    next forward; and a restore into a fresh CUDA model gives the last one back.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(256).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, memory_url, _GpuEvery(2), keep=100)
    want = _run(ckpt, model, opt, sched, steps=10, every=2)
    assert ckpt.stats["checkpoints"] == 5 and ckpt.stats["errors"] == 0
    for step, w in want.items():
        w["cuda_index"] = device.index
        _assert_checkpoint_is(cfdist.load(memory_url, step=step), w, step)

    fresh = _model(256).to(device)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    ckpt2 = cfdist.Checkpointer({"model": fresh, "optim": fresh_opt,
                                 "sched": torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3, gamma=0.5)},
                                memory_url, _GpuEvery(2))
    assert ckpt2.restore() == 10
    for name, t in fresh.state_dict().items():
        assert t.is_cuda and torch.equal(t, model.state_dict()[name])
    ckpt2.close()


class _MutatingBuffers(torch.nn.Module):
    """Every forward mutates buffers in place before anything else: BatchNorm running
    statistics and its ``num_batches_tracked``, an EMA buffer and a counter. ``big`` comes
    first in the state dict, so a copy of the state still runs when the next forward begins."""

    def __init__(self, width: int):
        super().__init__()
        self.big = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        h = self.bn(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
            self.seen += 1
        return self.head(torch.relu(self.big(h)))


def test_buffers_a_forward_mutates_are_those_of_the_end_of_the_iteration(memory_url):
    """With ``Every(1)``, no checkpoint holds buffers the next forward already changed.

    Real: the Checkpointer (snapshot thread, thread persist backend, ``memory://``), a module
    whose forward first updates BatchNorm statistics, an EMA buffer and a counter in place, a
    16 MB weight and Adam state copied while the next iteration runs.
    Faked: nothing. The buffers are copied right after ``ckpt.step`` returns (small), the rest
    at the next gate, when the forward cannot have changed parameters.
    The point: every checkpoint's buffers equal the copy taken the instant ``ckpt.step``
    returned, and its parameters and Adam moments those after its own update.
    """
    torch.manual_seed(0)
    model = _MutatingBuffers(2048)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, cfdist.Every(1), keep=100)
    g = torch.Generator().manual_seed(1)
    want: dict[int, dict] = {}
    steps = 8
    for i in range(1, steps + 1):
        x = torch.randn(8, 2048, generator=g)
        model(x).pow(2).mean().backward()
        if i - 1 in want:   # forward i changed no parameter: these are still those of update i-1
            want[i - 1]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            want[i - 1]["optim"] = copy.deepcopy(opt.state_dict()["state"])
        ckpt.step(opt)
        want[i] = {"buffers": {n: b.clone() for n, b in model.named_buffers()}}
        opt.zero_grad()
    want[steps]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    want[steps]["optim"] = copy.deepcopy(opt.state_dict()["state"])
    ckpt.close()
    assert ckpt.stats["checkpoints"] == steps and ckpt.stats["errors"] == 0
    for step, w in want.items():
        got = cfdist.load(memory_url, step=step)["state"]
        for n, b in w["buffers"].items():
            assert torch.equal(got["model"][n], b), f"step {step}: buffer {n} holds another iteration's value"
        assert int(got["model"]["seen"]) == step
        for n, p in w["params"].items():
            assert torch.equal(got["model"][n], p), f"step {step}: parameter {n}"
        for i, s in w["optim"].items():
            for key, t in s.items():
                assert torch.equal(got["optim"]["state"][i][key], t), f"step {step}: optimizer {i}.{key}"


def _amp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def test_grad_scaler_steps_inside_the_gate_and_is_checkpointed(memory_url):
    """``ckpt.step(opt, scaler=scaler)`` with fp16 autocast on the CPU: the scaler's state at
    each checkpoint is the one after its ``update()`` of that step, and a restore gives it back.

    Real: ``torch.autocast("cpu", torch.float16)``, a ``torch.amp.GradScaler("cpu")`` whose
    scale grows every 2 steps and backs off on overflow (the huge initial scale overflows),
    AdamW, the Checkpointer on ``memory://``. Faked: nothing.
    The point: the run with ``ckpt.step`` is bit-identical to one with
    ``scaler.step(opt); scaler.update()`` (the scaler skipped the overflowing steps in both),
    and each checkpoint holds that step's scaler state.
    """
    def run(ckpt_url):
        model = _amp_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=2)
        ckpt = (cfdist.Checkpointer({"model": model, "optim": opt, "scaler": scaler}, ckpt_url, cfdist.Every(1),
                                    keep=100) if ckpt_url else None)
        g = torch.Generator().manual_seed(3)
        scales = {}
        for i in range(1, 9):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if ckpt is not None:
                ckpt.step(opt, scaler=scaler)
            else:
                scaler.step(opt)
                scaler.update()
            scales[i] = scaler.state_dict()
            opt.zero_grad()
        if ckpt is not None:
            ckpt.close()
        return model, scales

    ref, ref_scales = run(None)
    model, scales = run(memory_url)
    assert scales == ref_scales
    assert len({s["scale"] for s in scales.values()}) > 2, f"the scale never moved: {scales}"
    for n, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[n], t), n
    for step, want in scales.items():
        assert cfdist.load(memory_url, step=step)["state"]["scaler"] == want, f"step {step}"

    fresh = _amp_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scaler = torch.amp.GradScaler("cpu")
    ck = cfdist.Checkpointer({"model": fresh, "optim": fresh_opt, "scaler": fresh_scaler}, memory_url, cfdist.Every(1))
    assert ck.restore() == 8
    assert fresh_scaler.state_dict() == scales[8]
    ck.close()


def test_step_rejects_a_scaler_with_a_closure_or_without_an_optimizer(memory_url):
    """Bad calls name the problem and the fix. Real: the Checkpointer; nothing else runs."""
    model = _amp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, cfdist.Every(1))
    with pytest.raises(ValueError, match="closure"):
        ckpt.step(opt, lambda: None, scaler=scaler)
    with pytest.raises(ValueError, match="needs the optimizer"):
        ckpt.step(scaler=scaler)
    assert ckpt.step_count == 0
    ckpt.close()


def test_snapshot_copies_every_kind_of_tensor_bit_exact():
    """The copy into the arenas (one call for all tensors): non-contiguous, empty, 0-dim, mixed
    dtypes and sizes, each in its arena view bit for bit, and the next copy overwrites the last."""
    from cfdist.checkpoint.snapshot import Snapshotter

    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 48, generator=g)
    tensors = {"t": base.t(), "strided": base[::3, 1::2], "empty": torch.empty(0, 7), "scalar": torch.tensor(2.5),
               "i64": torch.randint(-2 ** 40, 2 ** 40, (33,), generator=g), "u8": torch.randint(0, 255, (5,), dtype=torch.uint8),
               "bf16": torch.randn(17, generator=g).to(torch.bfloat16), "bool": torch.rand(9, generator=g) > 0.5,
               **{f"many/{i}": torch.randn(i + 1, generator=g) for i in range(300)}}
    snap = Snapshotter(n_shards=2)
    try:
        for round_ in range(2):
            snap.start(tensors)
            snap.wait_copied()
            got = {e.name: a.view(e) for es, a in zip(snap.layout, snap.host) for e in es}
            assert got.keys() == tensors.keys()
            for name, t in tensors.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                assert torch.equal(got[name], t), f"round {round_}: {name} differs from its source"
            for t in tensors.values():   # the next step's update
                if t.is_floating_point():
                    t.add_(1)
    finally:
        snap.close()
