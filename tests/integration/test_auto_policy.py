"""``cfdist.Auto`` driving the real Checkpointer on a real (throttled) local disk.

Real: the Checkpointer, its snapshot and persist threads, files on ``file://`` under tmp_path,
wall-clock timings. Faked: the disk's speed (a throttling Storage wrapper: a fixed bandwidth,
cut 5x mid-run) and the iteration time (a short sleep on top of a small model's step, so that
two busy cores still give a steady Ti). The points: after the slowdown Auto raises k and logs
why; a restart on the same storage reuses the cached profile and skips profiling.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from cfdist.checkpoint import Checkpointer
from cfdist.policy import Auto, TunerConfig
from cfdist.storage import open_storage
from cfdist.testing import throttle

MB = 1 << 20
STATE_BYTES = 2 * (512 * 512 + 512) * 4   # two 512x512 fp32 layers with biases, about 2 MiB
RATE = 4 * MB                             # persist about 0.5 s; 5x slower: about 2.5 s
ITER_SLEEP = 0.03                         # Ti about 0.035 s


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))


def _train(ckpt, model, opt, steps):
    x = torch.randn(8, 512)
    for _ in range(steps):
        model(x).square().mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
        time.sleep(ITER_SLEEP)


def _cached(url):
    st = open_storage(url)
    names = [n for n in st.listdir() if n.startswith("profile-") and n.endswith(".json")]
    assert len(names) == 1, names
    return json.loads(st.read_bytes(names[0]))


@pytest.mark.slow
def test_slower_storage_raises_k_and_a_restart_reuses_the_profile(tmp_path, caplog):
    url = f"file://{tmp_path.as_posix()}/ck"
    disk = throttle(open_storage(url), bytes_per_s=RATE)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # short windows: react within a few intervals (the default 50 steps is for long runs)
    auto = Auto(profile_steps=10, tuning=TunerConfig(window_steps=20))
    ckpt = Checkpointer({"model": model, "opt": opt}, storage=disk, policy=auto)
    with caplog.at_level(logging.INFO, logger="cfdist.policy"):
        _train(ckpt, model, opt, 100)
        k_before, slow_at = ckpt.stats["k"], ckpt.step_count
        disk.set_bytes_per_s(RATE / 5)            # the disk is 5x slower from now on
        _train(ckpt, model, opt, 200)
    ckpt.close()
    stats = ckpt.stats
    assert stats["phase"] == "tuning" and not stats["profile_from_cache"]
    assert stats["profile"]["m"] >= STATE_BYTES
    raised = [c for c in stats["changes"] if c["step"] > slow_at and c["k_new"] > c["k_old"]]
    assert k_before is not None and stats["k"] > k_before and raised, (k_before, stats["changes"])
    assert all(c["reason"].startswith(f"k={c['k_new']} because") and "Ts=" in c["reason"] for c in raised)
    assert any(r.getMessage() == raised[-1]["reason"] for r in caplog.records)  # logged with inputs
    # the slow persist (about 2.5 s) fits in the interval again
    Ts_slow = STATE_BYTES / (RATE / 5)
    assert stats["k"] * stats["profile"]["Ti"] >= 0.6 * Ts_slow, stats["changes"]
    assert stats["expected_lost_work"]["iterations"] >= stats["k"] / 2

    # ---- restart: the same model, batch and world on the same storage -------------------------
    cached = _cached(url)
    k, restored_at = cached["k"], stats["latest_step"]
    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1e-3)
    ck2 = Checkpointer({"model": model2, "opt": opt2}, storage=open_storage(url),
                       policy=Auto(profile_steps=10, tuning=TunerConfig(window_steps=20)))
    assert ck2.restore() == restored_at
    n = min(k, 20) + 2
    _train(ck2, model2, opt2, n)
    ck2.close()
    s2 = ck2.stats
    assert s2["profile_from_cache"] and s2["phase"] == "tuning"
    first = s2["changes"][0]
    assert first["step"] == restored_at + 1 and "cached profile" in first["reason"]
    # This restart is the run's first failure: history.json (the run's start, this restart) gives
    # an MTBF, so k is Young/Daly's optimum over the cached profile, not the k cached without one.
    assert s2["mtbf_source"] == "history" and s2["mtbf_s"] is not None
    k = first["k_new"]
    # no profiling snapshot (it would come at restored + 10): the next checkpoint is k steps on
    assert ck2.latest_step == (restored_at + k if k <= n else restored_at), (k, ck2.latest_step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_auto_profiles_both_snapshot_kinds_and_picks_gpu_memory(tmp_path):
    """Real: a CUDA model, the checkpointer's GPU and CPU snapshots, ``torch.cuda`` memory
    figures. The point: a small state fits in free GPU memory, so Auto snapshots there."""
    model = _model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ckpt = Checkpointer({"model": model, "opt": opt}, storage=f"file://{tmp_path.as_posix()}/ck",
                        policy=Auto(profile_steps=10))
    x = torch.randn(8, 512, device="cuda")
    for _ in range(40):
        model(x).square().mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
    ckpt.close()
    s = ckpt.stats
    prof = s["profile"]
    assert s["phase"] == "tuning" and prof["Tg"] is not None
    assert 0 < prof["M"] < prof["Mmax"] and prof["m"] >= STATE_BYTES
    assert s["decision"]["mode"] == "gpu" and s["mode"] == "gpu"
