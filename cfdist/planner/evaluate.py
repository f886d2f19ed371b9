"""``cfdist.plan(...)``: evaluate candidate plans over many failure schedules, cheapest first.

Call it on the driver or a laptop: it is pure computation (no Ray, no clock), seconds for a few
hundred candidates x seeds. The cost model and its assumptions are in :mod:`cfdist.planner.model`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cfdist.chaos.simulator import step_time
from cfdist.planner.failures import RateFailures, TraceFailures
from cfdist.planner.job import Job
from cfdist.planner.model import Candidate, Outcome, candidate_costs, run_once
from cfdist.planner.prices import Prices, load_prices

DEFAULT_EVERY = (100, 500, 2000)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value with at least 90% of them at or below it."""
    xs = sorted(values)
    return xs[max(0, math.ceil(0.9 * len(xs)) - 1)]


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One candidate, summarised over the seeds (the ``--json`` object)."""

    candidate: Candidate
    """The settings."""
    outcomes: tuple[Outcome, ...]
    """One per seed (one for on-demand: nothing random happens)."""
    k: int
    """The checkpoint interval the policy chose."""
    k_reason: str
    """Why that k."""
    deadline_h: float | None = None
    """The deadline the plan was asked for."""

    @property
    def name(self) -> str:
        """The candidate's label."""
        return self.candidate.name

    def _mean(self, attr: str) -> float:
        return statistics.fmean(getattr(o, attr) for o in self.outcomes)

    @property
    def hours(self) -> float:
        """Mean hours to finish."""
        return self._mean("hours")

    @property
    def dollars(self) -> float:
        """Mean dollars."""
        return self._mean("dollars")

    @property
    def goodput(self) -> float:
        """Mean goodput."""
        return self._mean("goodput")

    @property
    def lost_hours(self) -> float:
        """Mean hours of redone training."""
        return self._mean("lost_hours")

    @property
    def p90_hours(self) -> float:
        """90th percentile of the hours over the seeds."""
        return p90([o.hours for o in self.outcomes])

    @property
    def p90_dollars(self) -> float:
        """90th percentile of the dollars over the seeds."""
        return p90([o.dollars for o in self.outcomes])

    @property
    def deadline_met(self) -> float | None:
        """Fraction of seeds that finished by the deadline (None without one)."""
        if self.deadline_h is None:
            return None
        return sum(o.hours <= self.deadline_h + 1e-9 for o in self.outcomes) / len(self.outcomes)

    def settings(self) -> dict:
        """The settings as ``cfdist fit`` and the planner name them."""
        c = self.candidate
        policy = ({"auto": {"mtbf_s": round(self.mtbf_s)}} if c.policy == "auto-mtbf" and math.isfinite(self.mtbf_s)
                  else "auto" if c.policy.startswith("auto") else c.policy)
        tiers = {"local_tier": c.tiers == "local", "shared_every": c.shared_every if c.tiers == "local" else 1,
                 "peer_copy": c.recovery == "peer"}
        return {"num_nodes": c.nodes, "workers_per_node": self.ranks_per_node, "policy": policy, "k": self.k,
                "tiers": tiers, "recovery": {"live_recovery": c.live}, "capacity": c.capacity, "codec": c.codec,
                "codec_ratio": c.codec_ratio}

    mtbf_s: float = math.inf
    """The job's MTBF on this many nodes (what ``auto-mtbf`` used)."""
    ranks_per_node: int = 1
    """Ranks per node (``workers_per_node``)."""

    def to_json(self) -> dict:
        """``name``, ``settings``, ``hours``, ``dollars``, ``goodput``, ``p90_hours``, ``p90_dollars``
        and more (``lost_hours``, ``failures``, ``seeds``, ``deadline_met``)."""
        out = {"name": self.name, "settings": self.settings(), "hours": self.hours, "dollars": self.dollars,
               "goodput": self.goodput, "p90_hours": self.p90_hours, "p90_dollars": self.p90_dollars,
               "lost_hours": self.lost_hours, "failures": statistics.fmean(o.failures for o in self.outcomes),
               "seeds": len(self.outcomes), "k_reason": self.k_reason}
        if self.deadline_h is not None:
            out["deadline_met"] = self.deadline_met
        switched = [o.switched_at_h for o in self.outcomes if o.switched_at_h is not None]
        if self.candidate.capacity == "uniform-progress":
            out["switched"] = len(switched) / len(self.outcomes)
        return out


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """All candidates, cheapest (mean dollars) first."""

    rows: tuple[PlanRow, ...]
    """Sorted by dollars, then hours."""
    job: Job
    """The job planned."""
    failures_label: str
    """Where the failures came from."""
    instance: str
    """Instance type priced."""
    currency: str = "USD"
    """Currency of the dollars."""
    deadline_h: float | None = None
    """The deadline, hours (None: none)."""
    skipped: tuple[str, ...] = field(default_factory=tuple)
    """Candidates left out, with the reason."""

    @property
    def best(self) -> PlanRow:
        """The recommendation: the cheapest that meets the deadline on at least 90% of seeds
        (all of them without a deadline)."""
        ok = [r for r in self.rows if r.deadline_met is None or r.deadline_met >= 0.9]
        if not ok:
            raise ValueError("no candidate meets the deadline on 90% of the seeds; relax --deadline-h or add nodes")
        return ok[0]

    def frontier(self) -> list[PlanRow]:
        """Pareto frontier in (hours, dollars): no other row is both faster and cheaper."""
        out, best_h = [], math.inf
        for r in sorted(self.rows, key=lambda r: (r.dollars, r.hours)):
            if r.hours < best_h - 1e-12:
                out.append(r)
                best_h = r.hours
        return out


