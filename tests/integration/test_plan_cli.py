"""``cfdist plan`` end to end on a bundled trace, through ``cfdist.cli.main``.

Real: the argument parsing, the bundled Bamboo p3 trace, the shipped example prices, the
simulator, the files written (plan.json, plan.png, fit.yaml). Nothing is faked; no Ray. The
point: the JSON has one object per candidate with the public keys, cheapest first, and the
recommendation is a valid ``cfdist fit`` configuration. Bad input is one line and exit 2.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from cfdist.cli import fit_groups, main, parse_policy

ARGS = ["plan", "--iter-s", "0.5", "--steps", "20000", "--state-gb", "10", "--nodes", "2", "4", "--ref-nodes", "4",
        "--persist-s", "10", "--restore-s", "8", "--stall-s", "0.1", "--trace", "bamboo-p3-trace.csv",
        "--notice-s", "120", "--instance", "gpu-8x-a100", "--seeds", "4", "--every", "200", "2000"]


def test_plan_on_a_bundled_trace(tmp_path, capsys):
    t0 = time.monotonic()
    assert main([*ARGS, "--deadline-h", "6", "--json", "--out", str(tmp_path)]) == 0
    took = time.monotonic() - t0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 10
    for r in rows:
        assert {"name", "settings", "hours", "dollars", "goodput", "p90_hours", "p90_dollars"} <= set(r)
        assert r["p90_hours"] >= r["hours"] * 0.999 and 0 < r["goodput"] <= 1
    assert [r["dollars"] for r in rows] == sorted(r["dollars"] for r in rows)
    caps = {r["settings"]["capacity"] for r in rows}
    assert caps == {"spot", "on-demand", "uniform-progress"}
    # spot is cheaper than on-demand for the same settings on this trace
    by_name = {r["name"]: r for r in rows}
    assert by_name["spot n=4 auto local+peer"]["dollars"] < by_name["on-demand n=4 auto local+peer"]["dollars"]
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "plan.json").read_text()) == rows
    fit = yaml.safe_load((tmp_path / "fit.yaml").read_text())
    parse_policy(fit["policy"])
    fit_groups(fit, "fit.yaml")           # only keys cfdist fit knows
    assert fit["num_nodes"] in (2, 4)
    assert took < 60.0, f"cfdist plan took {took:.0f} s (a runaway horizon?)"


def test_plan_table_and_recommendation(tmp_path, capsys):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["#", "candidate", "k"]
    assert "recommended (row " in out and "cfdist.fit(train_loop" in out and "tiers: {local_tier:" in out


@pytest.mark.parametrize("extra,match", [
    (["--prices", "no-such-prices.yaml"], "--prices no-such-prices.yaml: no such file"),
    (["--trace", "no-such-trace.csv"], "no trace 'no-such-trace.csv'"),
    (["--deadline-h", "0.5"], "impossible deadline"),
    (["--instance", "tpu-v9"], "no instance type 'tpu-v9'"),
    (["--bad-yaml"], "is not valid YAML"),
    (["--codec", "zstd=2"], "--codec 'zstd=2'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, match):
    args = [*ARGS, "--out", str(tmp_path)]
    if extra == ["--bad-yaml"]:
        bad = tmp_path / "prices.yaml"
        bad.write_text("instances: {a: [\n")
        extra = ["--prices", str(bad)]
    if extra[0] == "--trace":
        args[args.index("--trace") + 1] = extra[1]
        extra = []
    if extra[0:1] == ["--instance"]:
        args[args.index("--instance") + 1] = extra[1]
        extra = []
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("cfdist: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert match in lines[0]
