"""The driver's progress bar follows the event log (rendered to a string, no terminal)."""

from __future__ import annotations

import io

from rich.console import Console

from cfdist.cluster.events import EventLog
from cfdist.cluster.progress import ProgressDisplay


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
    assert "crash of rank 1 at step 7 (injected): recovering" in out and "resumed from step 4 (memory)" in out
