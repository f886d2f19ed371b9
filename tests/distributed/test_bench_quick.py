"""``cfdist bench --quick`` end to end: real gloo ranks train a tiny MLP under every method
(torch.save, DCP save / async / no_dist, cfdist thread / process / striped / under a host-memory
budget), the disk and memory
references and cold restores run for real; the point is the results schema and that every
method produced numbers. No timing is asserted."""

from __future__ import annotations

import json
import os

from cfdist.benchmarks.methods import CORE
from cfdist.cli import main


def test_bench_quick_writes_results_report_and_plots_for_every_method(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "--quick", "--out", str(out), "--dir", str(tmp_path / "ckpt")]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == 1 and res["config"]["mode"] == "quick"
    assert res["command"].startswith("cfdist bench")
    for key in ("cpu_count", "memory_gb", "python", "torch", "ray"):
        assert res["machine"][key], key
    assert res["filesystem"]["type"]
    block, budget = res["blocks"]
    assert budget["block"]["name"] == "budget"
    brun = {r["method"]: r for r in budget["runs"]}["cfdist.budget25"]   # streamed through a quarter
    assert brun["checkpoints"] == 2 and brun["stats"]["checkpoints"] >= 2 and not brun["stats"]["errors"], brun
    state = next(r["state_bytes"] for r in budget["runs"] if "state_bytes" in r)
    assert 0 < brun["stats"]["arena_bytes"] <= 0.25 * state, brun["stats"]
    runs = {r["method"]: r for r in block["runs"]}
    assert sorted(runs) == sorted(CORE)
    for m, r in runs.items():
        assert r["checkpoints"] == 2 and len(r["phases"]) == 4 and all(p > 0 for p in r["phases"]), m
        assert r["wall_s"] > 0 and r["cpu_s"] > 0, m
        # the checkpoint's share: the process's CPU but the training thread's forward/backward
        assert 0 < r["cpu_phase_s"] < r["cpu_s"], (m, r["cpu_phase_s"], r["cpu_s"])
        assert not (r["stats"] or {}).get("errors"), (m, r["stats"])
    for m in ("cfdist", "cfdist.process", "cfdist.roots2", "cfdist.roots4"):
        assert runs[m]["stats"]["checkpoints"] >= 2 and runs[m]["stats"]["bytes"] > 0, m
    for k in ("raw", "memcpy", "xxh3", "snapshot", "persist"):
        assert res["micro"][k] and all(x["s"] > 0 for x in res["micro"][k]), k
    for k in ("torch.load", "dcp.load", "cfdist"):
        assert res["restore"][k][0]["s"] > 0, k
    report = (out / "report.md").read_text()
    for m in CORE:
        row = next(ln for ln in report.splitlines() if ln.startswith(f"| {m} |") or ln.startswith(f"| **{m}** |")
                   or ln.startswith("| none (baseline)") and m == "none")
        assert " ms" in row, row
    row = next(ln for ln in report.splitlines() if ln.startswith("| 25% |"))   # the budget table
    assert " ms" in row, row
    for png in ("stall.png", "overhead.png", "growth.png", "budget.png"):
        assert os.path.getsize(out / png) > 1000, png
    assert os.listdir(tmp_path / "ckpt") == []        # every checkpoint directory was cleaned up
