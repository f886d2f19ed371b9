"""The tuner and ``Auto`` against scripted measurements: pure, no clocks, no storage.

``cfdist.policy.sim.simulate`` plays a training loop in virtual time and reports to the policy
what the checkpointer would (see its docstring).
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed

from cfdist.checkpoint.agreement import Channel, Frequency
from cfdist.policy import profiler
from cfdist.policy.auto import Auto, AutoConfig
from cfdist.policy.base import PolicyContext, StepMeasurement, profile_key
from cfdist.policy.freq import Profile
from cfdist.policy.sim import simulate
from cfdist.policy.tuner import Tuner, TunerConfig


def overhead(policy_factory, steps, **kw):
    p = policy_factory()
    _, t, base = simulate([p], steps, **kw)
    return p, t / base - 1


class Static:
    """k fixed, as a user would hard-code it (after the same profiling)."""

    def __init__(self, k):
        self.k, self.mode = k, "cpu"

    def should_checkpoint(self, step, *, epoch_end=False):
        return step % self.k == 0

    def observe(self, m):
        pass


# ---- profiling plan ---------------------------------------------------------------------------
@pytest.mark.parametrize("ipe, steps", [(None, 50), (100, 10), (3000, 30), (10**6, 50), (1, 10)])
def test_profile_length_is_one_percent_of_an_epoch_capped_at_50(ipe, steps):
    assert profiler.profile_steps(ipe) == steps


@pytest.mark.parametrize("gpu, plan", [
    (False, {10: "cpu"}),
    (True, {8: "gpu", 10: "cpu"}),
])
def test_profiling_snapshots_at_planned_steps_then_uses_k(gpu, plan):
    p = Auto(profile_steps=10)
    p.bind(PolicyContext(device="cuda" if gpu else "cpu", state_bytes=1000))
    seen = {}
    for s in range(1, 13):  # the plan ends two steps after the CPU snapshot (its overhead)
        if p.should_checkpoint(s):
            seen[s] = p.mode
        p.observe(StepMeasurement(step=s, iter_s=0.1, update_s=0.01, checkpointed=s in seen,
                                  snapshot_s=0.01 if s in seen else None,
                                  snapshot_device=seen.get(s), persist_s=0.3 if s == 11 else None,
                                  persist_bytes=1000 if s == 11 else None))
    assert seen == plan
    assert p.k is None and p.phase == "profiling" and p.proposal() > 0
    p.agreed(p.proposal(), 13)   # what the checkpointer hands over (at once in one process)
    assert p.should_checkpoint(13) is False and p.k is not None and p.phase == "tuning"


def test_gpu_snapshot_refused_falls_back_to_cpu_mode():
    p = Auto(profile_steps=10)
    p.bind(PolicyContext(device="cuda", state_bytes=1000))
    for s in range(1, 14):
        if p.proposal():
            p.agreed(p.proposal(), s)
        took = p.should_checkpoint(s)
        p.observe(StepMeasurement(step=s, iter_s=0.1, update_s=0.01, checkpointed=took,
                                  snapshot_s=0.01 if took else None, snapshot_device="cpu" if took else None,
                                  persist_s=0.3 if s == 11 else None, persist_bytes=1000 if s == 11 else None))
    assert p.k is not None and p.stats()["decision"]["mode"] == "cpu" and p.stats()["profile"]["Tg"] is None


@pytest.mark.parametrize("M, mode", [(10 << 30, "gpu"), (79 << 30, "cpu")])
def test_auto_picks_gpu_snapshots_when_free_gpu_memory_allows(monkeypatch, M, mode):
    monkeypatch.setattr(profiler, "gpu_memory", lambda device: (M, 80 << 30))
    p = Auto(profile_steps=10)
    p.bind(PolicyContext(device="cuda", state_bytes=1 << 30))
    simulate([p], 40, Tsnap=0.01, Ts=lambda s: 0.5)
    assert p.stats()["decision"]["mode"] == mode and p.mode == mode


def test_spare_gpu_memory_does_not_count_the_snapshot_twice(monkeypatch):
    """Training peaks at 50 GiB of 80; the 20 GiB snapshot fits (70 <= 76 with 5% headroom).

    Faked (no GPU here): ``profiler.gpu_memory`` (it reads ``torch.cuda``); after profiling's
    GPU snapshot the peak it reports includes that snapshot's arena, as
    ``torch.cuda.max_memory_allocated`` would. The point: ``M`` is the peak read before the
    snapshot existed, so the mode is ``gpu`` (adding the arena to a peak that already holds it
    would need 90 GiB and pick ``cpu``)."""
    arena = {"held": False}

    def gpu_memory(device):
        return ((70 if arena["held"] else 50) << 30, 80 << 30)

    monkeypatch.setattr(profiler, "gpu_memory", gpu_memory)
    p = Auto(profile_steps=10)
    p.bind(PolicyContext(device="cuda", state_bytes=20 << 30))
    for s in range(1, 14):
        took = p.should_checkpoint(s)
        if took and p.mode == "gpu":
            arena["held"] = True      # the checkpointer allocates the GPU arena after the decision
        p.observe(StepMeasurement(step=s, iter_s=0.1, update_s=0.01, checkpointed=took,
                                  snapshot_s=0.01 if took else None, snapshot_device=p.mode if took else None,
                                  persist_s=0.3 if s == 11 else None, persist_bytes=(20 << 30) if s == 11 else None))
    assert p.stats()["profile"]["M"] == 50 << 30
    assert p.stats()["decision"]["mode"] == "gpu"


# ---- the tuner, window by window --------------------------------------------------------------
def _tuner(k=10, **cfg):
    prof = Profile(Ti=0.1, Tw=0.01, Tc=0.01, Ts=0.5, m=1000)
    return Tuner(TunerConfig(window_steps=50, **cfg), p=0.035, profile=prof, k=k, mode="cpu")


def _feed(tuner, k, extra, intervals, start=1, wait=0.0, persist=None):
    """``intervals`` intervals of ``k`` steps; the checkpoint step costs ``extra`` more, of which
    ``wait`` is a stall for the previous persist; ``persist``: seconds of each persist, reported
    the step after its checkpoint (None: never reported)."""
    out, s = [], start
    for j in range(intervals):
        for i in range(k):
            last = i == k - 1
            ch = tuner.observe(StepMeasurement(step=s, iter_s=0.1 + (extra if last else 0.0),
                                               checkpointed=last, stall_s=wait if last else 0.0,
                                               persist_s=persist if i == 0 and (j or s > start) else None))
            if ch:
                out.append(ch)
            s += 1
    return out


@pytest.mark.parametrize("extra, k_new", [
    (0.1, 39),    # 10% > 3.5%: C0 = 0.1 s -> ceil(0.1 / (0.75 * 3.5% * 0.1 s)) = 39
    (0.03, None), # 3%: in the band, no change
    (0.05, 20),   # 5% > 3.5%: ceil(0.05 / 0.002625) = 20
])
def test_tuner_raises_after_two_windows_over_budget_to_the_target(extra, k_new):
    t = _tuner()
    # the first interval only starts the count; then two windows of 5 intervals (50 steps)
    assert _feed(t, 10, extra, intervals=6) == []  # one window over budget: not yet
    changes = _feed(t, 10, extra, intervals=5, start=61)
    if k_new is None:
        assert changes == [] and t.k == 10
        return
    assert [c.k_new for c in changes] == [k_new] and t.k == k_new and changes[0].step == 110
    c = changes[0]
    assert c.k_old == 10 and c.reason.startswith(f"k={k_new} because overhead=")
    assert "Ti=0.1s" in c.reason and "Ts=0.5s" in c.reason and "p=3.5%" in c.reason
    assert c.inputs["overhead"] == pytest.approx(extra / 1.0)


def test_a_single_burst_of_load_does_not_raise_k():
    t = _tuner()
    assert _feed(t, 10, 0.3, intervals=6) == []        # one bad window (30%)
    assert _feed(t, 10, 0.0, intervals=5, start=61) == []  # then a clean one: forgotten
    assert _feed(t, 10, 0.3, intervals=5, start=111) == [] and t.k == 10


def test_tuner_lowers_only_after_patience_and_never_below_the_persist_floor():
    t = _tuner(k=100, max_factor=20)
    # 0.2% overhead: well below 0.5 * 3.5%; floor = ceil((0.01 + 0.5) / 0.1) = 6
    changes = _feed(t, 100, 0.02, intervals=3)
    assert changes == []  # the first interval only starts the count; two windows < patience 3
    changes = _feed(t, 100, 0.02, intervals=1, start=301)
    # ceil(0.02 / (0.75 * 3.5% * 0.1)) = 8 (above the floor of 6)
    assert [c.k_new for c in changes] == [8]
    assert "for 3 windows" in changes[0].reason
    # a persist that no longer fits in the interval floors the next lowering
    t2 = _tuner(k=100, max_factor=20)
    t2.Ts = 1.5
    _feed(t2, 100, 0.0, intervals=3)
    assert [c.k_new for c in _feed(t2, 100, 0.0, intervals=1, start=301)] == [16]  # ceil(1.51 / 0.1)

    # one change divides k by at most max_factor
    t3 = _tuner(k=100)
    _feed(t3, 100, 0.0, intervals=3)
    assert [c.k_new for c in _feed(t3, 100, 0.0, intervals=1, start=301)] == [12]


def test_a_persist_wait_raises_k_to_where_the_persist_fits():
    t = _tuner(k=10)
    # each checkpoint waits 1.2 s for the previous persist (+ 0.01 s of its own)
    changes = _feed(t, 10, 1.21, intervals=7, wait=1.2)
    # k + ceil(1.2 / 0.1) = 22 lets the persist finish; C0 = 0.01 s alone would allow 4
    assert [c.k_new for c in changes] == [22]
    assert changes[0].inputs["W"] == pytest.approx(1.2) and "W=1.2s" in changes[0].reason
    # no lowering back below 22 while persists are as slow as when the wait was seen
    assert _feed(t, 22, 0.0, intervals=20, start=1000) == []


def test_tuner_band_between_thresholds_is_stable():
    t = _tuner(k=10)
    assert _feed(t, 10, 0.025, intervals=200) == []  # 2.5%: between 1.75% and 3.5%


@pytest.mark.parametrize("kw, msg", [
    (dict(window_steps=0), "window_steps"),
    (dict(lower_below=0.8, lower_target=0.75), "hysteresis"),
    (dict(max_factor=1.0), "max_factor"),
    (dict(ema=0.0), "ema"),
])
def test_tuner_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TunerConfig(**kw)


# ---- Auto end to end in virtual time ----------------------------------------------------------
def test_slower_persist_raises_k_and_overhead_returns_to_budget(caplog):
    slow_from = 3000
    Ts = lambda s: 0.5 if s < slow_from else 2.5  # noqa: E731 - persist 5x slower mid-run
    auto = Auto(max_overhead=0.035, profile_steps=20)
    auto.bind(PolicyContext(state_bytes=1000))
    with caplog.at_level(logging.INFO, logger="cfdist.policy"):
        took, _, _ = simulate([auto], 3000, Ts=Ts)
        k_before = auto.k
        took2, _, _ = simulate([auto], 6000, Ts=Ts, start=3000)
    assert auto.k > k_before  # k rose after the slowdown
    assert auto.k >= -(-2.5 // 0.1)  # the persist fits in the interval again
    raises = [c for c in auto.stats()["changes"] if c["k_old"] and c["k_new"] > c["k_old"]]
    assert raises and all("because" in c["reason"] for c in raises)
    assert any("because" in r.message and "p=3.5%" in r.message for r in caplog.records)
    # overhead in the last 2000 steps is within the budget again
    tail_auto = Auto(max_overhead=0.035, profile_steps=20)
    tail_auto.bind(PolicyContext(state_bytes=1000, cached_profile=auto.profile_to_save()))
    _, ov = overhead(lambda: tail_auto, 2000, Ts=lambda s: 2.5)
    assert ov <= 0.035 * 1.05


def test_static_k_balloons_where_adaptive_stays_in_budget():
    fast, slow = (lambda s: 0.5), (lambda s: 2.5)
    auto = Auto(max_overhead=0.035, profile_steps=20)
    auto.bind(PolicyContext(state_bytes=1000))
    simulate([auto], 2000, Ts=fast)
    k0 = auto.k
    _, ov_static_fast = overhead(lambda: Static(k0), 2000, Ts=fast)
    _, ov_static_slow = overhead(lambda: Static(k0), 2000, Ts=slow)
    _, t, base = simulate([auto], 4000, Ts=slow, start=2000)
    _, t2, base2 = simulate([auto], 2000, Ts=slow, start=6000)
    assert ov_static_fast <= 0.035
    assert ov_static_slow > 3 * 0.035  # static k: each checkpoint waits for the slow persist
    assert t2 / base2 - 1 <= 0.035     # adaptive: back within the budget


def test_k_does_not_oscillate_under_steady_conditions():
    auto = Auto(max_overhead=0.035, profile_steps=20)
    auto.bind(PolicyContext(state_bytes=1000))
    simulate([auto], 20000, To=0.05, Ts=lambda s: 0.5)
    ks = [c["k_new"] for c in auto.stats()["changes"]]
    assert len(ks) <= 3, ks  # profile decision plus at most a couple of corrections


def test_restart_with_the_cached_profile_skips_profiling():
    a = Auto(profile_steps=20)
    ctx = PolicyContext(state_bytes=1000, world_size=1, batch_size=32)
    a.bind(ctx)
    simulate([a], 200)
    saved = a.profile_to_save()
    assert saved is not None and saved["key"] == profile_key(ctx) and saved["k"] == a.k
    assert a.profile_to_save() is None  # once per change
    b = Auto(profile_steps=20)
    b.bind(PolicyContext(state_bytes=1000, world_size=1, batch_size=32, cached_profile=saved))
    took, _, _ = simulate([b], 100, start=1201)
    assert b.stats()["profile_from_cache"] and b.phase == "tuning"
    assert took[0][0] == 1200 + a.k  # the first checkpoint is k steps after the restored step
    assert b.stats()["changes"][0]["step"] == 1201 and "cached profile" in b.stats()["changes"][0]["reason"]


def test_a_cached_profile_for_another_key_is_ignored(caplog):
    a = Auto(profile_steps=20)
    a.bind(PolicyContext(state_bytes=1000))
    simulate([a], 200)
    saved = a.profile_to_save()
    b = Auto(profile_steps=20)
    with caplog.at_level(logging.WARNING, logger="cfdist.policy"):
        b.bind(PolicyContext(state_bytes=2000, cached_profile=saved))
    assert not b.stats()["profile_from_cache"] and "profiling again" in caplog.text


def test_mtbf_from_history_lengthens_k_and_reports_lost_work():
    p0 = Auto(max_overhead=0.035, profile_steps=20)
    p0.bind(PolicyContext(state_bytes=1000))
    simulate([p0], 300, To=0.05)
    p1 = Auto(max_overhead=0.035, profile_steps=20)
    p1.bind(PolicyContext(state_bytes=1000, failure_times_s=[0.0, 50_000.0], now_s=100_000.0))
    simulate([p1], 3000, To=0.05)
    s = p1.stats()
    assert s["mtbf_source"] == "history" and s["mtbf_s"] == pytest.approx(50_000.0)
    # Young/Daly with the 0.05 s per checkpoint measured while profiling:
    # sqrt(2 * 0.05 * 50000) / 0.1 = 707, against 0.05 / (3.5% * 0.1) = 15 for the budget alone
    assert s["profile"]["Oc"] == pytest.approx(0.05)
    assert s["decision"]["k_young"] == pytest.approx(707, rel=0.01)
    assert p0.k < 100 and p1.k == pytest.approx(707, rel=0.05)
    assert "MTBF=5e+04s" in s["changes"][0]["reason"]
    lost = s["expected_lost_work"]
    assert lost["seconds"] == pytest.approx(p1.k * 0.1 / 2 + 0.02 + 0.5, rel=0.05)
    assert lost["iterations"] == pytest.approx(lost["seconds"] / s["profile"]["Ti"], rel=0.2)


def test_given_mtbf_wins_over_history():
    p = Auto(mtbf_s=1000.0)
    p.bind(PolicyContext(failure_times_s=[0.0], now_s=10.0))
    assert p.stats()["mtbf_s"] == 1000.0 and p.stats()["mtbf_source"] == "given"


def test_ranks_agree_through_the_store_even_when_only_rank_0_measures():
    """Rank 1 never snapshots (not the writer): it follows rank 0's k, published through a real
    c10d HashStore by the checkpointer's agreement protocol, step for step."""
    store = torch.distributed.HashStore()
    ranks = [Auto(profile_steps=20), Auto(profile_steps=20)]
    agree = []
    for r, p in enumerate(ranks):
        p.bind(PolicyContext(rank=r, world_size=2, state_bytes=1000))
        ch = Channel(store, rank=r, world_size=2, timeout_s=5.0)
        agree.append(Frequency(ch, rank=r, lookahead=8))
    Ts = lambda s: 0.5 if s < 1500 else 2.5  # noqa: E731
    took, _, _ = simulate(ranks, 4000, Ts=Ts, agreements=agree)  # asserts agreement at every step
    assert took[0] == took[1] and len(took[0]) > 20
    assert ranks[0].k == ranks[1].k and ranks[0].k >= 25
    ch0, ch1 = ranks[0].stats()["changes"], ranks[1].stats()["changes"]
    assert [(c["step"], c["k_new"]) for c in ch0] == [(c["step"], c["k_new"]) for c in ch1]
    assert len(ch0) >= 2 and all(" because " in c["reason"] for c in ch0)
    assert all("agreed from rank 0" in c["reason"] for c in ch1)
    # decisions take effect at window starts (steps 1, 9, 17, ...), never in the first window
    assert all((c["step"] - 1) % 8 == 0 and c["step"] > 8 for c in ch0)
    assert agree[1].reads == 4000 // 8 - 1 and agree[0].reads == 0


