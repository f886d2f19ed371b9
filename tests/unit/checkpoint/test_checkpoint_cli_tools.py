"""``cfdist inspect --diff`` and ``cfdist export`` on real checkpoints written by a Checkpointer.

Real files on local disk; the exported files are read back with safetensors / ``torch.load``
(``weights_only=True``), and once in a child process where ``import cfdist`` is impossible.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import cfdist
from cfdist import cli
from cfdist.checkpoint.compare import diff_checkpoints, export_tensors


class Wrapped(torch.nn.Module):
    """Names its child ``module`` like DDP does, so state_dict keys start with ``module.``."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    def forward(self, x):
        return self.module(x)


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    m = Wrapped()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    url = f"file://{tmp_path}/run"
    ck = cfdist.Checkpointer({"model": m, "optim": opt, "sched": sched}, url, cfdist.Every(2), keep=3)
    for _ in range(4):
        m(torch.randn(5, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
        sched.step()
    ck.close()
    return url, m


def test_diff_names_the_tensors_and_values_that_changed(run, capsys):
    url, m = run
    assert cli.main(["inspect", url, "--diff", "2", f"{url}/step-000000004", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["step_a"], d["step_b"]) == (2, 4)
    changed = {c["name"]: c for c in d["tensors"]["changed"]}
    w = changed["model.module.0.weight"]
    a, b = cfdist.load(url, 2)["state"]["model"], cfdist.load(url, 4)["state"]["model"]
    want = (a["module.0.weight"] - b["module.0.weight"]).abs().max().item()
    assert w["shape"] == [3, 4] and w["dtype"] == "torch.float32" and w["max_abs_diff"] == pytest.approx(want)
    assert "model.module.1.num_batches_tracked" in changed            # a counter buffer
    assert d["tensors"]["only_a"] == d["tensors"]["only_b"] == []
    values = {v["path"]: (v["a"], v["b"]) for v in d["values"]}
    assert values["sched.last_epoch"] == (2, 4)
    assert values["sched._last_lr.0"] == (0.025, 0.00625)
    # the same step against itself: nothing differs
    assert cli.main(["inspect", "--diff", f"{url}/step-000000004", f"{url}/step-000000004", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["tensors"]["changed"] == [] and same["values"] == [] and same["tensors"]["equal"] > 4
    assert cli.main(["inspect", url, "--diff", "2", "4"]) == 0        # the table renders
    text = capsys.readouterr().out
    assert "tensors that differ" in text and "sched.last_epoch" in text


def test_diff_reports_shape_changes_and_missing_tensors():
    a = {"step": 1, "state": {"m": {"w": torch.zeros(2), "b": torch.ones(1)}, "k": 1}, "rng": {}}
    b = {"step": 2, "state": {"m": {"w": torch.zeros(3), "c": torch.ones(1)}, "k": 1}, "rng": {}}
    d = diff_checkpoints(a, b)
    assert d["tensors"]["changed"] == [{"name": "m.w", "shape_a": [2], "shape_b": [3],
                                        "dtype_a": "torch.float32", "dtype_b": "torch.float32"}]
    assert d["tensors"]["only_a"] == ["m.b"] and d["tensors"]["only_b"] == ["m.c"] and d["values"] == []


def test_diff_errors_name_the_problem(run, capsys):
    url, _ = run
    assert cli.main(["inspect", "--diff", "2", "4"]) == 2
    assert "give the run directory" in capsys.readouterr().err
    assert cli.main(["inspect", url, "--diff", "2", "3"]) == 2
    assert "step 3 is not committed" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_is_readable_without_cfdist(run, tmp_path, fmt, capsys):
    url, m = run
    out = tmp_path / f"export-{fmt}"
    assert cli.main(["export", url, "--format", fmt, "--out", str(out), "--strip-prefix"]) == 0
    assert "step 4" in capsys.readouterr().out
    want = {k[len("module."):]: v for k, v in m.state_dict().items()}
    if fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        got = load_file(out / "model.safetensors")
        with safe_open(out / "model.safetensors", "pt") as f:
            assert f.metadata()["format"] == "pt" and f.metadata()["cfdist_step"] == "4"
        # A plain PyTorch user (cfdist not importable) loads it straight into the bare model.
        code = (
            "import sys; sys.modules['cfdist'] = None\n"
            "import torch; from safetensors.torch import load_file\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))\n"
            f"m.load_state_dict(load_file({str(out / 'model.safetensors')!r}), strict=True)\n"
            "print(round(float(m[0].weight.sum()), 6))\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert float(r.stdout) == pytest.approx(round(float(want["0.weight"].sum()), 6))
    else:
        got = torch.load(out / "model.pt", weights_only=True)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_export_another_entry_and_errors(run, tmp_path, capsys):
    url, _ = run
    loaded = cfdist.load(url)
    key, ts = export_tensors(loaded, "optim")
    assert key == "optim" and any(n.endswith("momentum_buffer") for n in ts)
    key, ts = export_tensors(loaded, None)
    assert key == "model" and "module.0.weight" in ts                  # no stripping by default
    assert cli.main(["export", url, "--key", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "no entry 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert cli.main(["export", url, "--key", "sched", "--out", str(tmp_path / "y")]) == 2
    assert "holds no tensors" in capsys.readouterr().err
    assert cli.main(["export", f"file://{tmp_path}/empty", "--out", str(tmp_path / "z")]) == 2
    assert f"{tmp_path}/empty does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", f"file://{tmp_path}/empty", "--out", str(tmp_path / "z")]) == 2
    assert f"{tmp_path}/empty is not a checkpoint directory" in capsys.readouterr().err
