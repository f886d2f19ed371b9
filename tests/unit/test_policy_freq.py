"""Table tests of the checkpoint-frequency math (cfdist.policy.freq): pure, milliseconds."""

import math

import pytest

from cfdist.policy import freq
from cfdist.policy.freq import Profile

GB = 1 << 30


def test_worked_example_from_the_paper():
    # checkpoint cost and iteration time both 1 unit, p = 5% -> every 20 iterations
    assert freq.k_budget(Ti=1.0, To=1.0, p=0.05) == 20
    prof = Profile(Ti=1.0, Tw=0.0, Tc=5.0, Tg=1.0, Ts=0.0, m=1 * GB, M=1 * GB, Mmax=16 * GB)
    d = freq.decide(prof, p=0.05)
    assert (d.mode, d.To, d.k) == ("gpu", 1.0, 20)


@pytest.mark.parametrize(
    "prof, p, mode, To, k_persist, k_budget, k",
    [
        # GPU snapshot fits: To = Tg; the persist sets k (ceil(2.0 / 0.2) = 10)
        (Profile(Ti=0.2, Tw=0.05, Tc=0.3, Tg=0.01, Ts=2.0, m=1 * GB, M=10 * GB, Mmax=80 * GB),
         0.035, "gpu", 0.01, 10, 2, 10),
        # no room on the GPU: CPU snapshot, 0.3 - (0.2 - 0.05) = 0.15 s stalls; the budget sets k
        (Profile(Ti=0.2, Tw=0.05, Tc=0.3, Tg=0.01, Ts=2.0, m=10 * GB, M=70 * GB, Mmax=80 * GB),
         0.035, "cpu", 0.15, 11, 22, 22),
        # no GPU at all; the CPU copy hides in the next forward/backward (To = 0)
        (Profile(Ti=0.2, Tw=0.05, Tc=0.1, Ts=1.0, m=GB), 0.035, "cpu", 0.0, 6, 1, 6),
        # GPU measured but memory figures unknown: CPU
        (Profile(Ti=0.2, Tw=0.05, Tc=0.1, Tg=0.01, Ts=1.0, m=GB), 0.035, "cpu", 0.0, 6, 1, 6),
        # profiling measured more than the model (state capture, contention): the measurement wins
        (Profile(Ti=0.2, Tw=0.05, Tc=0.1, Ts=1.0, m=GB, Oc=0.07), 0.035, "cpu", 0.07, 6, 10, 10),
        # ... and the model wins where it is larger
        (Profile(Ti=0.2, Tw=0.05, Tc=0.3, Ts=2.0, m=GB, Oc=0.01), 0.035, "cpu", 0.15, 11, 22, 22),
        (Profile(Ti=0.2, Tw=0.05, Tc=0.3, Tg=0.01, Ts=2.0, m=GB, M=GB, Mmax=80 * GB, Og=0.02),
         0.035, "gpu", 0.02, 10, 3, 10),
        # a bigger budget needs fewer iterations per checkpoint
        (Profile(Ti=1.0, Tw=0.0, Tc=9.0, Tg=1.0, Ts=0.0, m=1, M=1, Mmax=100), 0.10, "gpu", 1.0, 1, 10, 10),
    ],
)
def test_decide_table(prof, p, mode, To, k_persist, k_budget, k):
    d = freq.decide(prof, p=p)
    assert d.mode == mode
    assert d.To == pytest.approx(To)
    assert (d.k_persist, d.k_budget, d.k, d.k_young) == (k_persist, k_budget, k, None)
    assert f"k={k} " in d.reason(prof, p) and f"p={p * 100:.3g}%" in d.reason(prof, p)


@pytest.mark.parametrize(
    "m, M, Mmax, headroom, fits",
    [
        (5, 90, 100, 0.05, True),    # exactly at the edge: 95 <= 95
        (6, 90, 100, 0.05, False),
        (50, 40, 100, 0.0, True),
        (1, None, 100, 0.05, False),  # no GPU figures: never
    ],
)
def test_gpu_fits_table(m, M, Mmax, headroom, fits):
    assert freq.gpu_fits(m, M, Mmax, headroom=headroom) is fits


