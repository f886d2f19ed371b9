"""Codecs under a host-memory budget (``Checkpointer(host_memory=..., codecs=[...])``).

The persist encodes the snapshot window by window as it streams through the chunk pool, into
framed shards whose frames decode independently (:mod:`cfdist.checkpoint.format`). Real
throughout: the Checkpointer, the snapshot thread and chunk pool, the persist pipeline with its
thread backend or writer process (reading a shared pool from ``/dev/shm``), ``file://`` storage
in tmp_path with fsync and renames (buffered and ``O_DIRECT``), ``cfdist.load`` verifying every
checksum and decoding; SIGKILL of real training processes; peak RSS read from the kernel.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_checkpoint_budget import OVERHEAD, RSS_PRELUDE
from test_checkpoint_crash import kill_restore_loop

import cfdist
from cfdist.checkpoint.chunks import minimum_budget
from cfdist.checkpoint.codecs.pipeline import encode_work
from cfdist.checkpoint.codecs.quantize import per_row_bound
from cfdist.checkpoint.discovery import committed_steps
from cfdist.codecs import Incremental, LCDelta, LossyCheckpointWarning, Quantize, Zstd
from cfdist.storage import open_storage

ROWS, DIM = 3000, 32


def _model():
    """An embedding table (384 KB) trained row-sparsely by Adagrad (its ``sum`` state changes only
    on the rows looked up) and an MLP with BatchNorm; about 1 MB of state."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(ROWS, DIM)
    mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 8))
    opt = torch.optim.Adagrad(list(emb.parameters()) + list(mlp.parameters()), lr=0.05)
    return emb, mlp, opt


def _train(ckpt, emb, mlp, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    want = {}
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (32,), generator=g)
        mlp(emb(ids)).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
        want[ckpt.step_count] = copy.deepcopy({"emb": emb.state_dict(), "model": mlp.state_dict(),
                                               "optim": opt.state_dict()["state"]})
    return want


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"emb/{k}": t for k, t in state["emb"].items()}
    out.update({f"model/{k}": t for k, t in state["model"].items()})
    out.update({f"optim/{i}/{k}": t for i, s in state["optim"].items() for k, t in s.items()})
    return out


def _load(url, step) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyCheckpointWarning)
        got = cfdist.load(url, step=step)["state"]
    return _flat({"emb": got["emb"], "model": got["model"], "optim": got["optim"]["state"]})


