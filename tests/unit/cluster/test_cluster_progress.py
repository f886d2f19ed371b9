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
