"""Event logs written the way the driver writes them, for the chaos unit tests (not a test module)."""

from __future__ import annotations


class Log:
    """Writes a run: steps of ``ti`` seconds, a commit ``lat`` after every ``k``-th step; a
    checkpointed step's own gap takes ``snap_s`` longer (``ckpt.step()`` takes the snapshot
    before the step is recorded)."""

    def __init__(self, *, ti=0.1, k=5, lat=0.05, kval=None, snap_s=0.0):
        self.t, self.step, self.ti, self.k, self.lat, self.kval = 0.0, 0, ti, k, lat, kval
        self.snap_s = snap_s
        self.recs = [{"t": 0.0, "event": "start", "world_size": 2}]
        self.committed = 0

    def at(self, dt, event, **kw):
        self.t += dt
        self.recs.append({"t": round(self.t, 6), "event": event, **kw})

    def run(self, n, *, extra_s=0.0):
        for _ in range(n):
            self.step += 1
            self.at(self.ti + (extra_s if self.step % self.k == 1 and self.step > 1 else 0.0)
                    + (self.snap_s if self.step % self.k == 0 else 0.0), "step",
                    step=self.step, **({"k": self.kval} if self.kval is not None else {}))
            if self.step % self.k == 0:
                self.recs.append({"t": round(self.t + self.lat, 6), "event": "checkpoint_committed",
                                  "step": self.step, "tier": "memory"})
                self.committed = self.step
        self.recs.sort(key=lambda r: r["t"])
        return self

    def fail(self, kind="crash", *, detect=0.1, restart=2.0, restore=1.0):
        self.at(0.01, "failure", kind=kind, step=self.step)
        self.at(detect, "detected")
        self.at(restart, "restarted")
        self.at(restore, "restored", step=self.committed, tier="memory")
        self.step = self.committed
        return self


def started(log_=None, setup=1.0, **kw):
    log_ = log_ or Log(**kw)
    log_.at(0.5, "restarted")   # the first group runs: the injector's time 0
    log_.t += setup - log_.ti   # building the model before step 1
    return log_
