"""GPU snapshots (CUDA only; skipped without a device): the copy runs on the snapshotter's own
stream, ordered by events, never by synchronizing the device; module buffers are safe before
the next forward; a GPU snapshot goes to GPU memory only when the device has room for it; and
the spare-memory accounting counts the snapshot once.

Real in every test: a CUDA device, the Snapshotter's streams and events, pinned host arenas.
Ordering is shown with ``torch.cuda._sleep`` kernels (a busy stream), never with wall time.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cfdist
from cfdist.checkpoint import snapshot
from cfdist.checkpoint.snapshot import Snapshotter
from cfdist.policy import Auto
from test_checkpoint_snapshot import _GpuEvery   # Every(k) asking for GPU-memory snapshots

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUSY = 2_000_000_000   # GPU cycles of torch.cuda._sleep: about a second, a stream that is clearly busy
N = 1 << 20


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _host(snap: Snapshotter, name: str) -> torch.Tensor:
    for es, arena in zip(snap.layout, snap.host):
        for e in es:
            if e.name == name:
                return arena.view(e)
    raise KeyError(name)


def test_copy_is_ordered_after_the_update_and_does_not_wait_for_the_next_iteration():
    """The device-to-host copy waits (by event) for the update queued before ``start`` and not
    for work queued after it: it is not on the training (default) stream.

    The point: the host arena holds the updated values, and the copy finished while the
    training stream was still busy with the next iteration's kernel."""
    dev = _device()
    w = torch.zeros(N, device=dev)
    snap = Snapshotter()
    torch.cuda._sleep(BUSY)   # a slow update ...
    w.add_(1)                 # ... whose result the snapshot must hold
    snap.start({"w": w})
    torch.cuda._sleep(BUSY)   # the next iteration, on the training stream
    snap.wait_copied()
    assert not torch.cuda.current_stream(dev).query(), "the copy waited for the next iteration's work"
    assert torch.equal(_host(snap, "w"), torch.ones(N))
    torch.cuda.current_stream(dev).synchronize()
    snap.close()


def test_the_next_forward_waits_for_the_buffer_copy_not_the_host():
    """Buffers named in ``first``: the training stream waits (by event) for their copy before
    the kernel that mutates them, while ``start`` returns at once.

    Faked: the copy stream is kept busy with a sleep kernel, so without that event the
    buffer's mutation would run first. The point: the snapshot holds the buffer's value before
    the mutation, the live buffer the value after it."""
    dev = _device()
    snap = Snapshotter()
    buf, w = torch.zeros(N, device=dev), torch.full((N,), 2.0, device=dev)
    with torch.cuda.stream(snap._stream(dev)):
        torch.cuda._sleep(BUSY)
    snap.start({"w": w, "buf": buf}, first={"buf"})
    buf.add_(1)               # the next forward (BatchNorm updating its statistics)
    assert not torch.cuda.current_stream(dev).query(), "start() synchronized the training stream"
    snap.wait_copied()
    torch.cuda.current_stream(dev).synchronize()
    assert torch.equal(_host(snap, "buf"), torch.zeros(N))
    assert torch.equal(_host(snap, "w"), torch.full((N,), 2.0))
    assert torch.equal(buf.cpu(), torch.ones(N))
    snap.close()