def grid(job: Job, *, every: Sequence[int] = DEFAULT_EVERY, tiers: Sequence[str] = ("local", "shared"),
         peer_copy: Sequence[bool] = (True, False), live: Sequence[bool] = (True, False),
         codecs: dict[str, float] | None = None, capacities: Sequence[str] = ("spot", "on-demand"),
         shared_every: int = 10) -> list[Candidate]:
    """The candidates: policies x tiers x peer copy x live recovery (with peer copy) x codecs x
    nodes x capacity."""
    policies = [f"every:{k}" for k in every if k <= job.steps] + ["auto", "auto-mtbf"]
    out = []
    for cap in capacities:
        for n in job.nodes:
            for codec, ratio in (codecs or {"none": 1.0}).items():
                for t in tiers:
                    for peer in (peer_copy if t == "local" and n > 1 else (False,)):
                        for lv in (live if peer else (False,)):
                            for p in policies:
                                out.append(Candidate(policy=p, tiers=t, peer_copy=peer, live=lv,
                                                     shared_every=shared_every, codec=codec, codec_ratio=ratio,
                                                     nodes=n, capacity=cap))
    return out


def _progress(done: int, total: int, stream) -> None:
    if stream is not None:
        stream.write(f"\rcfdist plan: {done}/{total} candidates evaluated")
        if done == total:
            stream.write("\n")
        stream.flush()


def plan(job: Job, *, failures: TraceFailures | RateFailures, prices: Prices | str | None = None,
         instance: str | None = None, deadline_h: float | None = None, seeds: int = 8,
         candidates: Sequence[Candidate] | None = None, every: Sequence[int] = DEFAULT_EVERY,
         codecs: dict[str, float] | None = None, progress=None,
         events_for: Callable | None = None) -> PlanResult:
    """Evaluate candidate plans for ``job`` under ``failures``, priced with ``prices``.

    ``candidates``: default :func:`grid` (with ``every`` and ``codecs``), plus the
    uniform-progress candidates when ``deadline_h`` is given. ``seeds``: failure schedules per
    spot candidate (trace windows, or rate seeds). ``progress``: a stream for a one-line
    progress display (``sys.stderr``), None for silence. ``events_for(nodes, horizon_s, seed)``
    overrides the failures' schedule (tests). Raises ValueError for an impossible deadline
    (shorter than the failure-free on-demand run of every candidate).
    """
    if not isinstance(prices, Prices):
        prices = load_prices(prices)
    price = prices.instance(instance)
    if not (isinstance(seeds, int) and seeds >= 1):
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
    if deadline_h is not None and not (math.isfinite(deadline_h) and deadline_h > 0):
        raise ValueError(f"the deadline must be hours > 0, got {deadline_h!r}")
    caps = ("spot", "on-demand") + (("uniform-progress",) if deadline_h is not None else ())
    cands = list(candidates) if candidates is not None else grid(job, every=every, codecs=codecs, capacities=caps)
    limit = failures.max_nodes()
    skipped = [f"{c.name}: the trace never holds {c.nodes} VMs at once (at most {limit})"
               for c in cands if limit is not None and c.nodes > limit and c.capacity != "on-demand"]
    cands = [c for c in cands if not (limit is not None and c.nodes > limit and c.capacity != "on-demand")]
    if not cands:
        raise ValueError(f"no candidate left to evaluate: {'; '.join(skipped) or 'the grid is empty'}")
    get = events_for or failures.events
    deadline_s = None if deadline_h is None else deadline_h * 3600.0
    rows = []
    mtbf = {n: failures.mtbf_s(n) for n in {c.nodes for c in cands}}
    models = [candidate_costs(job, c, mtbf_s=mtbf[c.nodes]) for c in cands]
    if deadline_h is not None:
        fastest = min(step_time(costs=m.costs, k=m.k_sim, t0=0.0, s0=0, step=job.steps) for m in models) / 3600
        if fastest > deadline_h:
            raise ValueError(f"impossible deadline: {deadline_h:g} h is shorter than the fastest failure-free run "
                             f"of any candidate ({fastest:.3g} h); give --deadline-h above that, or more --nodes")
    for i, (c, m) in enumerate(zip(cands, models)):
        runs = 1 if c.capacity == "on-demand" else seeds
        outs = []
        for seed in range(runs):
            try:
                outs.append(run_once(job, c, m, price, prices, lambda h, n=c.nodes, s=seed: get(n, h, s),
                                     deadline_s=deadline_s))
            except ValueError as e:
                skipped.append(f"{c.name}: {e}")
                outs = []
                break
        if outs:
            row = PlanRow(candidate=c, outcomes=tuple(outs), k=m.k, k_reason=m.k_reason, deadline_h=deadline_h,
                          mtbf_s=mtbf[c.nodes], ranks_per_node=job.ranks_per_node)
            rows.append(row)
        _progress(i + 1, len(cands), progress)
    if not rows:
        raise ValueError(f"no candidate could be evaluated: {'; '.join(skipped)}")
    rows.sort(key=lambda r: (r.dollars, r.hours, r.name))
    return PlanResult(rows=tuple(rows), job=job, failures_label=failures.label, instance=price.name,
                      currency=prices.currency, deadline_h=deadline_h, skipped=tuple(skipped))

