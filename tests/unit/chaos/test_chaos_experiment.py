"""The experiment's pure parts: config checks, schedule and policy mapping, analysis and report.

No Ray here: ``analyse`` and ``write_report`` get event logs written by hand (the driver's
format), so the numbers in results.json and the tables can be checked exactly.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from chaos_eventlog import started

from cfdist.experiments.experiment import (
    ExperimentConfig, FirstFailures, analyse, build_schedule, make_policy, main, sim_policy,
)
from cfdist.chaos.report import (
    baseline_goodputs, baseline_time_lost, markdown, repeat_lines, repeated, write_repeats, write_report,
)
from cfdist.experiments import experiment as experiment_mod
from cfdist.chaos.simulator import EpochBoundary, FixedK


@pytest.mark.parametrize("kw, phrase", [
    (dict(policies=("auto", "sometimes")), "'sometimes' is not a policy"),
    (dict(policies=("auto", "auto")), "lists a policy twice"),
    (dict(policies=()), "non-empty tuple"),
    (dict(policies=["auto"]), "non-empty tuple"),
    (dict(steps=50, epoch_steps=100), "less than one epoch"),
    (dict(mtbf_s=0), "mtbf_s must be a finite number > 0"),
    (dict(schedule="weekly"), "schedule must be one of"),
    (dict(node_loss="remove", ray_address="ray://head:10001"), "use node_loss='drain'"),
    (dict(overhead_budget=3.5), "fraction in (0, 1)"),
    (dict(max_scheduled=0), "max_scheduled must be an int >= 1"),
    (dict(baseline_steps=1), "baseline_steps must be an int >= 3"),
    (dict(num_nodes=0), "num_nodes must be an int >= 1"),
    (dict(schedule="trace", failures="preempt"), "needs trace="),
    (dict(schedule="trace", trace="bamboo-p3-trace.csv"), "set failures='preempt'"),
    (dict(trace="bamboo-p3-trace.csv"), "only with schedule='trace'"),
    (dict(schedule="trace", trace="bamboo-p3-trace.csv", failures="preempt", time_scale=0), "time_scale must be"),
])
def test_config_refuses_what_cannot_run_and_says_why(kw, phrase):
    with pytest.raises(ValueError, match=None) as e:
        ExperimentConfig(**kw)
    assert phrase in str(e.value)


def test_mixed_fixed_schedule_alternates_crash_and_preemption_and_can_be_capped():
    c = ExperimentConfig(mtbf_s=5.0, notice_s=0.5, failures="mixed", schedule="fixed")
    evs = [e for e in build_schedule(c).events(2, 26.0)]
    fails = [(e.time_s, e.kind) for e in evs if e.is_failure]
    assert fails == [(5.0, "crash"), (10.0, "preempt"), (15.0, "crash"), (20.0, "preempt"), (25.0, "crash")]
    assert all(e.notice_s == 0.5 for e in evs if e.kind == "preempt")
    capped = build_schedule(ExperimentConfig(mtbf_s=5.0, schedule="fixed", max_scheduled=2)).events(2, 100.0)
    assert [(e.time_s, e.kind) for e in capped] == [(5.0, "crash"), (10.0, "preempt"), (10.0, "return")]


def test_a_trace_schedule_is_cfdist_plans_reading_of_the_trace_time_compressed():
    """The experiment replays exactly the events ``cfdist plan`` simulates for the same trace
    window (so a plan can be checked against the run), times and notices scaled."""
    from cfdist.planner import TraceFailures, resolve_trace

    c = ExperimentConfig(schedule="trace", trace="bamboo-g4dn-trace.csv", failures="preempt", time_scale=1 / 180,
                         notice_s=0.5, seed=3)
    got = build_schedule(c).events(2, 40.0)
    want = TraceFailures(path=resolve_trace("bamboo-g4dn-trace.csv"), notice_s=0.5 * 180).events(2, 40.0 * 180, 3)
    assert got and [(e.kind, e.node) for e in got] == [(e.kind, e.node) for e in want]
    assert [e.time_s for e in got] == pytest.approx([e.time_s / 180 for e in want])
    assert all(e.notice_s == pytest.approx(0.5) for e in got if e.kind == "preempt")
    assert all(e.time_s < 40.0 for e in got)
    mtbf = TraceFailures(path=resolve_trace("bamboo-g4dn-trace.csv")).mtbf_s(2) / 180
    assert make_policy("auto-mtbf", c).mtbf_s == pytest.approx(mtbf)   # auto-mtbf is told the trace's MTBF


def test_first_failures_drops_the_return_of_a_dropped_preemption():
    class S:
        def events(self, n, h):
            from cfdist.chaos import FailureEvent as E
            return [E(time_s=1.0, kind="preempt", node=0), E(time_s=2.0, kind="preempt", node=1),
                    E(time_s=3.0, kind="return", node=1), E(time_s=4.0, kind="return", node=0)]

    assert [(e.time_s, e.kind) for e in FirstFailures(S(), 1).events(2, 10.0)] == [(1.0, "preempt"), (4.0, "return")]


def test_policy_specs_map_to_the_real_and_the_simulated_policy():
    import cfdist

    c = ExperimentConfig(mtbf_s=12.0, overhead_budget=0.05, epoch_steps=100)
    assert isinstance(make_policy("epoch", c), cfdist.EveryEpoch)
    assert make_policy("every:7", c).k == 7
    auto, aware = make_policy("auto", c), make_policy("auto-mtbf", c)
    assert (auto.config.max_overhead, auto.config.mtbf_s) == (0.05, None)
    assert aware.config.mtbf_s == 12.0 and make_policy("auto-mtbf:30", c).config.mtbf_s == 30.0
    assert sim_policy("epoch", c, None) == EpochBoundary(iters_per_epoch=100)
    assert sim_policy("every:7", c, 7) == FixedK(k=7)
    assert sim_policy("auto", c, 13) == FixedK(k=13)
    with pytest.raises(ValueError, match="never reported its k"):
        sim_policy("auto-mtbf", c, None)


def _logs(restart: float = 2.0):
    """A baseline and two policies' runs under one crash at 1.5 s after the first step."""
    base = started().run(30)
    every = started(k=5).run(12).fail(restart=restart, restore=1.0).run(20)
    auto = started(k=4, kval=4).run(13).fail(restart=restart, restore=1.0).run(18)
    out = {}
    for name, log in (("baseline", base), ("every:5", every), ("auto", auto)):
        log.at(0.2, "end", step=30)
        out[name] = (log.recs, types.SimpleNamespace(event_log=f"/logs/{name}.jsonl", final_step=30), 9.0)
    return out