def test_gpu_snapshots_of_a_batchnorm_model_never_synchronize_the_device(memory_url, monkeypatch):
    """A CUDA model with BatchNorm snapshotted into GPU memory every step, staged to host in the
    background, with ``torch.cuda.synchronize`` made to fail.

    Real: the Checkpointer, GPU arenas, the copy stream, staging to host, thread persist on
    ``memory://``. Faked: ``torch.cuda.synchronize`` raises (no code path may call it).
    The point: every checkpoint equals the state at the end of its step, buffers included."""
    dev = _device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def no_sync(*a, **k):
        raise AssertionError("torch.cuda.synchronize() called: the snapshot must wait for events only")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, _GpuEvery(1), keep=100)
    want = {}
    g = torch.Generator(device=dev).manual_seed(1)
    for i in range(1, 7):
        model(torch.randn(16, 64, device=dev, generator=g)).pow(2).mean().backward()
        ckpt.step(opt)
        want[i] = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict()["state"])}
        opt.zero_grad()
    ckpt.close()
    monkeypatch.undo()
    assert ckpt.stats["checkpoints"] == 6 and ckpt.stats["errors"] == 0
    assert ckpt._snap.last_device == "gpu"
    for step, w in want.items():
        got = cfdist.load(memory_url, step=step)["state"]
        for n, t in w["model"].items():
            assert torch.equal(got["model"][n], t.cpu()), f"step {step}: {n}"
        for i, s in w["optim"].items():
            for key, t in s.items():
                assert torch.equal(got["optim"]["state"][i][key], t.cpu()), f"step {step}: optimizer {i}.{key}"


def test_gpu_snapshot_without_room_goes_to_host_memory():
    """A GPU snapshot asked for when the device lacks room: host memory instead, and said so.

    Faked: the headroom (99.9999% of the device must stay free), so no snapshot fits. The
    point: the copy lands in host memory, ``last_device`` says ``cpu`` (what profiling reads
    to drop the GPU mode) and no GPU arena was allocated; with room it goes to GPU memory."""
    dev = _device()
    w = torch.arange(N, dtype=torch.float32, device=dev)
    snap = Snapshotter(gpu_headroom=0.999999)
    snap.start({"w": w}, mode="gpu")
    snap.wait_copied()
    assert snap.last_device == "cpu" and snap.gpu_refused == 1 and snap.gpu_nbytes == 0
    assert torch.equal(_host(snap, "w"), w.cpu())
    snap.close()
    roomy = Snapshotter(gpu_headroom=0.0)
    roomy.start({"w": w}, mode="gpu")
    roomy.wait_copied()
    assert roomy.last_device == "gpu" and roomy.gpu_nbytes == w.numel() * 4
    roomy.close()


def _mlp(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).to(dev)


def _auto_run(url, dev, steps=40):
    model = _mlp(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ckpt = cfdist.Checkpointer({"model": model, "opt": opt}, url, Auto(profile_steps=10))
    x = torch.randn(8, 512, device=dev)
    for _ in range(steps):
        model(x).square().mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
    ckpt.close()
    return ckpt, sum(p.numel() * p.element_size() for p in model.parameters())


def test_profiling_gpu_snapshot_falls_back_to_cpu_without_room(tmp_path, monkeypatch):
    """Profiling's GPU snapshot checks free memory first; without room it is a CPU snapshot
    and ``Auto`` decides from CPU numbers. Faked: ``snapshot.gpu_room`` answers no."""
    monkeypatch.setattr(snapshot, "gpu_room", lambda *a, **k: False)
    ckpt, _ = _auto_run(f"file://{tmp_path}/ck", _device())
    s = ckpt.stats
    assert s["profile"]["Tg"] is None and s["decision"]["mode"] == "cpu" and s["mode"] == "cpu"
    assert ckpt._snap.gpu_refused >= 1


def test_spare_gpu_memory_counts_the_snapshot_once(tmp_path):
    """``M`` in the profile is training's peak without the snapshot's arena.

    Real: Auto's profiling with a GPU snapshot on a CUDA model, ``torch.cuda`` memory figures.
    The point: ``M`` plus the snapshot's bytes is at most the process's peak (which held both
    at once); a peak read after the snapshot would already contain the arena."""
    dev = _device()
    torch.cuda.reset_peak_memory_stats(dev)
    ckpt, state_bytes = _auto_run(f"file://{tmp_path}/ck", dev)
    prof = ckpt.stats["profile"]
    assert prof["Tg"] is not None, "profiling took no GPU snapshot"
    assert prof["M"] + state_bytes <= torch.cuda.max_memory_allocated(dev)
