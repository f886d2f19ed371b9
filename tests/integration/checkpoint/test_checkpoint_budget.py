"""A host-memory budget for snapshots (``Checkpointer(host_memory=...)``, issue "lean checkpoints").

Real throughout: the Checkpointer, its snapshot thread streaming windows through the chunk pool,
the persist pipeline, its thread backend and its writer process (reading a shared pool in
``/dev/shm`` through its mailbox), ``file://`` storage in tmp_path with fsync and renames
(buffered and ``O_DIRECT`` writes), ``cfdist.load`` verifying every checksum; SIGKILL of real
training processes; peak RSS read from the kernel (``/proc/self/status``).
"""

from __future__ import annotations

import copy
import errno
import glob
import os
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import cfdist
from cfdist.checkpoint.chunks import minimum_budget
from cfdist.checkpoint.discovery import committed_steps
from cfdist.checkpoint.persist import ThreadBackend
from cfdist.storage import open_storage, open_storages
from cfdist.checkpoint.format import parse_step_dir
from cfdist.testing import StorageWrapper

from test_checkpoint_crash import kill_restore_loop


def _model():
    torch.manual_seed(0)   # 56 KB of parameters, 170 KB with Adam's state; BatchNorm buffers
    return torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.BatchNorm1d(200), torch.nn.ReLU(),
                               torch.nn.Linear(200, 8))


def _train(ckpt, model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    want = {}
    for _ in range(steps):
        model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
        want[ckpt.step_count] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()["state"]})
    return want


def _assert_checkpoint_is(url, step, want):
    got = cfdist.load(url, step=step)["state"]
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), f"step {step}: {k} differs"
    for i, s in want["optim"].items():
        for k, t in s.items():
            assert torch.equal(got["optim"]["state"][i][k], t), f"step {step}: optimizer {i}.{k} differs"


@pytest.mark.parametrize("budget,buffers,roots,io,backend", [
    (0.1, 1, 1, "buffered", "thread"),  # a tenth of the state: raised to the minimum
    (64 << 10, 2, 1, "auto", "thread"),  # bytes; double buffered (the persists in flight share it); O_DIRECT
    (0.25, 1, 2, "auto", "thread"),     # striped over two roots, written in parallel
    (0.5, 2, 2, "buffered", "thread"),
    (1.0, 1, 1, "auto", "thread"),      # the whole state: the module buffers' copies still count
    (0.1, 1, 1, "auto", "process"),     # a writer process reads the chunks from /dev/shm
    (0.25, 2, 2, "buffered", "process"),
])
def test_every_checkpoint_under_a_budget_is_the_state_of_its_step(tmp_path, budget, buffers, roots, io, backend):
    """Every(1) for 8 steps: each committed checkpoint equals the state at the end of its step
    (``torch.equal``), and no chunk was allocated beyond the budget (below the state's 170 KB
    but for the last case)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    urls = [f"file://{tmp_path / f'r{i}'}" for i in range(roots)]
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, urls if roots > 1 else urls[0], cfdist.Every(1),
                               keep=100, buffers=buffers, host_memory=budget,
                               persist=cfdist.PersistOptions(io=io, backend=backend))
    want = _train(ckpt, model, opt, 8)
    ckpt.close()
    s = ckpt.stats
    assert s["errors"] == 0 and s["checkpoints"] == 8 and s["latest_step"] == 8, s
    tensors = list(want[8]["model"].values()) + [t for s_ in want[8]["optim"].values() for t in s_.values()]
    state = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    limit = budget if isinstance(budget, int) else max(minimum_budget(roots), int(budget * state))
    assert s["arena_bytes"] <= limit, (s["arena_bytes"], limit)   # never more chunks than the budget holds
    assert committed_steps(open_storage(urls[0])) == list(range(1, 9))
    assert not glob.glob(f"/dev/shm/cfdist-{os.getpid()}-*"), "a chunk pool's files outlived close()"
    url = urls if roots > 1 else urls[0]
    for step in (1, 5, 8):
        _assert_checkpoint_is(url, step, want[step])


class _FailShard(StorageWrapper):
    """ENOSPC in the middle of step ``step``'s shard write, after its second window."""

    def __init__(self, inner, step: int):
        super().__init__(inner)
        self.step = step

    def write_file(self, rel, chunks, *, fsync: bool = True) -> int:
        if "shard-" not in rel or parse_step_dir(rel.split("/")[0].split(".tmp-")[0]) != self.step:
            return super().write_file(rel, chunks, fsync=fsync)

        def failing():
            for i, c in enumerate(chunks):
                if i == 3:   # the header and two windows went through
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                yield c
        return super().write_file(rel, failing(), fsync=fsync)