@pytest.mark.parametrize("kw, msg", [
    (dict(max_overhead=3.5), "0.035 allows"),
    (dict(mtbf_s=-1.0), "mtbf_s"),
    (dict(profile_steps=3), "profile_steps"),
    (dict(tuning={"window_steps": 5}), "TunerConfig"),
])
def test_auto_config_validation_says_how_to_fix(kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        AutoConfig(**kw)


@pytest.mark.parametrize("kw", [dict(sync=False), dict(unsynced_k=7)])
def test_the_removed_carrier_options_say_what_replaced_them(kw):
    with pytest.raises(TypeError, match="agree on k through the c10d Store"):
        Auto(**kw)


def test_epoch_end_checkpoints_and_resets_the_interval():
    p = Auto(profile_steps=10)
    p.bind(PolicyContext(state_bytes=1000))
    simulate([p], 100)
    k = p.k
    assert p.should_checkpoint(1000, epoch_end=True)
    assert not any(p.should_checkpoint(1000 + i) for i in range(1, k))
    assert p.should_checkpoint(1000 + k)


# ---- failures every few seconds: Young/Daly with the measured cost, not the budget -----------------
def test_with_an_mtbf_the_tuner_follows_young_with_the_measured_cost():
    """Profiling over-measured a checkpoint (k=80); whole windows measure C0 = 0.02 s: with
    failures every 4 s, k goes to Young's optimum for that cost although its overhead is above
    the 3.5% budget, one max_factor step at a time."""
    from cfdist.policy import freq

    prof = Profile(Ti=0.1, Tw=0.01, Tc=0.01, Ts=0.05, m=1000)
    t = Tuner(TunerConfig(window_steps=50, max_factor=5.0), p=0.035, profile=prof, k=80, mode="cpu", mtbf_s=4.0)
    changes, s = [], 1
    for _ in range(40):   # intervals of the k in force; each persist reported the step after its checkpoint
        k = t.k
        for i in range(k):
            ch = t.observe(StepMeasurement(step=s, iter_s=0.1 + (0.02 if i == k - 1 else 0.0),
                                           checkpointed=i == k - 1, persist_s=0.05 if i == 0 and s > 1 else None))
            changes += [ch] if ch else []
            s += 1
    want = freq.k_young(Ti=0.1, To=0.02, latency_s=0.06, mtbf_s=4.0, k_lo=3)
    assert want == 4 and t.k == want and t.Ti == pytest.approx(0.1)
    assert [c.k_new for c in changes] == [16, want]   # 80 / 5, then the optimum
    assert "Young/Daly's k=4 for MTBF=4s" in changes[-1].reason and "C0=0.02s" in changes[-1].reason
    assert 0.02 / (t.k * 0.1) > 0.035   # above the budget: the budget does not bind with an MTBF


def test_with_an_mtbf_a_persist_wait_still_raises_k():
    prof = Profile(Ti=0.1, Tw=0.01, Tc=0.01, Ts=0.5, m=1000)
    t = Tuner(TunerConfig(window_steps=50), p=0.035, profile=prof, k=10, mode="cpu", mtbf_s=10.0)
    changes = _feed(t, 10, 1.21, intervals=7, wait=1.2)
    assert [c.k_new for c in changes] == [22]   # k + ceil(1.2 / 0.1), above Young's optimum
    assert _feed(t, 22, 0.0, intervals=10, start=1000, persist=0.5) == []   # and not lowered back


def test_with_an_mtbf_a_window_without_quiet_steps_does_not_lower_k():
    """With a persist always in flight (none reported) no step is free of checkpoint work: the
    cost per checkpoint would be measured against a stale Ti (here one profiled under load,
    0.2 s, against 0.1 s now), so it must not lower k (it would find checkpoints free and go
    to the persist bound, where no step is ever quiet again): the window doubles k instead."""
    prof = Profile(Ti=0.2, Tw=0.01, Tc=0.01, Ts=0.05, m=1000)
    t = Tuner(TunerConfig(window_steps=50), p=0.035, profile=prof, k=40, mode="cpu", mtbf_s=10.0)
    changes = _feed(t, 40, 0.05, intervals=3)   # no persist reported: never quiet, never fresh
    assert [c.k_new for c in changes] == [80] and t.Ti == 0.2 and t.To_meas is None
    assert "too few to re-measure Ti" in changes[0].reason


def test_a_restart_brings_the_measured_cost_and_the_run_start_gives_an_mtbf():
    """The cache carries what tuning measured a checkpoint to cost; at the first restart the
    run's start (its history) already estimates the MTBF, so k is Young's for that cost."""
    from cfdist.policy import freq

    a = Auto(profile_steps=20)
    ctx = dict(state_bytes=1000, world_size=1, batch_size=32)
    a.bind(PolicyContext(**ctx))
    simulate([a], 600, To=0.02, Ts=lambda step: 0.05)
    saved = a.profile_to_save() or {}
    assert saved.get("To_meas") == pytest.approx(0.02, rel=0.2)
    b = Auto(profile_steps=20)
    b.bind(PolicyContext(**ctx, cached_profile=saved, started_s=1000.0, now_s=1004.0))
    s = b.stats()
    assert s["mtbf_source"] == "history" and s["mtbf_s"] == pytest.approx(4.0)
    assert s["decision"]["To"] == pytest.approx(saved["To_meas"])
    ti, tc, ts = (saved["profile"][x] for x in ("Ti", "Tc", "Ts"))
    want = freq.k_young(Ti=ti, To=saved["To_meas"], latency_s=tc + ts, mtbf_s=4.0,
                        k_lo=s["decision"]["k_persist"])
    assert b.proposal() == want and want < s["decision"]["k_budget"]


def test_auto_under_memory_every_one_profiles_and_reports_its_disk_k():
    """``cfdist.fit(memory_every=1)``: a snapshot every step, so no step is free of one; the
    wrapped Auto still sees clean steps (the memory snapshots are part of Ti) and chooses its
    disk k, which the wrapper reports (the experiment's analysis reads it)."""
    from cfdist.policy.memory import MemoryEvery

    auto = Auto(profile_steps=10)
    p = MemoryEvery(auto, every=1)
    p.bind(PolicyContext(state_bytes=1000))
    took, _, _ = simulate([p], 300, Ts=lambda step: 0.05)
    assert took[0] == list(range(1, 301))            # memory: every step
    assert auto.k is not None and p.k == auto.k   # disk: Auto's k (before the fix: still profiling)
    assert auto.stats()["profile"]["Ti"] == pytest.approx(0.1 + 0.02)   # the memory snapshot's 0.02 s included
    # a persist of a memory-only step does not reach the wrapped policy as Ts
    seen = []
    auto.observe = seen.append
    p.observe(StepMeasurement(step=10_001, iter_s=0.1, checkpointed=True, stall_s=0.01, snapshot_s=0.01,
                              persist_s=0.001, persist_step=10_000))
    assert seen[0].checkpointed is False and seen[0].persist_s is None and seen[0].stall_s == 0.0


# ---- live recovery: the interval answers to the failures that take every replica --------------
def test_with_live_recovery_and_no_failure_seen_auto_assumes_rare_replica_loss_and_lengthens_k():
    """Under live recovery a single failure loses nothing: with none that took every replica
    seen, Auto takes Young/Daly's interval for ``replica_loss_mtbf_s`` (the budget's is what it
    took before), and reports where the MTBF came from."""
    ctx = dict(state_bytes=1000, world_size=2, now_s=5000.0)
    budget = Auto(profile_steps=20)
    budget.bind(PolicyContext(**ctx))
    simulate([budget], 600, To=0.02)
    live = Auto(profile_steps=20)
    live.bind(PolicyContext(**ctx, live_recovery=True))
    simulate([live], 3000, To=0.02)
    b, s = budget.stats(), live.stats()
    assert b["mtbf_s"] is None and b["mtbf_source"] is None
    assert s["mtbf_s"] == 3600.0 and s["mtbf_source"] == "assumed"
    # sqrt(2 * 0.02 * 3600) / 0.1 = 120 steps, against 0.02 / (3.5% * 0.1) = 6 for the budget
    assert s["decision"]["k_young"] == pytest.approx(120, rel=0.05)
    assert budget.k < 12 and live.k == pytest.approx(120, rel=0.1)
    assert "MTBF=3600s" in s["changes"][0]["reason"]


def test_an_assumed_mtbf_never_checkpoints_more_often_than_the_budget():
    """An assumption is not a measurement: where Young/Daly's interval for it is shorter than the
    budget's (an expensive checkpoint, a short assumed MTBF), the budget's holds, in the decision
    and in the tuner's floor; a measured MTBF still overrides the budget (see above)."""
    from cfdist.policy import freq

    prof = Profile(Ti=0.1, Tw=0.01, Tc=0.01, Ts=0.05, m=1000)
    d = freq.decide(prof, p=0.035, mtbf_s=4.0, To=0.02, mtbf_assumed=True)
    assert d.k_young == 4 and d.k_budget == 6 and d.k == 6
    assert freq.decide(prof, p=0.035, mtbf_s=4.0, To=0.02).k == 4
    t = Tuner(TunerConfig(window_steps=50), p=0.035, profile=prof, k=6, mode="cpu", mtbf_s=4.0, mtbf_assumed=True)
    t.To_meas = 0.02
    assert t.k_floor() == 6
    a = Auto(profile_steps=20, replica_loss_mtbf_s=4.0)
    a.bind(PolicyContext(state_bytes=1000, world_size=2, live_recovery=True, now_s=10.0))
    simulate([a], 1500, To=0.02, Ts=lambda step: 0.05)
    assert a.stats()["mtbf_source"] == "assumed" and a.k >= a.stats()["decision"]["k_budget"]
    assert all(c["k_new"] >= 6 for c in a.stats()["changes"])


def test_the_assumed_mtbf_grows_with_a_run_that_saw_no_replica_loss():
    """Two hours in, restarted from a survivor's live state, no failure that took every
    replica: the run's age is the longer MTBF to assume."""
    a = Auto()
    a.bind(PolicyContext(world_size=2, live_recovery=True, started_s=0.0, now_s=7200.0))
    a.restored(1000, live=True)
    assert a.stats()["mtbf_s"] == 7200.0 and a.stats()["mtbf_source"] == "assumed"


def test_a_failure_that_took_every_replica_is_measured_not_assumed():
    """The history holds one restart that rolled back to a checkpoint (the checkpointer leaves
    restarts from live state out): that measured rate wins over the assumption."""
    a = Auto()
    a.bind(PolicyContext(world_size=2, live_recovery=True, failure_times_s=[1000.0], started_s=0.0, now_s=2000.0))
    assert a.stats()["mtbf_source"] == "history" and a.stats()["mtbf_s"] == pytest.approx(1000.0)


def test_a_restart_from_live_state_goes_back_to_the_assumption():
    """The present start followed a failure a survivor's live state recovered: at bind the
    history counted it; ``restored(live=True)`` takes it back, and with no other failure the
    MTBF is the assumed one again (without live recovery it would be unknown: the budget)."""
    a = Auto()
    a.bind(PolicyContext(world_size=2, live_recovery=True, started_s=0.0, now_s=50.0))
    assert a.stats()["mtbf_source"] == "history" and a.stats()["mtbf_s"] == pytest.approx(50.0)
    a.restored(40, live=True)
    assert a.stats()["mtbf_source"] == "assumed" and a.stats()["mtbf_s"] == 3600.0
    b = Auto()
    b.bind(PolicyContext(world_size=2, started_s=0.0, now_s=50.0))
    b.restored(40, live=True)
    assert b.stats()["mtbf_s"] is None


@pytest.mark.parametrize("bad", [0.0, -5.0, float("inf"), "1h"])
def test_replica_loss_mtbf_must_be_seconds(bad):
    with pytest.raises(ValueError, match="replica_loss_mtbf_s"):
        AutoConfig(replica_loss_mtbf_s=bad)
