"""The driver's console during a run: one line per recovered failure, the end names the logs.

Real: the event log and the progress display (rich, writing to a string). Faked: the records
(what the controller emits for a crash, a preemption during its recovery, the resume, the end).
The point: however many failures one recovery absorbs, the console gets one line saying what
failed and from which step and tier the run resumed, and the last line names the rank logs.
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
