"""A progress bar on the driver, fed by the event log (rich).

Shows step (of ``total_steps`` when known), the last reported loss, the newest committed
checkpoint per tier, failures and the world size. A failure the run recovers from is one line
above the bar once training resumed (what failed, and from which step and tier it resumed; a
failure during the recovery joins the same line); the end names the rank processes' log files,
where the details are. It is an :class:`EventLog` listener: it never asks the cluster anything. Use as a context manager on the driver; ``enabled=False`` (or a
non-terminal without ``force``) makes it silent.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProgressDisplay:
    """``with ProgressDisplay(events, total_steps=...) as p: ...`` - driver thread."""

    def __init__(self, events, *, total_steps: int | None = None, enabled: bool = True,
                 console: Console | None = None):
        self.enabled = enabled
        self.total = total_steps
        self._state = {"loss": None, "ckpt": {}, "failures": 0, "world": None, "wanted": None, "status": "starting",
                       "logs": None}
        self._unreported: list[str] = []   # failures since training last resumed
        self._progress = None
        self._console = console or Console(stderr=True)
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("ckpt {task.fields[ckpt]}"),
                TextColumn("failures {task.fields[failures]}"), TextColumn("world {task.fields[world]}"),
                TimeElapsedColumn(), console=self._console, transient=False,
                refresh_per_second=4)
            self._task = self._progress.add_task("fit", total=total_steps, **self._fields())
        events.subscribe(self.on_event)

    def _fields(self) -> dict:
        s = self._state
        ck = " ".join(f"{t}:{n}" for t, n in sorted(s["ckpt"].items())) or "-"
        loss = f"{s['loss']:.4f}" if isinstance(s["loss"], (int, float)) else "-"
        world = s["world"] or "-"
        if s["world"] and s["wanted"] and s["world"] != s["wanted"]:
            world = f"{s['world']}/{s['wanted']}"   # elastic: smaller than asked for
        return {"status": s["status"], "loss": loss, "ckpt": ck, "failures": s["failures"], "world": world}

    def on_event(self, rec: dict) -> None:
        s, ev = self._state, rec["event"]
        completed = None
        if ev == "start":
            s["wanted"] = rec.get("world_size")
            s["logs"] = rec.get("logs")
        elif ev == "cluster":
            self._say(rec.get("message", ""))
        if ev in ("step", "metrics"):
            if "loss" in rec:
                s["loss"] = rec["loss"]
            if ev == "step":
                completed = rec["step"]
                s["status"] = "running"
        elif ev == "checkpoint_committed":
            s["ckpt"][rec["tier"]] = rec["step"]
        elif ev == "failure":
            s["failures"] += 1
            s["status"] = f"{rec.get('kind', 'failure')}!"
            where = f"rank {rec['rank']}" if rec.get("rank") is not None else f"node {rec.get('node')}"
            self._unreported.append(f"{rec.get('kind', 'failure')} of {where} at step {rec.get('step')}"
                                    f"{' (injected)' if rec.get('injected') else ''}")
        elif ev == "restarted":
            s["world"] = rec.get("world_size")
            s["status"] = "restored" if s["failures"] else "running"
        elif ev == "restored":
            completed = rec["step"]
            if "detect_s" in rec:
                what, self._unreported = ", then ".join(self._unreported), []
                self._say(f"{what + ': ' if what else ''}resumed from step {rec['step']} ({rec.get('tier')})")
        elif ev == "end":
            completed = rec["step"]
            s["status"] = "done" if "error" not in rec else "failed"
            if s["logs"] and (s["failures"] or "error" in rec):
                self._say(f"{s['failures']} failure(s); details in the rank logs: {s['logs']}")
        if self._progress is not None:
            kw = {"completed": completed} if completed is not None else {}
            self._progress.update(self._task, **kw, **self._fields())

    def _say(self, text: str) -> None:
        """A line above the bar (only when the bar is shown)."""
        if self._progress is not None:
            self._console.print(f"[bold]cfdist[/]: {text}", soft_wrap=True)   # a path stays whole

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
