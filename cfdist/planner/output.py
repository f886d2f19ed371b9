"""What ``cfdist plan`` prints and writes: the table, the recommendation, JSON, the PNG."""

from __future__ import annotations

import json

from cfdist.planner.evaluate import PlanResult, PlanRow


def table(result: PlanResult, *, limit: int | None = 20) -> str:
    """Plain-text table, cheapest first (``limit`` rows; None: all)."""
    cur = result.currency
    head = ["#", "candidate", "k", "hours", "p90 h", cur, f"p90 {cur}", "goodput", "lost h", "fails"]
    if result.deadline_h is not None:
        head.append("on time")
    frontier = {id(r) for r in result.frontier()}
    lines = []
    for i, r in enumerate(result.rows[:limit] if limit else result.rows, 1):
        row = [f"{i}{'*' if id(r) in frontier else ''}", r.name, str(r.k), f"{r.hours:.2f}", f"{r.p90_hours:.2f}",
               f"{r.dollars:,.2f}", f"{r.p90_dollars:,.2f}", f"{r.goodput:.3f}", f"{r.lost_hours:.2f}",
               f"{sum(o.failures for o in r.outcomes) / len(r.outcomes):.1f}"]
        if result.deadline_h is not None:
            row.append(f"{r.deadline_met:.0%}")
        lines.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
    more = len(result.rows) - len(lines)
    if more > 0:
        out.append(f"... {more} more (--all shows them, --json gives every one)")
    out.append("* on the hours/dollars frontier (no other candidate is both faster and cheaper)")
    return "\n".join(out)


def summary(result: PlanResult) -> str:
    """A few lines: the job, the failures, the recommendation and what it saves."""
    j, best = result.job, result.best
    lines = [f"job: {j.steps} steps of {j.iter_s:g} s on {j.ref_nodes} node(s), {j.state_bytes / 1e9:.3g} GB per "
             f"checkpoint; failures: {result.failures_label}; prices: {result.instance}"
             + (f"; deadline {result.deadline_h:g} h" if result.deadline_h is not None else ""),
             f"recommended (row {result.rows.index(best) + 1}): {best.name}: {best.hours:.2f} h "
             f"(p90 {best.p90_hours:.2f}), {best.dollars:,.2f} {result.currency} (p90 {best.p90_dollars:,.2f}), "
             f"goodput {best.goodput:.3f}"]
    c = best.candidate
    same = [r for r in result.rows if r.candidate.capacity == "on-demand" and
            (r.candidate.policy, r.candidate.tiers, r.candidate.recovery, r.candidate.codec, r.candidate.nodes) ==
            (c.policy, c.tiers, c.recovery, c.codec, c.nodes)]
    if same and same[0] is not best and same[0].dollars > 0:
        od = same[0]
        lines.append(f"the same settings on on-demand nodes: {od.hours:.2f} h, {od.dollars:,.2f} {result.currency}; "
                     f"the recommendation costs {1 - best.dollars / od.dollars:.0%} less and takes "
                     f"{best.hours - od.hours:+.2f} h")
    if result.skipped:
        lines.append(f"skipped {len(result.skipped)}: " + "; ".join(result.skipped[:3])
                     + (" ..." if len(result.skipped) > 3 else ""))
    return "\n".join(lines)


def python_snippet(row: PlanRow) -> str:
    """The recommendation as ``cfdist.fit`` arguments."""
    s = row.settings()
    policy = s["policy"]
    if isinstance(policy, dict):
        pol = f"cfdist.Auto(mtbf_s={policy['auto']['mtbf_s']})"
    elif policy == "auto":
        pol = "cfdist.Auto()"
    else:
        pol = f"cfdist.Every({int(policy[6:])})"
    t = s["tiers"]
    codec = ("" if s["codec"] == "none" else
             f"\n# codec {s['codec']!r} (ratio {s['codec_ratio']:g}): pass codecs=[...] to ctx.checkpointer() "
             f"in train_loop")
    return (f"# {row.name}: run on {s['capacity']} nodes{codec}\n"
            f"cfdist.fit(train_loop, storage=..., shared_storage=...,\n"
            f"           num_nodes={s['num_nodes']}, workers_per_node={s['workers_per_node']}, policy={pol},\n"
            f"           tiers=cfdist.TierOptions(local_tier={t['local_tier']}, shared_every={t['shared_every']}, "
            f"peer_copy={t['peer_copy']}),\n"
            f"           recovery=cfdist.RecoveryOptions(live_recovery={s['recovery']['live_recovery']}))")


def fit_yaml(row: PlanRow) -> str:
    """The recommendation as keys of a ``cfdist fit`` YAML file (only keys that exist there)."""
    s = row.settings()
    policy = s["policy"]
    pol = f"{{auto: {{mtbf_s: {policy['auto']['mtbf_s']}}}}}" if isinstance(policy, dict) else policy
    t = s["tiers"]
    lines = [f"# {row.name}: run on {s['capacity']} nodes (choose them when you launch the cluster)"]
    if s["codec"] != "none":
        lines.append(f"# codec {s['codec']!r}: pass codecs=[...] to ctx.checkpointer() in the training function")
    lines += [f"num_nodes: {s['num_nodes']}", f"workers_per_node: {s['workers_per_node']}", f"policy: {pol}",
              f"tiers: {{local_tier: {str(t['local_tier']).lower()}, shared_every: {t['shared_every']}, "
              f"peer_copy: {str(t['peer_copy']).lower()}}}",
              f"recovery: {{live_recovery: {str(s['recovery']['live_recovery']).lower()}}}"]
    return "\n".join(lines) + "\n"


def to_json(result: PlanResult) -> str:
    """One object per candidate, cheapest first (a JSON list)."""
    return json.dumps([r.to_json() for r in result.rows], indent=1)


def plot(result: PlanResult, path: str) -> str:
    """PNG of dollars vs hours, one dot per candidate, the frontier joined and the recommendation
    circled; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"spot": "tab:blue", "on-demand": "tab:orange", "uniform-progress": "tab:green"}
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for cap, color in colors.items():
        rows = [r for r in result.rows if r.candidate.capacity == cap]
        if rows:
            ax.scatter([r.hours for r in rows], [r.dollars for r in rows], s=14, color=color, alpha=0.7, label=cap)
    front = sorted(result.frontier(), key=lambda r: r.hours)
    ax.plot([r.hours for r in front], [r.dollars for r in front], color="black", lw=1.2, label="frontier")
    best = result.best
    ax.scatter([best.hours], [best.dollars], s=120, facecolors="none", edgecolors="red", lw=1.5,
               label=f"recommended: {best.name}")
    if result.deadline_h is not None:
        ax.axvline(result.deadline_h, color="grey", ls="--", lw=1, label="deadline")
    ax.set_xlabel("hours to finish (mean over seeds)")
    ax.set_ylabel(f"{result.currency} (compute + storage + egress)")
    ax.set_title(f"cfdist plan: {result.failures_label}, {result.instance}", fontsize=10)
    if all(r.dollars > 0 for r in result.rows) and max(r.dollars for r in result.rows) > 20 * min(
            r.dollars for r in result.rows):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