@pytest.mark.parametrize(
    "Ti, Tw, Tc, To",
    [(0.2, 0.05, 0.1, 0.0), (0.2, 0.05, 0.15, 0.0), (0.2, 0.05, 0.3, 0.15), (0.1, 0.1, 0.05, 0.05)],
)
def test_cpu_overhead_is_what_the_next_iteration_cannot_hide(Ti, Tw, Tc, To):
    assert freq.cpu_overhead(Ti=Ti, Tw=Tw, Tc=Tc) == pytest.approx(To)


@pytest.mark.parametrize("Ti, To, latency, mtbf", [
    (1.0, 1.0, 0.0, 20000.0), (0.2, 0.05, 2.0, 3600.0), (0.5, 0.0, 1.0, 600.0), (0.01, 0.3, 5.0, 1e6),
])
def test_k_young_is_the_integer_minimum_of_the_waste(Ti, To, latency, mtbf):
    k = freq.k_young(Ti=Ti, To=To, latency_s=latency, mtbf_s=mtbf)
    x = int(math.sqrt(2 * To * mtbf) / Ti)
    brute = min([1, *range(max(1, x - 2000), x + 2000)], key=lambda j: freq.waste_rate(k=j, Ti=Ti, To=To, latency_s=latency, mtbf_s=mtbf))
    assert freq.waste_rate(k=k, Ti=Ti, To=To, latency_s=latency, mtbf_s=mtbf) == pytest.approx(
        freq.waste_rate(k=brute, Ti=Ti, To=To, latency_s=latency, mtbf_s=mtbf))
    if To > 0:  # Young's closed form, up to rounding
        assert abs(k - math.sqrt(2 * To * mtbf) / Ti) <= 1


@pytest.mark.parametrize("mtbf, Ts, k", [
    (20000.0, 0.0, 200),  # Young: sqrt(2 * 1 * 20000) / 1 = 200 > the budget's 20: fewer checkpoints
    (50.0, 0.0, 10),      # Young says 10: below the budget's 20 (p = 5%), failures cost more than
                          # the extra checkpoints (waste 0.10 + 0.1 + ... < 0.05 + 0.2 + ...)
    (50.0, 14.0, 16),     # the persist bound ceil((1 + 14 - 1) / 1) = 14 still holds, with 2 quiet steps
])
def test_decide_with_mtbf_minimises_the_waste_above_the_persist_bound(mtbf, Ts, k):
    prof = Profile(Ti=1.0, Tw=0.0, Tc=5.0, Tg=1.0, Ts=Ts, m=1, M=1, Mmax=100)
    d = freq.decide(prof, p=0.05, mtbf_s=mtbf)
    assert d.k == k and d.k_budget == 20 and d.k_young == k
    assert f"MTBF={mtbf:.4g}s" in d.reason(prof, 0.05, mtbf)
    budget = max(d.k_budget, d.k_persist)
    latency = 1.0 + Ts
    assert freq.waste_rate(k=d.k, Ti=1.0, To=1.0, latency_s=latency, mtbf_s=mtbf) <= \
        freq.waste_rate(k=budget, Ti=1.0, To=1.0, latency_s=latency, mtbf_s=mtbf)


def test_lost_work_is_half_an_interval_plus_the_commit_latency():
    assert freq.lost_work_s(k=10, Ti=0.2, latency_s=1.0) == pytest.approx(2.0)