CASES = {
    # name: (codecs, budget, buffers, roots, io, backend, {tensor name: lossy check})
    "incremental+zstd": ([Incremental(full_every=3), Zstd()], 0.25, 1, 1, "auto", "thread", {}),
    "consecutive-2roots-double": ([Incremental(full_every=4, variant="consecutive")], 0.5, 2, 2, "buffered",
                                  "thread", {}),
    "zstd-process": ([Zstd()], 0.1, 1, 1, "auto", "process", {}),
    "incremental-process-2roots-double": ([Incremental(full_every=3), Zstd()], 0.25, 2, 2, "auto", "process", {}),
    "quantize-double": ([Incremental(full_every=3), Quantize(bits=8, match="emb/*")], 0.25, 2, 1, "auto", "thread",
                        {"emb/weight": "quantize"}),
    "lcdelta": ([LCDelta(full_every=4, match="model/*weight")], 0.3, 1, 1, "auto", "thread",
                {"model/0.weight": "lcdelta", "model/3.weight": "lcdelta", "model/1.weight": "lcdelta"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_codec_checkpoint_under_a_budget_restores_its_step(tmp_path, case):
    """Every(1) for 7 steps under a budget well below the state (raised to the least that works
    with these codecs): each committed checkpoint is a framed shard, restores bit-exact for
    lossless codecs and within the documented error for lossy ones (Quantize: half a level of
    the row's range; LCDelta: at most the delta it encoded, 0 on its full checkpoints); no chunk
    was allocated beyond the pool's share of the budget."""
    codecs, budget, buffers, roots, io, backend, lossy = CASES[case]
    emb, mlp, opt = _model()
    urls = [f"file://{tmp_path / f'r{i}'}" for i in range(roots)]
    url = urls if roots > 1 else urls[0]
    ckpt = cfdist.Checkpointer({"emb": emb, "model": mlp, "optim": opt}, url, cfdist.Every(1), keep=100,
                               buffers=buffers, host_memory=budget, codecs=codecs,
                               persist=cfdist.PersistOptions(io=io, backend=backend))
    want = _train(ckpt, emb, mlp, opt, 7)
    ckpt.close()
    s = ckpt.stats
    assert s["errors"] == 0 and s["checkpoints"] == 7 and s["latest_step"] == 7, s
    assert s["bytes_written"] < s["bytes_logical"], s   # the codecs did encode
    state = sum(t.numel() * t.element_size() for t in _flat(want[7]).values())
    limit = max(minimum_budget(roots, encode_work(codecs)) + 2 * 128 * 4 + 8, int(budget * state))
    assert s["arena_bytes"] <= limit, (s["arena_bytes"], limit)
    assert committed_steps(open_storage(urls[0])) == list(range(1, 8))
    assert max(p.name for p in (tmp_path / "r0" / "step-000000004").iterdir()).endswith(".frames")
    prev = None
    for step in range(1, 8):
        got, exp = _load(url, step), _flat(want[step])
        assert got.keys() == exp.keys()
        for n, t in exp.items():
            kind = lossy.get(n)
            if kind is None:
                assert torch.equal(got[n], t), f"step {step}: {n} differs"
            elif kind == "quantize":
                x = t.numpy()
                bound = per_row_bound(x, 8)[:, None] * (1 + 1e-5) + 1e-6
                assert ((got[n].numpy() - x).__abs__() <= bound).all(), f"step {step}: {n} beyond Quantize's bound"
            else:   # lcdelta: |x - x'| <= max(2**e_low, |d| / 2) <= max |d|, d = x - the previous restore
                err = (got[n] - t).abs().max().item()
                if step % 4 == 1:
                    assert err == 0, f"step {step} is a full one: {n} differs by {err}"
                else:
                    assert err <= (t - prev[n]).abs().max().item() * (1 + 1e-5), f"step {step}: {n} error {err}"
        prev = got


def test_old_checkpoints_stay_readable_and_a_budgeted_run_resumes_from_them(tmp_path):
    """A run without a budget (plain safetensors shards, whole-tensor codecs) is resumed by one with
    ``host_memory`` (framed shards): it restores the newest of the old checkpoints bit-exact,
    writes its own, and both kinds load and decode side by side in one directory."""
    url = f"file://{tmp_path / 'ckpt'}"
    emb, mlp, opt = _model()
    codecs = [Incremental(full_every=3), Zstd()]
    ck = cfdist.Checkpointer({"emb": emb, "model": mlp, "optim": opt}, url, cfdist.Every(1), keep=100,
                             codecs=codecs)
    want = _train(ck, emb, mlp, opt, 3)
    ck.close()
    emb2, mlp2, opt2 = _model()
    ck = cfdist.Checkpointer({"emb": emb2, "model": mlp2, "optim": opt2}, url, cfdist.Every(1), keep=100,
                             codecs=codecs, host_memory=0.2)
    assert ck.restore() == 3
    for n, t in _flat(want[3]).items():
        got = _flat({"emb": emb2.state_dict(), "model": mlp2.state_dict(), "optim": opt2.state_dict()["state"]})
        assert torch.equal(got[n], t), n
    want.update(_train(ck, emb2, mlp2, opt2, 3, seed=2))
    ck.close()
    assert ck.stats["errors"] == 0, ck.stats
    files = {s: sorted(p.name for p in (tmp_path / "ckpt" / f"step-00000000{s}").iterdir()) for s in (3, 6)}
    assert files[3][-1].endswith(".safetensors") and files[6][-1].endswith(".frames"), files
    for step in range(1, 7):
        for n, t in _flat(want[step]).items():
            assert torch.equal(_load(url, step)[n], t), f"step {step}: {n} differs"


def test_a_budget_too_small_for_the_codecs_is_refused_with_the_minimum(tmp_path):
    """Refused at construction with the least that works for these codecs (more than without:
    the writer encodes chunk by chunk beside the pool) and a word on the chain codecs'
    references; that minimum itself works. Nothing is written."""
    state = {"model": torch.nn.Linear(64, 200)}
    url = f"file://{tmp_path / 'ckpt'}"
    codecs = [Incremental(), Quantize(bits=8), Zstd()]
    low = minimum_budget(1, encode_work(codecs))
    assert low > minimum_budget(1)
    with pytest.raises(ValueError, match=f"cannot work with these codecs.* the minimum is {low} bytes.*references"):
        cfdist.Checkpointer(state, url, host_memory=low - 1, codecs=codecs)
    low2 = minimum_budget(2, encode_work([Zstd()]))
    with pytest.raises(ValueError, match=f"2 root.* the minimum is {low2} bytes"):
        cfdist.Checkpointer(state, [url, f"file://{tmp_path / 'b'}"], host_memory=low2 - 1, codecs=[Zstd()])
    assert not (tmp_path / "ckpt").exists() or committed_steps(open_storage(url)) == []
    ck = cfdist.Checkpointer(state, url, cfdist.Every(1), host_memory=low, codecs=codecs)
    assert ck.stats["reference_bytes"] == 64 * 200 * 4   # Incremental's reference of the weight
    ck.save(block=True)
    ck.close()
    assert ck.stats["errors"] == 0 and committed_steps(open_storage(url)) == [0], ck.stats


def test_sigkill_under_a_budget_with_codecs_always_restores_the_newest_commit(children, tmp_path):
    """The crash loop of ``test_checkpoint_crash`` (a 12 MB MLP under Adam, Every(2), exactly-once
    data) with ``Incremental`` + ``Zstd`` encoding snapshots streamed through a tenth of the
    state: 10 training processes SIGKILLed at seeded instants, some while a framed write is in
    flight; each next one restores exactly the newest commit (its chain decoded, every checksum
    verified), and the next checkpoint after each restart commits."""
    out = tmp_path / "out"
    out.mkdir()
    interrupted = kill_restore_loop(children, out, f"file://{tmp_path / 'ckpt'}", kills=10, seed=24,
                                    host_memory=0.1, codecs=[["Incremental", {"full_every": 3}], ["Zstd", {}]])
    assert interrupted >= 1, "none of 10 kills landed while a checkpoint was being written"


_RSS_CHILD = RSS_PRELUDE + textwrap.dedent("""
    from cfdist.codecs import Incremental, Zstd

    torch.manual_seed(0)
    m = torch.nn.Module()
    for i in range(4):   # 4 x 100 MiB tables of random values (zstd gains little: it works the whole way)
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(409600, 64)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    budget, codecs = json.loads(sys.argv[2])
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, sys.argv[1], cfdist.Every(1000), host_memory=budget,
                             codecs=[eval(c) for c in codecs], persist=cfdist.PersistOptions(io="auto"))
    deltas = []
    base = status("VmRSS:")   # before the first save: what the process holds beside the state
    for save in range(2):   # the first writes whole (and fills a chain's references), the second an increment
        with torch.no_grad():
            m.w0[save * 1000:(save + 1) * 1000] += 1
        ck.step(opt)   # a step of its own for each save (no gradients: nothing else changes)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current RSS
        ck.save(block=True)
        deltas.append(status("VmHWM:") - base)   # the peak of this save, above the base
    ck.close()
    assert ck.stats["errors"] == 0 and ck.stats["checkpoints"] == 2, ck.stats
    print(json.dumps({"deltas": deltas, "refs": ck.stats["reference_bytes"], "written": ck.stats["bytes_written"]}))
""")

def test_peak_memory_stays_within_the_budget_with_codecs_on_a_400_mb_state(tmp_path):
    """A 400 MiB state saved twice with ``Zstd`` under 25 % and 50 % of it, and with ``Incremental``
    + ``Zstd`` under 25 %, in a child process: the peak RSS each save adds (``VmHWM`` after
    ``clear_refs``, above the RSS before the first save) is within the budget plus the threads'
    fixed overhead, plus, with a chain codec, its references (one copy of the tables it selects,
    kept from the first save on: stated outside the budget, ``stats["reference_bytes"]``). One
    child per case: memory a previous case freed would stay in the process and hide a peak."""
    state = 400 << 20
    for i, (budget, codecs) in enumerate([(0.25, ["Zstd()"]), (0.5, ["Zstd()"]),
                                          (0.25, ["Incremental(full_every=10)", "Zstd()"])]):
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, f"file://{tmp_path / str(i)}",
                            json.dumps([budget, codecs])], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        first, second = got["deltas"]
        refs = got["refs"]
        assert refs == (state if "Incremental" in codecs[0] else 0), got
        assert first <= budget * state + refs + OVERHEAD, (budget, codecs, got)
        assert second <= budget * state + refs + OVERHEAD, (budget, codecs, got)
