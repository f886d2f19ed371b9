"""Ray's reports of the kills cfdist causes itself are dropped; every other report still prints."""

from __future__ import annotations

from cfdist.cluster import quiet

DIED = ("A worker died or was killed while executing a task by an unexpected system error. Worker PID: {pid} "
        "Worker exit type: SYSTEM_ERROR")


def _rec(pid, source="raylet"):
    return {"lines": [DIED.format(pid=pid)], "pid": source, "is_err": False}


def test_only_raylet_reports_of_registered_pids_are_expected():
    quiet.expect_death(424242)
    assert quiet.is_expected(_rec(424242))
    assert not quiet.is_expected(_rec(424243))                  # a death cfdist did not cause
    assert not quiet.is_expected(_rec(424242, source=1234))     # a worker's own output
    assert not quiet.is_expected({"pid": "raylet", "lines": ["node n1 has been marked dead"]})


def test_a_simulated_node_cfdist_took_is_not_reported_as_dead():
    quiet.expect_node_death("ab12")
    msg = "The node with node id: {} and address: 192.0.2.2 has been marked dead because the detector has missed"
    assert quiet.is_expected({"pid": "raylet", "lines": [msg.format("ab12")]})
    assert not quiet.is_expected({"pid": "raylet", "lines": [msg.format("cd34")]})


def test_rays_driver_printer_drops_expected_reports_and_prints_the_rest(capsys):
    from ray._private import worker as ray_worker

    quiet.expect_death(515151)
    ray_worker.print_to_stdstream(_rec(515151), ignore_prefix=False)
    ray_worker.print_to_stdstream(_rec(515152), ignore_prefix=False)
    out = capsys.readouterr().out
    assert "Worker PID: 515152" in out and "Worker PID: 515151" not in out