@pytest.mark.parametrize("restarts, now, started, mtbf", [
    ([], 1000.0, None, None),
    ([100.0], 400.0, None, 300.0),
    ([300.0, 100.0, 200.0], 400.0, None, 100.0),
    ([500.0], 400.0, None, None),  # clock went backwards
    ([], 400.0, 100.0, 300.0),     # the first restart: the run's start counts
    ([200.0], 400.0, 0.0, 200.0),  # two gaps since the start
    ([100.0], 400.0, 250.0, 300.0),  # a start after a restart is not this run's: ignored
    ([], 50.0, 100.0, None),       # clock went backwards
])
def test_estimate_mtbf_table(restarts, now, started, mtbf):
    got = freq.estimate_mtbf(restarts, now_s=now, started_s=started)
    assert got == (pytest.approx(mtbf) if mtbf is not None else None)


@pytest.mark.parametrize("restarts, now, started, mtbf", [
    ([], 400.0, 100.0, None),        # the only restart is the present one, which does not count
    ([200.0], 400.0, 0.0, 400.0),    # one failure that counts since the start
    ([100.0, 300.0], 500.0, 0.0, 250.0),
    ([100.0], 400.0, None, None),    # no start time: no gap with a failure in it
    ([100.0, 300.0], 500.0, None, 400.0),
])
def test_estimate_mtbf_when_the_present_start_followed_no_failure_that_counts(restarts, now, started, mtbf):
    """A restart from a survivor's live state (``present=False``): the failures are the
    recorded restarts only."""
    got = freq.estimate_mtbf(restarts, now_s=now, started_s=started, present=False)
    assert got == (pytest.approx(mtbf) if mtbf is not None else None)


@pytest.mark.parametrize("kw, msg", [
    (dict(Ti=0.0, Tw=0.0, Tc=0.1, Ts=1.0, m=1), "Ti must be > 0"),
    (dict(Ti=0.1, Tw=0.2, Tc=0.1, Ts=1.0, m=1), "exceeds Ti"),
    (dict(Ti=0.1, Tw=0.0, Tc=-1.0, Ts=1.0, m=1), "Tc must be a finite duration"),
    (dict(Ti=0.1, Tw=0.0, Tc=0.1, Ts=1.0, m=1.5), "byte count"),
])
def test_profile_validation_says_what_is_wrong(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Profile(**kw)


def test_profile_round_trips_through_dict_and_rejects_unknown_fields():
    prof = Profile(Ti=0.2, Tw=0.05, Tc=0.3, Tg=0.01, Ts=2.0, m=GB, M=10 * GB, Mmax=80 * GB)
    assert Profile.from_dict(prof.to_dict()) == prof
    with pytest.raises(ValueError, match="unknown fields"):
        Profile.from_dict({**prof.to_dict(), "Tx": 1.0})


@pytest.mark.parametrize("p", [0, 1, -0.1, 3.5])
def test_budget_must_be_a_fraction(p):
    with pytest.raises(ValueError, match="0.035 for 3.5%"):
        freq.k_budget(Ti=1.0, To=1.0, p=p)


@pytest.mark.parametrize(
    "Ti, Tsnap, Ts, To, buffers, k",
    [
        (1.0, 0.3, 0.9, 0.0, 1, 2),    # one set: snapshot + persist must fit one interval
        (1.0, 0.3, 0.9, 0.0, 2, 1),    # two sets: the latency may span two intervals
        (1.0, 0.3, 2.5, 0.0, 2, 3),    # ... but one persist per interval (they run one at a time)
        (1.0, 2.0, 1.5, 0.0, 2, 2),    # a long snapshot: latency 3.5 over two intervals
        (0.2, 0.1, 1.0, 0.0, 2, 5),    # Ts / Ti sets it
    ],
)
def test_k_persist_with_double_buffering(Ti, Tsnap, Ts, To, buffers, k):
    assert freq.k_persist(Ti=Ti, Tsnap=Tsnap, Ts=Ts, To=To, buffers=buffers) == k
    prof = Profile(Ti=Ti, Tw=0.0, Tc=Tsnap, Ts=Ts, m=GB)
    assert freq.decide(prof, p=0.5, buffers=buffers).k_persist == k
