"""``cfdist bench``: run the benchmark suite, or re-render a report, or the docs' summary table.

::

    cfdist bench                          # default suite (~10-15 min on 2 idle cores) -> cfdist-runs/bench/
    cfdist bench --quick                  # every method once, tiny model (a smoke test)
    cfdist bench --full --big --recovery  # 5 rounds, 1-2 GB states, recovery per tier (Ray)
    cfdist bench --render DIR             # report.md + PNGs again from DIR/results.json
    cfdist bench --docs                   # docs/benchmarks.md's table from docs/bench/results.json
"""

from __future__ import annotations

import json
import os


def register(sub) -> None:
    p = sub.add_parser("bench", help="checkpoint benchmarks against torch.save and DCP (results.json, "
                                     "report.md, plots)", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="mode", const="quick",
                   help="every method once on a tiny MLP (a smoke test, well under a minute)")
    g.add_argument("--full", action="store_const", dest="mode", const="full",
                   help="5 interleaved rounds everywhere (~2.5x the default's time)")
    p.set_defaults(mode="default")
    p.add_argument("--big", action="store_true", help="also 1 GB and 2 GB states (needs RAM)")
    p.add_argument("--recovery", action="store_true",
                   help="also recovery time per tier (bench/bench_recovery.py: a local Ray cluster)")
    p.add_argument("--k", type=int, default=5, help="checkpoint every K steps (default 5)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--out", default=os.path.join("cfdist-runs", "bench"),
                   help="where results.json, report.md and the PNGs go (default cfdist-runs/bench)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no further block after this many minutes (skipped blocks are listed)")
    p.add_argument("--only", default=None, metavar="BLOCKS",
                   help="run only these blocks of the mode, comma-separated (main, workload, budget, auto, size, "
                        "ranks); the disk and memory references and the restores always run")
    p.add_argument("--note", default=None, help="a line for the report, e.g. 'machine shared with other jobs'")
    p.add_argument("--render", metavar="DIR", default=None, help="only re-render DIR/results.json")
    p.add_argument("--docs", "--readme", dest="readme", action="store_true",
                   help="only rewrite the benchmark section of --docs-file from --source's results.json")
    p.add_argument("--source", default=os.path.join("docs", "bench"),
                   help="committed report directory the table comes from (default docs/bench)")
    p.add_argument("--docs-file", "--readme-file", dest="readme_file", default=os.path.join("docs", "benchmarks.md"),
                   help="the Markdown page with the cfdist-bench markers (default docs/benchmarks.md)")
    p.set_defaults(run=main)


def write_report(results: dict, out: str) -> str:
    """results.json, report.md and the PNGs into ``out``; returns the report's path."""
    from cfdist.benchmarks import report

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    a = report.analyze(results)
    report.plots(a, out)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(report.markdown(results, a))
    return path


def update_readme(source: str, readme_file: str) -> None:
    from cfdist.benchmarks import report

    with open(os.path.join(source, "results.json")) as f:
        results = json.load(f)
    with open(readme_file) as f:
        text = f.read()
    section = report.readme_section(results, report_path=report.relative_report_path(source, readme_file))
    new = report.rewrite_readme(text, section)
    with open(readme_file, "w") as f:
        f.write(new)


def command_args(a) -> list[str]:
    """The ``cfdist bench`` arguments that reproduce this run (from the parsed options)."""
    out = {"quick": ["--quick"], "full": ["--full"]}.get(a.mode, [])
    out += ["--big"] * a.big + ["--recovery"] * a.recovery
    out += (["--k", str(a.k)] if a.k != 5 else []) + (["--dir", a.dir] if a.dir else [])
    out += ["--max-minutes", f"{a.max_minutes:g}"] if a.max_minutes else []
    out += ["--only", a.only] if a.only else []
    return out + ["--out", a.out] + (["--note", a.note] if a.note else [])


def main(a) -> int:
    from cfdist.benchmarks import suite

    if a.readme:
        update_readme(a.source, a.readme_file)
        print(f"rewrote the benchmark section of {a.readme_file} from {a.source}/results.json")
        return 0
    if a.render:
        with open(os.path.join(a.render, "results.json")) as f:
            results = json.load(f)
        print(f"wrote {write_report(results, a.render)}")
        return 0
    cfg = suite.SuiteConfig(mode=a.mode, big=a.big, recovery=a.recovery, dir=a.dir, k=a.k,
                            max_minutes=a.max_minutes,
                            only=tuple(x.strip() for x in a.only.split(",") if x.strip()) if a.only else None)
    results = suite.run(cfg, argv=command_args(a), log=lambda s: print(s, flush=True))
    if a.note:
        results["note"] = a.note
    path = write_report(results, a.out)
    print(f"wrote {path}, results.json and plots in {a.out}")
    from cfdist.benchmarks import report

    for r in report.analyze(results)["targets"]:
        print(f"  {r['target']}: {r['measured']} -> {report._met(r)}")
    return 0
