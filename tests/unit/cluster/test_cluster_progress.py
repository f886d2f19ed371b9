"""The driver's console during a run (the progress display rendered to a string, no terminal).

Real: the event log and the progress display (rich). Faked: the records (what the controller
emits). The points: the bar follows the event log; however many failures one recovery absorbs,
the console gets one line saying what failed and from which step and tier the run resumed; after
failures, the last line names the rank logs.
"""

from __future__ import annotations

import io

from rich.console import Console

from cfdist.cluster.events import EventLog
from cfdist.cluster.progress import ProgressDisplay


def _console_lines(records: list[tuple[str, dict]]) -> list[str]:
    out = io.StringIO()
    events = EventLog(None)
    with ProgressDisplay(events, total_steps=24, console=Console(file=out, width=200, color_system=None)):
        for name, fields in records:
            events.emit(name, **fields)
    return [ln for ln in out.getvalue().splitlines() if ln.startswith("cfdist:")]


RUN = [("start", {"world_size": 2, "nodes": 2, "logs": "/runs/demo/logs-1234abcd"}),
       ("restarted", {"world_size": 2}), ("step", {"step": 1})]


def test_a_recovered_failure_is_one_line_and_the_end_names_the_logs():
    lines = _console_lines(RUN + [
        ("failure", {"kind": "crash", "rank": 1, "node": 1, "step": 10, "injected": True}),
        ("detected", {}), ("restarted", {"world_size": 2}),
        ("restored", {"step": 8, "tier": "memory", "detect_s": 0.1}), ("step", {"step": 9}),
        ("end", {"step": 24})])
    assert lines == ["cfdist: crash of rank 1 at step 10 (injected): resumed from step 8 (memory)",
                     "cfdist: 1 failure(s); details in the rank logs: /runs/demo/logs-1234abcd"]


def test_a_failure_during_a_recovery_joins_its_line():
    lines = _console_lines(RUN + [
        ("failure", {"kind": "crash", "rank": 1, "node": 1, "step": 10}),
        ("failure", {"kind": "preempt", "rank": None, "node": 0, "step": 10}),
        ("restored", {"step": 8, "tier": "shared", "detect_s": 0.1}),
        ("end", {"step": 24})])
    assert lines[0] == "cfdist: crash of rank 1 at step 10, then preempt of node 0 at step 10: resumed from step 8 (shared)"
    assert len(lines) == 2


def test_a_run_without_failures_prints_no_line():
    assert _console_lines(RUN + [("end", {"step": 24})]) == []


def test_progress_shows_step_loss_checkpoints_failures_and_world():
    buf = io.StringIO()
    log = EventLog(None)
    with ProgressDisplay(log, total_steps=20, console=Console(file=buf, width=200, force_terminal=False)) as p:
        log.emit("restarted", world_size=4)
        log.emit("step", step=5, loss=0.5)
        log.emit("checkpoint_committed", step=4, tier="memory")
        log.emit("checkpoint_committed", step=4, tier="local")
        log.emit("failure", kind="preempt", step=6)
        log.emit("restored", step=4, tier="peer")
        log.emit("end", step=20)
        fields = p._fields()
    out = buf.getvalue()
    assert fields["ckpt"] == "local:4 memory:4" and fields["failures"] == 1 and fields["world"] == 4
    assert fields["loss"] == "0.5000" and fields["status"] == "done"
    assert "20/20" in out


def test_disabled_progress_prints_nothing():
    buf = io.StringIO()
    log = EventLog(None)
    with ProgressDisplay(log, enabled=False, console=Console(file=buf)):
        log.emit("step", step=1)
    assert buf.getvalue() == ""


def test_progress_prints_the_cluster_line_and_a_smaller_world_against_the_wanted_one():
    buf = io.StringIO()
    log = EventLog(None)
    with ProgressDisplay(log, total_steps=10, console=Console(file=buf, width=200, force_terminal=False)) as p:
        log.emit("start", world_size=2, nodes=2)
        log.emit("cluster", message="no RAY_ADDRESS: started 2 simulated Ray node(s) on this machine")
        log.emit("restarted", world_size=2)
        assert p._fields()["world"] == 2
        log.emit("failure", kind="crash", step=7, rank=1, injected=True)
        log.emit("restarted", world_size=1)
        log.emit("restored", step=4, tier="memory", detect_s=0.1)
        assert p._fields()["world"] == "1/2"
    out = buf.getvalue()
    assert "started 2 simulated Ray node(s)" in out
    assert "cfdist: crash of rank 1 at step 7 (injected): resumed from step 4 (memory)" in out
