"""``RayWorkerGroup._settle``: after a first error, the other ranks' outcomes are waited for,
except those of a node whose raylet is gone (Ray reports such ranks dead only after its health
checks, seconds later). The nodes are probed at once, then again at growing intervals. Nor for
Ray's report of a rank whose process the driver sees exit in ``/proc`` (same namespace).

Ray and the clock are faked here (``ray.wait``/``ray.get`` and ``time.monotonic`` of the group's
module): the waits the group asks for are recorded and the clock moves by them, so the probe
schedule is checked exactly, without timing anything. The real path (a fake node killed under a
running group) runs in ``tests/integration/cluster/test_cluster_fit.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cfdist.cluster import worker_group
from cfdist.cluster.config import FitConfig
from cfdist.cluster.nodes import NodeInfo
from cfdist.cluster.worker_group import _EXIT_EVERY_S, _PROBE_EVERY_S, _SETTLE_S, RayWorkerGroup


class World:
    """Two ranks, one per node; rank ``r``'s outcome is the ref ``"r<r>"``."""

    def __init__(self, monkeypatch, *, answers: dict[str, float], gone_from: dict[str, int],
                 here: dict[int, int] | None = None, exits: dict[int, float] | None = None,
                 there: dict[int, int] | None = None):
        self.now = 0.0
        self.exits = exits or {}        # pid -> when the driver sees it exited in /proc
        self.looks: list[float] = []
        self.read_later: list = []
        self.answers = answers          # ref -> when its outcome arrives (absent: never)
        self.gone_from = gone_from      # node id -> the probe (1-based) from which it is gone
        self.waits: list[float] = []
        self.probes: list[tuple[float, frozenset]] = []
        self.broken = False
        monkeypatch.setattr(worker_group, "time", SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(worker_group.ray, "wait", self.wait)
        monkeypatch.setattr(worker_group.ray, "get", self.get)
        self.asked: list[tuple[int, list[int], float]] = []   # (node rank, pids, wait_s) of await_exit
        self.exit_answers: dict[int, tuple[float, object]] = {}   # node rank -> (when, pids or an error)
        g = object.__new__(RayWorkerGroup)
        g.config = FitConfig(storage=("file:///tmp/x",), num_nodes=2, progress=False)
        g.nodes = [NodeInfo("n0", "n0", "a", 1.0, 0), NodeInfo("n1", "n1", "a", 1.0, 0)]
        g._refs = {0: "r0", 1: "r1"}
        g._results, g._errors, g._hung, g._gone = {}, [], {}, set()
        g._unreachable = self.unreachable
        g._here = dict(here or {})
        g._there = dict(there or {})
        g._node_actors = [SimpleNamespace(await_exit=SimpleNamespace(remote=self._asker(i))) for i in range(2)]
        g._read_later = []
        monkeypatch.setattr(worker_group, "exited", self.exited)
        monkeypatch.setattr(worker_group, "_read_in_background", self.read_later.extend)
        self.group = g

    def _asker(self, node_rank):
        def remote(pids, wait_s):
            self.asked.append((node_rank, list(pids), round(wait_s, 6)))
            token = f"x{node_rank}-{len(self.asked)}"
            when, _ = self.exit_answers.get(node_rank, (None, None))
            if when is not None:
                self.answers[token] = max(when, self.now)
            return token
        return remote

    def get(self, ref):
        if ref.startswith("x"):
            _, got = self.exit_answers[int(ref[1:].split("-")[0])]
            if isinstance(got, BaseException):
                raise got
            return got
        return {"rank": ref}

    def exited(self, pids, *, exiting=False):
        self.looks.append(round(self.now, 6))
        return {p for p in pids if self.exits.get(p, float("inf")) <= self.now}

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits.append(round(timeout, 6))
        due = [self.answers[r] for r in refs if r in self.answers]
        # the clock moves to the first outcome within the timeout, else by the whole timeout
        first = min([t for t in due if t <= self.now + timeout], default=None)
        self.now = first if first is not None else self.now + timeout
        ready = [r for r in refs if self.answers.get(r, float("inf")) <= self.now]
        return ready, [r for r in refs if r not in ready]

    def unreachable(self, node_ids):
        if self.broken:
            raise ConnectionError("GCS unreachable")
        self.probes.append((round(self.now, 6), frozenset(node_ids)))
        n = len(self.probes)
        return {nid for nid in node_ids if nid in self.gone_from and n >= self.gone_from[nid]}


def test_a_lost_nodes_rank_is_given_up_once_a_probe_finds_its_raylet_gone_the_first_probe_at_once(monkeypatch):
    """Rank 0's collective failed (its peer's node was killed); rank 1's node still accepts
    connections at the first two probes (its raylet outlived its workers by a moment), refuses
    at the third. The first probe comes before any wait; the next two after the schedule's gaps;
    the node is then given up, long before ``_SETTLE_S``."""
    w = World(monkeypatch, answers={}, gone_from={"n1": 3})
    w.group._settle(["r1"])
    assert w.probes == [(0.0, frozenset({"n1"})), (_PROBE_EVERY_S[1], frozenset({"n1"})),
                        (round(_PROBE_EVERY_S[1] + _PROBE_EVERY_S[2], 6), frozenset({"n1"}))], w.probes
    assert w.waits == [_PROBE_EVERY_S[1], _PROBE_EVERY_S[2]], w.waits
    assert w.group._gone == {"n1"} and not w.group._results


def test_a_survivors_outcome_that_arrives_ends_the_wait_and_the_probes(monkeypatch):
    """A crashed rank (its node alive): the survivor's collective fails 25 ms later. The probes
    find its node reachable; the wait ends when its outcome arrives, with no probe after it."""
    w = World(monkeypatch, answers={"r1": 0.025}, gone_from={})
    w.group._settle(["r1"])
    assert w.now == pytest.approx(0.025)
    assert w.group._results == {1: {"rank": "r1"}} and not w.group._gone
    assert [t for t, _ in w.probes] == [0.0, _PROBE_EVERY_S[1]], w.probes


def test_probes_slow_down_to_the_schedules_last_gap_and_the_wait_ends_at_the_deadline(monkeypatch):
    """A rank that never answers on a node that stays reachable (hung in a long step): probed
    at the schedule's gaps, then at its last gap, until ``_SETTLE_S``; not given up."""
    w = World(monkeypatch, answers={}, gone_from={})
    w.group._settle(["r1"])
    assert w.now == pytest.approx(_SETTLE_S)
    gaps = [round(b - a, 6) for (a, _), (b, _) in zip(w.probes, w.probes[1:])]
    k = len(_PROBE_EVERY_S) - 1
    assert gaps[:k] == list(_PROBE_EVERY_S[1:]), gaps
    assert set(gaps[k:]) <= {_PROBE_EVERY_S[-1]}, gaps
    assert not w.group._gone and not w.group._results


def test_a_probe_that_fails_falls_back_on_waiting_for_the_ranks(monkeypatch, caplog):
    """The probe is an optimisation: when it raises, it is logged and not tried again, and the
    outcomes are waited for until ``_SETTLE_S``."""
    w = World(monkeypatch, answers={"r1": 0.4}, gone_from={})
    w.broken = True
    with caplog.at_level("INFO", logger="cfdist.group"):
        w.group._settle(["r1"])
    assert w.waits == [_SETTLE_S] and w.now == pytest.approx(0.4)
    assert w.group._results == {1: {"rank": "r1"}}
    assert "could not probe the nodes' raylets (GCS unreachable)" in caplog.text


def test_a_rank_whose_process_the_driver_sees_exit_is_not_waited_for(monkeypatch):
    """Rank 0's collective failed; rank 1 was killed on a node that lives, in the driver's
    process namespace (a one-machine run): its process is found exited in ``/proc`` at the
    driver's look 6 ms after the first error, long before Ray would report it. It is recorded
    as dead (its process gone), Ray's later report of it is read in the background, and
    nothing more is waited for."""
    w = World(monkeypatch, answers={}, gone_from={}, here={1: 4242}, exits={4242: 0.005})
    w.group._settle(["r1"])
    assert w.now == pytest.approx(0.006)   # three looks, _EXIT_EVERY_S apart
    assert w.looks == [0.0, _EXIT_EVERY_S, 2 * _EXIT_EVERY_S, 3 * _EXIT_EVERY_S], w.looks
    [err] = w.group._errors
    assert (err.rank, err.node_id, err.actor_died) == (1, "n1", True)
    assert "rank 1's process (pid 4242) exited" in err.message
    assert w.read_later == ["r1"] and w.group._read_later == ["r1"]
    assert not w.group._results and not w.group._gone


def test_a_rank_outside_the_drivers_namespace_is_waited_for_as_before(monkeypatch):
    """Rank 1 runs on another machine (no pid the driver can look up): its outcome is waited
    for, with the raylet probes' schedule alone (no ``/proc`` look between them)."""
    w = World(monkeypatch, answers={"r1": 0.025}, gone_from={}, here={0: 17})
    w.group._settle(["r1"])
    assert w.looks == [] and w.now == pytest.approx(0.025)
    assert w.waits == [_PROBE_EVERY_S[1], _PROBE_EVERY_S[2]], w.waits   # the probes' gaps only
    assert w.group._results == {1: {"rank": "r1"}}


def test_a_live_rank_in_the_drivers_namespace_answers_between_the_looks(monkeypatch):
    """A survivor in the driver's namespace whose outcome comes 9 ms after the first error:
    the driver looks in ``/proc`` every ``_EXIT_EVERY_S`` meanwhile, finds it alive each time,
    and collects its outcome when it arrives (not mistaken for an exit)."""
    w = World(monkeypatch, answers={"r1": 0.009}, gone_from={}, here={1: 99})
    w.group._settle(["r1"])
    assert w.group._results == {1: {"rank": "r1"}} and not w.group._errors
    assert w.now == pytest.approx(0.009)
    assert len(w.looks) == 5 and w.looks[0] == 0.0, w.looks


def test_a_rank_on_another_machine_is_seen_exit_by_its_node_actor(monkeypatch):
    """Rank 1 runs on another machine, in its node actor's namespace: the node actor is asked at
    once (until the settle's deadline) and answers 7 ms later that its process exited; the
    wait ends at that answer, the rank is recorded dead, and Ray's report is read later."""
    w = World(monkeypatch, answers={}, gone_from={}, there={1: 777})
    w.exit_answers[1] = (0.007, [777])
    w.group._settle(["r1"])
    assert w.asked == [(1, [777], _SETTLE_S)], w.asked
    assert w.now == pytest.approx(0.007)
    [err] = w.group._errors
    assert (err.rank, err.actor_died) == (1, True) and "rank 1's process (pid 777) exited" in err.message
    assert w.read_later == ["r1"]


def test_a_node_actor_that_cannot_answer_leaves_the_rank_to_rays_report(monkeypatch):
    """The node actor died with its node's ranks (a drained node): its answer is an error, the
    node is not asked again, and the rank's own outcome (Ray's report of its death) decides."""
    from ray.exceptions import RayActorError

    w = World(monkeypatch, answers={"r1": 0.03}, gone_from={}, there={1: 777})
    w.exit_answers[1] = (0.002, RayActorError())
    w.group._settle(["r1"])
    assert [a[0] for a in w.asked] == [1], w.asked   # asked once
    assert w.group._results == {1: {"rank": "r1"}} and not w.group._errors
    assert w.now == pytest.approx(0.03)


def test_a_node_actor_is_asked_once_per_settle(monkeypatch):
    """A node actor answers at the first exit on its node or at the deadline; should it answer
    that none exited before then, it is not asked again (no storm of questions): the rank's
    own outcome ends the settle."""
    w = World(monkeypatch, answers={"r1": 0.05}, gone_from={}, there={1: 5})
    w.exit_answers[1] = (0.01, [])
    w.group._settle(["r1"])
    assert [a[0] for a in w.asked] == [1], w.asked
    assert w.group._results == {1: {"rank": "r1"}} and not w.group._errors