def test_a_storage_error_under_a_budget_is_recorded_and_the_next_checkpoint_commits(tmp_path):
    """The disk fails a shard write (ENOSPC) while the snapshot is still streaming: the copy does
    not wait for ever for chunks (the failed persist gives them back), the error is recorded and
    raised once, and the next checkpoint commits the state of its step."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    url = f"file://{tmp_path / 'ckpt'}"
    st = _FailShard(open_storage(url), step=2)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, st, cfdist.Every(1), keep=100,
                               host_memory=0.05)   # raised to the least that works: about a tenth
    want = _train(ckpt, model, opt, 2)
    with pytest.raises(OSError):
        ckpt.wait()
    want.update(_train(ckpt, model, opt, 2, seed=2))
    ckpt.close()
    s = ckpt.stats
    assert s["errors"] == 1 and s["latest_step"] == 4, s
    steps = committed_steps(open_storage(url))
    assert 2 not in steps and steps[-1] == 4, steps
    _assert_checkpoint_is(url, 4, want[4])


def test_a_budget_that_cannot_work_is_refused_with_the_minimum(tmp_path):
    """Refused at construction, with what would work; nothing is written."""
    state = {"model": torch.nn.Linear(64, 200)}   # no module buffers
    url = f"file://{tmp_path / 'ckpt'}"
    with pytest.raises(ValueError, match=f"the minimum is {minimum_budget()} bytes"):
        cfdist.Checkpointer(state, url, host_memory=1000)
    with pytest.raises(ValueError, match=f"the minimum is {minimum_budget(2)} bytes"):
        cfdist.Checkpointer(state, [url, f"file://{tmp_path / 'b'}"], host_memory=minimum_budget())
    with pytest.raises(ValueError, match="fraction of the state"):
        cfdist.Checkpointer(state, url, host_memory=1.5)
    with pytest.raises(TypeError, match="host_memory must be"):
        cfdist.Checkpointer(state, url, host_memory="1G")
    class WholeSnapshots(ThreadBackend):   # stands for cfdist.fit's node-actor backend (needs Ray)
        streams = False

    with pytest.raises(ValueError, match="reads whole snapshots"):
        cfdist.Checkpointer(state, url, host_memory=0.5, persist=cfdist.PersistOptions(
            backend=WholeSnapshots(open_storages(url))))
    class NoStreamedCodecs(ThreadBackend):   # stands for cfdist.fit's node-actor backend (needs Ray)
        streams_codecs = False

    with pytest.raises(ValueError, match="host_memory= with codecs needs a backend that encodes"):
        cfdist.Checkpointer(state, url, host_memory=0.5, codecs=[cfdist.codecs.Zstd()],
                            persist=cfdist.PersistOptions(backend=NoStreamedCodecs(open_storages(url))))
    assert not (tmp_path / "ckpt").exists() or committed_steps(open_storage(url)) == []
    # the module buffers are copied whole before step returns: they count against the budget
    bn = torch.nn.BatchNorm1d(8192)   # 64 KiB of running statistics (and a counter)
    need = minimum_budget() + 2 * 8192 * 4 + 8
    with pytest.raises(ValueError, match=f"module buffers .* the minimum is {need} bytes"):
        cfdist.Checkpointer({"model": bn}, url, host_memory=minimum_budget() + 8192)
    cfdist.Checkpointer({"model": bn}, url, host_memory=need).close()


RSS_PRELUDE = textwrap.dedent("""
    import json, sys, torch, cfdist

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
""")
"""The start of a child that measures its peak RSS (``status("VmHWM:")`` after ``clear_refs``)."""

_RSS_CHILD = RSS_PRELUDE + textwrap.dedent("""
    m = torch.nn.Module()
    for i in range(4):   # 4 x 100 MiB: the largest tensor is larger than a 10 % budget
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.full((25 << 20,), float(i))))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = {}
    for run, budget in enumerate(json.loads(sys.argv[2])):
        ck = cfdist.Checkpointer({"model": m, "optim": opt}, f"{sys.argv[1]}/{run}", cfdist.Every(1000),
                                 host_memory=budget, persist=cfdist.PersistOptions(io="auto"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current RSS
        base = status("VmRSS:")
        ck.save(block=True)
        peak = status("VmHWM:")
        ck.close()
        out[str(budget)] = {"delta": peak - base, "waits": ck.stats.get("chunk_waits")}
    print(json.dumps(out))
""")

OVERHEAD = 8 << 20
"""RSS a save adds beyond its snapshot memory: the stacks and allocator arenas of the snapshot,
pipeline, writer and hashing threads (about 2.5 MiB measured, with or without a budget)."""


def test_peak_memory_stays_within_each_budget_on_a_400_mb_state(tmp_path):
    """A 400 MiB state saved under no budget and under 10 %, 25 %, 50 % and 100 % of it, in a
    child process: the peak RSS the save adds (``VmHWM`` after ``clear_refs``) is within the
    budget plus the threads' fixed overhead, and without a budget it is the whole state."""
    state = 400 << 20
    budgets = [None, 0.1, 0.25, 0.5, 1.0]
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, f"file://{tmp_path}", json.dumps(budgets)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["None"]["delta"] >= state, got   # the measurement sees a full host copy
    for b in budgets[1:]:
        assert got[str(b)]["delta"] <= b * state + OVERHEAD, (b, got)



def test_sigkill_under_a_budget_always_restores_the_newest_commit(children, tmp_path):
    """The crash loop of ``test_checkpoint_crash`` (a 12 MB MLP under Adam, Every(2), exactly-once
    data) with snapshots streamed through a budget of a tenth of the state: 10 training
    processes SIGKILLed at seeded instants, about half of them while a streamed write is in
    flight; each next one restores exactly the newest commit, verified by ``cfdist.load``."""
    out = tmp_path / "out"
    out.mkdir()
    interrupted = kill_restore_loop(children, out, f"file://{tmp_path / 'ckpt'}", kills=10, seed=24,
                                    host_memory=0.1)
    assert interrupted >= 2, f"only {interrupted} of 10 kills landed while a checkpoint was being written"