def test_analysis_measures_each_run_and_predicts_it_from_its_own_and_the_others_costs(tmp_path):
    c = ExperimentConfig(policies=("every:5", "auto"), steps=30, epoch_steps=10, mtbf_s=1.0, failures="crash",
                         schedule="fixed", max_scheduled=1, out_dir=str(tmp_path),
                         live_recovery=False)   # the logs roll back to a commit
    res = analyse(c, build_schedule(c), _logs(), str(tmp_path))
    assert res.iter_s == pytest.approx(0.1) and res.baseline.goodput == pytest.approx(1.0)
    every, auto = res.run("every:5"), res.run("auto")
    assert (every.k, auto.k) == (5, 4) and auto.k_at_failures == (4,) and every.k_at_failures == (5,)
    for r, lost in ((every, 2), (auto, 1)):
        (f,) = r.measured.failures
        assert (f.kind, f.lost_iters) == ("crash", lost)
        assert r.measured.useful_iters == 30
        assert (r.costs.restart_s, r.costs.restore_s) == pytest.approx((2.0, 1.0))
        assert r.prediction.sim.num_failures == 1
        # the hand-written runs follow the simulator's model: its prediction is close
        assert abs(r.prediction.relative_error) < 0.05, r.prediction
    assert every.sim_policy == "FixedK(k=5)" and auto.sim_policy == "FixedK(k=4)"
    with pytest.raises(KeyError, match="ran"):
        res.run("epoch")


