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


def test_ls_of_an_empty_storage_says_so(tmp_path, capsys):
    assert cli.main(["ls", f"file://{tmp_path}/none"]) == 1
    assert "no committed checkpoint" in capsys.readouterr().out


def test_inspect_a_step_or_the_newest_and_verify(run_dir, capsys):
    assert cli.main(["inspect", f"{run_dir}/step-000000002", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["step"] == 2 and s["state"]["model"] == {"tensors": 2, "bytes": (12 + 3) * 4}
    assert cli.main(["inspect", run_dir, "--verify", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["step"] == 4 and s["verified"] is True


def test_inspect_reports_a_corrupted_shard(run_dir, tmp_path, capsys):
    import glob

    shard = glob.glob(f"{tmp_path}/run/step-000000004/shard-*.safetensors")[0]
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    assert cli.main(["inspect", f"{run_dir}/step-000000004", "--verify"]) == 2
    assert "checksum" in capsys.readouterr().err


def test_split_checkpoint_url():
    assert cli.split_checkpoint_url("s3://b/run/step-000000120/") == ("s3://b/run", 120)
    assert cli.split_checkpoint_url("file:///x/run") == ("file:///x/run", None)


@pytest.mark.parametrize("value, kind, k", [
    ("every:7", cfdist.Every, 7), ({"every": 3}, cfdist.Every, 3), ("auto", cfdist.Auto, None),
    (None, cfdist.Auto, None), ("epoch", cfdist.EveryEpoch, None),
])
def test_parse_policy(value, kind, k):
    p = cli.parse_policy(value)
    assert isinstance(p, kind) and (k is None or p.k == k)


def test_parse_policy_and_preemption_errors():
    with pytest.raises(ValueError, match="every:K"):
        cli.parse_policy("sometimes")
    with pytest.raises(ValueError, match="fixed_interval"):
        cli.parse_preemption({"hourly": {}})
    s = cli.parse_preemption({"fixed_interval": {"every_s": 60, "kind": "crash"}})
    assert [e.time_s for e in s.events(2, 200)] == [60, 120, 180]


def test_load_train_fn_from_a_file_ships_it_by_value(tmp_path):
    f = tmp_path / "mytrain.py"
    f.write_text("def loop(ctx, steps=1):\n    return steps * 2\n")
    fn = cli.load_train_fn(f"{f}:loop")
    assert fn(None, steps=3) == 6
    with pytest.raises(AttributeError, match="no function 'nope'"):
        cli.load_train_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="file.py:function"):
        cli.load_train_fn("justaname")
    import sys

    import ray.cloudpickle

    blob = ray.cloudpickle.dumps(fn)
    del sys.modules["mytrain"]
    f.unlink()                       # a worker without the file still gets the function
    assert ray.cloudpickle.loads(blob)(None, steps=2) == 4


def test_fit_needs_train_and_storage(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_nodes: 1\n")
    assert cli.main(["fit", str(cfg)]) == 2
    assert "needs at least 'train' and 'storage'" in capsys.readouterr().err


def test_unknown_arguments_are_refused_except_for_demo():
    with pytest.raises(SystemExit):
        cli.main(["ls", "file:///x", "--bogus"])
    names = set(cli.SUBCOMMANDS)
    assert {"fit", "ls", "inspect", "demo"} <= names
