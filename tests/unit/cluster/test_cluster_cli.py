"""The ``cfdist`` command: ``ls`` and ``inspect`` on a real checkpoint, ``fit`` config parsing,
the subcommand table. No Ray is started here (``cfdist fit`` end to end runs in the launch test)."""

from __future__ import annotations

import json

import pytest
import torch

import cfdist
from cfdist import cli


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    url = f"file://{tmp_path}/run"
    ck = cfdist.Checkpointer({"model": m, "optim": opt, "note": "x"}, url, cfdist.Every(2), keep=2)
    for _ in range(4):
        m(torch.ones(2, 4)).sum().backward()
        ck.step(opt)
    ck.close()
    return url


def test_ls_lists_committed_steps(run_dir, capsys):
    assert cli.main(["ls", run_dir, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["url"].endswith("step-000000004")
    assert cli.main(["ls", run_dir]) == 0
    table = capsys.readouterr().out
    assert "│ 2 " in table and "│ 4 " in table


def test_ls_of_a_run_with_nothing_committed_says_so(tmp_path, capsys):
    m = torch.nn.Linear(2, 2)
    cfdist.Checkpointer({"model": m}, f"file://{tmp_path}/run", cfdist.Every(2)).close()   # no step taken
    assert cli.main(["ls", f"file://{tmp_path}/run"]) == 1
    assert "no committed checkpoint" in capsys.readouterr().out


# ---- what users type: relative paths work, mistakes are one line and exit 2 -------------------------

@pytest.fixture
def typed(run_dir, tmp_path, monkeypatch):
    """The working directory is tmp_path; it holds the run ``run/`` (steps 2, 4), a fit-style
    run ``fitrun/`` whose checkpoints are in ``fitrun/n0`` and ``fitrun/n1``, an empty
    directory ``empty/``, a file ``notes.txt`` and ``bad.yaml``/``list.yaml``/``extra.yaml``."""
    import shutil

    for node in ("n0", "n1"):
        shutil.copytree(tmp_path / "run", tmp_path / "fitrun" / node)
    (tmp_path / "fitrun" / "events.jsonl").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "extra.yaml").write_text("train: t.py:f\nstorage: ck\nnum_nodez: 2\n")
    (tmp_path / "nofile.yaml").write_text("train: missing.py:f\nstorage: ck\n")
    (tmp_path / "badpolicy.yaml").write_text("train: t.py:f\nstorage: ck\npolicy: every:often\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, says", [
    (["ls", "nope/run"], r"/nope/run \(from 'nope/run'\) does not exist: give the directory the run wrote"),
    (["ls", "notes.txt"], r"notes.txt \(from 'notes.txt'\) is a file, not a checkpoint directory"),
    (["ls", "empty"], r"/empty is not a checkpoint directory \(no step-NNNNNNNNN directories in it\); give the"),
    (["ls", "fitrun"], r"/fitrun is not a checkpoint directory .*subdirectories n0, n1: give one of them, e\.g\. .*/fitrun/n0"),
    (["ls", "nosuchfs://bucket/x"], r"unknown scheme 'nosuchfs'"),
    (["ls", "file://run"], r"relative local path: write it with three slashes"),
    (["inspect", "run/step-000000099"], r"step-000000099/MANIFEST.json does not exist: step 99 was never committed "
                                        r"\(`cfdist ls .*/run` lists the committed steps\)"),
    (["inspect", "nope"], r"/nope \(from 'nope'\) does not exist"),
    (["inspect", "fitrun"], r"subdirectories n0, n1"),
    (["inspect", "run", "--diff", "2", "99"], r"step 99 .*(not committed|never committed)"),
    (["inspect", "--diff", "2", "4"], r"step 2 is a number: give the run directory too"),
    (["export", "nope", "--out", "model"], r"/nope \(from 'nope'\) does not exist"),
    (["export", "empty", "--out", "model"], r"/empty is not a checkpoint directory"),
    (["fit", "missing.yaml"], r"config file .*/missing.yaml does not exist"),
    (["fit", "bad.yaml"], r"while parsing"),
    (["fit", "list.yaml"], r"must be a YAML mapping"),
    (["fit", "extra.yaml"], r"unknown key\(s\) 'num_nodez'; the keys are .*num_nodes"),
    (["fit", "nofile.yaml"], r"train file .*/missing.py does not exist"),
    (["fit", "badpolicy.yaml"], r"policy must be auto, every:K"),
    (["fit", "extra.yaml", "--set", "oops"], r"--set 'oops' must be KEY=VALUE"),
])
def test_a_mistake_is_one_line_with_the_fix_and_exit_2(typed, capsys, argv, says):
    import re

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cfdist: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(says, err), err


def test_bad_arguments_exit_2_with_usage(typed, capsys):
    for argv in (["ls"], ["ls", "run", "--bogus"], ["export", "run"], ["nosuchcommand"]):
        with pytest.raises(SystemExit) as ei:
            cli.main(argv)
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "usage: cfdist" in err and "error:" in err and "Traceback" not in err


def test_relative_paths_resolve_against_the_working_directory(typed, capsys):
    assert cli.main(["ls", "run", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["url"] == f"file://{typed}/run/step-000000004"
    assert cli.main(["ls", "fitrun/n1", "--json"]) == 0 and capsys.readouterr().out
    assert cli.main(["inspect", "run/step-000000002", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert cli.main(["inspect", "run", "--diff", "2", "run/step-000000004", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_b"] == 4
    assert cli.main(["export", "run", "--out", "exported", "--format", "torch"]) == 0
    assert (typed / "exported" / "model.pt").is_file()
    assert not (typed / "nope").exists()   # nothing was created by the failed commands


def test_the_cfdist_command_itself_takes_the_path_the_demo_printed(typed):
    """A real process: ``cfdist ls cfdist-runs/demo`` from the directory the demo ran in lists
    the steps (on the main branch before the fix: a traceback, "is a relative path")."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(typed / "run", typed / "cfdist-runs" / "demo")
    cmd = [sys.executable, "-c", "import sys; from cfdist.cli import main; sys.exit(main())"]
    ok = subprocess.run(cmd + ["ls", "cfdist-runs/demo", "--json"], cwd=typed, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert [json.loads(line)["step"] for line in ok.stdout.splitlines()] == [2, 4]