def test_report_writes_json_tables_and_figures(tmp_path):
    c = ExperimentConfig(policies=("every:5", "auto"), steps=30, epoch_steps=10, mtbf_s=1.0, failures="crash",
                         schedule="fixed", max_scheduled=1, out_dir=str(tmp_path),
                         live_recovery=False)   # the logs roll back to a commit
    res = analyse(c, build_schedule(c), _logs(), str(tmp_path))
    files = write_report(res, str(tmp_path), title="t")
    data = json.load(open(files["results.json"]))
    assert [r["policy"] for r in data["runs"]] == ["every:5", "auto"]
    run = data["runs"][1]
    assert run["per_failure"][0]["k"] == 4 and run["per_failure"][0]["lost_iters"] == 1
    assert set(run["phase_means_s"]) == {"detect", "wait", "restart", "restore", "catchup"}
    assert data["schedule"] == [{"time_s": 1.0, "kind": "crash", "node": 1, "rank": 1, "notice_s": 0.0}]
    md = open(files["results.md"]).read()
    assert md == markdown(res)
    assert "| auto | 4 | 1 |" in md and "| every:5 | 5 | 1 |" in md and "| policy | detect | wait |" in md
    assert run["lost_by_kind"] == [{"kind": "crash", "tier": "memory", "failures": 1, "lost_iters_mean": 1,
                                    "lost_iters_max": 1}]
    assert "| auto | crash | memory | 1 | 1.0 (1) |" in md and "| every:5 | crash | memory | 1 | 2.0 (2) |" in md
    # the failure-free run's own score by the same measure, for comparison
    assert "the failure-free run (30 steps) scores 1.000 by the same measure" in md
    assert data["baseline"]["goodput"] == 1.0
    # where each run's lost time went: the auto run's crash after step 13 rolled back to step 12
    # (1 iteration) after 0.01 + 0.1 + 2.0 + 1.0 s; its steps ran exactly 0.1 s otherwise
    lost = res.run("auto").time_lost
    assert lost.failures_s == pytest.approx(0.01 + 0.1 + 2.0 + 1.0 + 0.1 + 0.1 - 0.1)
    assert (lost.after_failures_s, lost.checkpoint_stalls_s, lost.other_s) == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)
    assert lost.lost_s == pytest.approx(res.run("auto").measured.wall_s * (1 - res.run("auto").measured.goodput))
    assert run["time_lost"]["failures_s"] == pytest.approx(lost.failures_s, abs=1e-4)
    assert data["baseline"]["time_lost"]["lost_s"] == pytest.approx(0.0, abs=1e-4)
    assert "Where the time went:" in md
    assert f"| auto | {lost.window_s:.2f} | {lost.lost_s:.3f} | {lost.failures_s:.3f} | 0.000 | 0.000 | 0.000 |" in md, md
    assert "| no failures | 3.00 | 0.000 | 0.000 | 0.000 | 0.000 | 0.000 |" in md, md
    for name in ("summary.png", "progress.png", "goodput.png", "lost_work.png", "recovery.png"):
        assert open(files[name], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_a_bad_config_with_the_reason(capsys):
    assert main(["--policies", "auto", "never", "--out", "/nonexistent/x"]) == 2
    assert "'never' is not a policy" in capsys.readouterr().err


def test_summary_overlays_need_one_entry_per_result(tmp_path):
    from cfdist.chaos.plots import plot_summary

    c = ExperimentConfig(policies=("every:5", "auto"), steps=30, epoch_steps=10, mtbf_s=1.0, failures="crash",
                         schedule="fixed", max_scheduled=1, out_dir=str(tmp_path),
                         live_recovery=False)   # the logs roll back to a commit
    res = analyse(c, build_schedule(c), _logs(), str(tmp_path))
    measured = [r.measured for r in res.runs]
    with pytest.raises(ValueError, match="predicted has 1 entries for 2 results"):
        plot_summary(measured, str(tmp_path / "s.png"), predicted=[0.5])


def _analysed(tmp_path, restart: float):
    c = ExperimentConfig(policies=("every:5", "auto"), steps=30, epoch_steps=10, mtbf_s=1.0, failures="crash",
                         schedule="fixed", max_scheduled=1, out_dir=str(tmp_path), live_recovery=False)
    return analyse(c, build_schedule(c), _logs(restart), str(tmp_path))


def test_repetitions_report_each_policys_median_goodput_and_range_and_pool_the_failures(tmp_path):
    """Three repetitions whose recoveries took 2, 5 and 1 s to restart: each policy's goodput
    median is the middle repetition's, the range spans the other two, and the three failures
    are pooled (their recoveries' median is the middle one's)."""
    results = [_analysed(tmp_path, r) for r in (2.0, 5.0, 1.0)]
    rows = repeated(results)
    assert [r.policy for r in rows] == ["every:5", "auto"]
    for row, name in zip(rows, ("every:5", "auto")):
        each = [res.run(name).measured.goodput for res in results]
        assert row.goodputs == tuple(each) and each[2] > each[0] > each[1]   # the faster restart, the better
        assert row.goodput_median == pytest.approx(each[0])
        assert row.failures == 3 and row.lost_iters == ((2, 2, 2) if name == "every:5" else (1, 1, 1))
        rec = [res.run(name).measured.failures[0].recovery_s for res in results]
        assert row.recovery_s_median == pytest.approx(sorted(rec)[1])
    assert rows[1].ks == (4, 4, 4)
    files = write_repeats(results, str(tmp_path / "out"))
    md = open(files["repeats.md"]).read()
    auto = rows[1]
    assert md.startswith("Over 3 repetitions of the same experiment")
    assert (f"| auto | {auto.goodput_median:.3f} | {min(auto.goodputs):.3f} - {max(auto.goodputs):.3f} | "
            f"{', '.join(f'{g:.3f}' for g in auto.goodputs)} | 4, 4, 4 | 3 | 1 |") in md, md
    assert "The failure-free runs by the same measure" in md and "median 1.000 (1.000 - 1.000; 1.000, 1.000, 1.000)" in md
    iters = [res.iter_s for res in results]   # the hand-written failure-free runs: the same median step
    assert (f"ideal iteration time (its failure-free run's median step): {min(iters) * 1e3:.2f} - "
            f"{max(iters) * 1e3:.2f} ms") in md and "+-0.0 %)" in md, md
    data = json.load(open(files["repeats.json"]))
    assert data["baseline_goodputs"] == [1.0, 1.0, 1.0]
    assert data["ideal_iteration_s"] == [pytest.approx(x, abs=1e-6) for x in iters]
    assert [p["policy"] for p in data["policies"]] == ["every:5", "auto"]
    assert data["policies"][1]["failures"] == 3 and data["policies"][1]["lost_iters"] == [1, 1, 1]
    assert len(data["repetitions"]) == 3
    # where the lost time went, each part's median over the repetitions: the middle restart's
    fails = sorted(res.run("auto").time_lost.failures_s for res in results)
    assert auto.time_lost_median().failures_s == pytest.approx(fails[1])
    assert data["policies"][1]["time_lost_median"]["failures_s"] == pytest.approx(fails[1], abs=1e-4)
    assert data["baseline_time_lost_median"]["lost_s"] == pytest.approx(0.0, abs=1e-4)
    assert "Where the time went (each figure's median over the repetitions)" in md
    assert f"| auto | {auto.time_lost_median().window_s:.2f} | " in md
    lines = repeat_lines(rows, baseline_goodputs(results), (), baseline_time_lost(results))
    assert lines[0].endswith("time lost median 0.00s: failures 0.00, after failures 0.00, checkpoint stalls 0.00, "
                             "other 0.00"), lines
    assert lines[-1].strip() == f"time lost median {auto.time_lost_median().lost_s:.2f}s: failures {fails[1]:.2f}, " \
                                "after failures 0.00, checkpoint stalls 0.00, other 0.00", lines


def test_repetitions_report_how_far_their_ideal_iteration_times_lie_apart(tmp_path):
    """Each repetition's goodput is measured against its own failure-free run's median step; the
    report says how far those lie apart (43.12-44.14 ms on the development machine in one
    session: +-1.2 %, as much as a policy change moved the goodput), also on the console."""
    from cfdist.chaos.report import ideal_iterations, repeat_lines, repeats_markdown

    base = _analysed(tmp_path, 1.0)
    results = [dataclasses.replace(base, iter_s=x) for x in (0.0440, 0.0431, 0.0436)]
    assert ideal_iterations(results) == (0.0440, 0.0431, 0.0436)
    rows = repeated(results)
    md = repeats_markdown(rows, baseline_goodputs(results), ideal_iterations(results))
    assert "43.10 - 44.00 ms (median 43.60 ms, +-1.0 %)" in md, md
    lines = repeat_lines(rows, baseline_goodputs(results), ideal_iterations(results))
    assert lines[-1].startswith("Each repetition's ideal iteration time") and "+-1.0 %" in lines[-1], lines
    assert not any("ideal iteration" in line for line in repeat_lines(rows, baseline_goodputs(results)))
    no_baseline = [dataclasses.replace(r, baseline=None) for r in results]
    assert ideal_iterations(no_baseline) == ()   # a pooled estimate, not a yardstick per repetition


def test_repetitions_of_different_policies_are_refused(tmp_path):
    a = _analysed(tmp_path, 2.0)
    b = dataclasses.replace(a, runs=a.runs[:1])
    with pytest.raises(ValueError, match="repetition 2 ran"):
        repeated([a, b])
    with pytest.raises(ValueError, match="no repetitions"):
        repeated([])


def test_run_repeated_runs_the_whole_experiment_n_times_each_into_its_own_directory(tmp_path, monkeypatch):
    """Faked: the Ray runs themselves (``run_experiment`` returns hand-written logs' analysis);
    what is tested is the repetition: one directory per repetition, the summary written over
    all of them, the console lines."""
    seen = []

    def fake_run(config, *, log):
        seen.append(config.out_dir)
        return _analysed(tmp_path, 1.0 + len(seen))

    monkeypatch.setattr(experiment_mod, "run_experiment", fake_run)
    out = tmp_path / "exp"
    lines = []
    c = ExperimentConfig(policies=("every:5", "auto"), out_dir=str(out))
    results = experiment_mod.run_repeated(c, 3, log=lines.append)
    assert seen == [str(out / f"repeat-{i}") for i in (1, 2, 3)] and len(results) == 3
    assert lines[0] == "=== repetition 1/3" and "over 3 runs" in lines[-4] and lines[-1].endswith("repeats.json")
    assert lines[-3].strip().startswith("time lost median")
    assert lines[-2].startswith("Each repetition's ideal iteration time"), lines
    assert any(line.startswith("no failures  goodput median 1.000") for line in lines), lines
    assert (out / "repeats.md").exists() and (out / "repeats.json").exists()
    with pytest.raises(ValueError, match="repeat must be a whole number >= 1"):
        experiment_mod.run_repeated(c, 0)


def test_cli_refuses_a_repeat_below_one(capsys):
    assert main(["--repeat", "0", "--out", "/nonexistent/x"]) == 2
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err


def test_the_ray_job_entry_point_runs_the_repetitions_and_prints_the_medians(tmp_path, monkeypatch, capsys):
    """``launch/preemption_experiment.py --repeat 2`` (the experiment as a Ray job) runs the
    repetitions and prints each policy's median goodput. Faked: the Ray runs (as above)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "launch" / "preemption_experiment.py"
    spec = importlib.util.spec_from_file_location("preemption_experiment", path)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    monkeypatch.setattr(experiment_mod, "run_experiment", lambda config, *, log: _analysed(tmp_path, 2.0))
    out = job.main(["--repeat", "2", "--policies", "every:5", "auto", "--out", str(tmp_path / "job")])
    assert out["repetitions"] == 2 and set(out["goodput_median"]) == {"every:5", "auto"}
    assert out["repeats"] == str(tmp_path / "job" / "repeats.json") and (tmp_path / "job" / "repeats.json").exists()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"experiment": out}


def test_the_report_gives_the_failure_free_runs_own_goodput_by_the_same_measure(tmp_path):
    """Goodput's yardstick is the failure-free run's median step, so that run itself scores below
    1 by its slow steps (here two steps 0.3 s slower than the 0.1-s median: 3.0 / 3.6 s); the
    report, the console summary and the repetitions' summary say so beside the policies."""
    from cfdist.chaos.report import baseline_goodputs, repeat_lines, summary_lines

    c = ExperimentConfig(policies=("every:5", "auto"), steps=30, epoch_steps=10, mtbf_s=1.0, failures="crash",
                         schedule="fixed", max_scheduled=1, out_dir=str(tmp_path), live_recovery=False)
    logs = _logs()
    slow = started(k=10).run(30, extra_s=0.3)   # steps 11 and 21 take 0.4 s
    slow.at(0.2, "end", step=30)
    logs["baseline"] = (slow.recs, logs["baseline"][1], 9.0)
    res = analyse(c, build_schedule(c), logs, str(tmp_path))
    assert res.iter_s == pytest.approx(0.1)
    assert res.baseline.goodput == pytest.approx(3.0 / 3.6, abs=1e-3)
    assert "the failure-free run (30 steps) scores 0.833 by the same measure" in markdown(res)
    assert summary_lines(res.runs, res.baseline)[0].startswith("no failures            goodput 0.833")
    assert len(summary_lines(res.runs)) == len(res.runs)
    other = _analysed(tmp_path, 2.0)   # a repetition whose failure-free run had no slow step
    assert baseline_goodputs([res, other, dataclasses.replace(other, baseline=None)]) == pytest.approx((0.833, 1.0), abs=1e-3)
    assert repeat_lines(repeated([res, other]), baseline_goodputs([res, other]))[0].startswith(
        "no failures  goodput median 0.917 (0.833 - 1.000; 0.833, 1.000)")
