"""``FailureInjector``: executes a :mod:`cfdist.chaos` failure schedule against a running fit.

The schedule is pure (``schedule.events(num_nodes, horizon_s)``); this is the thin shell that
turns its events into real failures, on the controller's thread (``tick`` is called at the top
of every ``Controller.step``). Time 0 is when the first worker group has trained its first step
(logged as ``schedule_started``): starting the processes, building the model and restoring take
as long as the machine makes them take, and a schedule counted from before them would land its
failures at different points of training on a loaded machine than on an idle one.

* ``crash`` (rank r): the rank's actor process is killed (``ray.kill``: the process exits at
  once, like a segfault or an OOM kill). Skipped while no group runs.
* ``preempt`` (node slot n, ``notice_s``): ``notice_s`` before the kill, the ranks of the
  group's node n see ``ctx.preempted``; if an emergency checkpoint fits the time left before
  the kill (:func:`emergency_checkpoint_fits`, from the commit latencies in the event log),
  every node's writer checkpoints at its next step. At the kill the node goes: through
  ``remove_node(node_id)`` when given (a test removes the fake node from its
  ``ray.cluster_utils.Cluster``), else its ranks and its node actor are killed and the node is
  excluded from scheduling, i.e. drained (its memory tier is gone, its disk stays; the warm
  spare rank processes and the standby checkpoint actor, which hold no state of the run, stay:
  they stand for the replacement node's processes, started ahead). A slot that
  is already down (preempted, not returned) is not preempted again.
* ``return`` (node slot n): ``add_node(slot)`` when given (a fresh node joins; the call runs on
  a thread of its own, as a cloud's machine boots without holding up the job, and the node is
  warmed at the first tick after it joined: ``node_joined``), else the node drained for that
  slot becomes usable again. Only a slot that a preemption took down returns.

Notices go to the controller (:meth:`Controller.on_notice`), which decides what the job does;
the notices of one instant go together. When together with earlier ones they name every node of
the group (a *pool notice*: no replica survives), the job halts and commits its last step, and
those preemptions are taken at their time whatever the job is doing (``node_taken``; the
controller logged the failure at the halt), like a cloud that does not wait.

A crash or preemption that falls due while the job is recovering is held until the next group
has trained a step (``injection_deferred``), and lands then; one more due while one is held is
skipped (it would hit the same recovery), so failures never starve training. An injection never no-ops silently: a target missing from a smaller (elastic) group is
retargeted (rank or node slot modulo the group's size, logged as ``injection_retargeted``), and
an event that cannot apply (due while recovering, slot already down) is logged as
``injection_skipped`` with its reason; ``FitResult.skipped_injections`` lists them.

Injected failures are logged as ``failure`` records at the instant they are injected, so the
controller's detection latency is measured (``detected`` - ``failure``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable


log = logging.getLogger("cfdist.injector")


def emergency_checkpoint_fits(window_s: float, latencies_s: Sequence[float]) -> tuple[bool, str]:
    """``(take, reason)``: whether a checkpoint started now is expected to commit within ``window_s``.

    Pure. ``latencies_s`` are recent checkpoints' step-to-commit seconds, oldest first; the
    estimate is the median of the last five. With none measured yet the checkpoint is taken (it
    costs one stall at most; skipping it may cost everything since the last commit).
    """
    if not window_s > 0:
        return False, f"no time left before the kill (window {window_s:.2f}s)"
    recent = list(latencies_s)[-5:]
    if not recent:
        return True, f"window {window_s:.2f}s, no commit latency measured yet: checkpoint now"
    est = statistics.median(recent)
    if est <= window_s:
        return True, f"commit latency ~{est:.3g}s (median of {len(recent)}) fits the {window_s:.2f}s window"
    return False, (f"commit latency ~{est:.3g}s (median of {len(recent)}) exceeds the {window_s:.2f}s window: "
                   f"a checkpoint now would not commit before the kill")


@dataclass(frozen=True, kw_only=True)
class AtStep:
    """A failure injected once rank 0 reported step >= ``step`` (deterministic tests and demos).

    Same kinds and fields as :class:`cfdist.chaos.FailureEvent`, triggered by progress, not time.
    A preemption with ``notice_s``: the notice once step ``step`` is reached, the kill
    ``notice_s`` seconds later; noticed preemptions of the same step are one notice.
    """

    step: int
    kind: str
    rank: int | None = None
    node: int | None = None
    notice_s: float = 0.0

    def __post_init__(self):
        from cfdist.chaos.events import FailureEvent

        FailureEvent(time_s=0.0, kind=self.kind, rank=self.rank, node=self.node, notice_s=self.notice_s)
        if not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"AtStep.step must be an int >= 1, got {self.step!r}")

    @property
    def time_s(self) -> float:   # for code that sorts events
        return float(self.step)


class StepSchedule:
    """A list of :class:`AtStep` failures: ``StepSchedule([AtStep(step=20, kind="crash", rank=1)])``."""

    def __init__(self, events: list[AtStep]):
        self.at_steps = sorted(events, key=lambda e: e.step)

    def events(self, num_nodes: int, horizon_s: float) -> list[AtStep]:
        return list(self.at_steps)


class FailureInjector:
    """Drives one schedule. Driver process, controller thread only (``add_node`` runs on the
    injector's own thread); :meth:`close` at the end of the run."""

    def __init__(self, schedule, *, num_nodes: int, backend, horizon_s: float = 6 * 3600.0,
                 remove_node: Callable[[str], None] | None = None,
                 add_node: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.time):
        if not hasattr(schedule, "events"):
            raise TypeError(f"preemption= needs a schedule with events(num_nodes, horizon_s) (cfdist.chaos."
                            f"FixedInterval, Exponential, TraceReplay, ...), got {schedule!r}")
        if not math.isfinite(horizon_s):
            raise ValueError("horizon_s must be finite: schedules with returns repeat forever")
        self.by_step = hasattr(schedule, "at_steps")
        self.events = list(schedule.events(num_nodes, horizon_s))
        self.backend = backend
        self.remove_node = remove_node
        self.add_node = add_node
        self.clock = clock
        self.t0: float | None = None
        self._next = 0
        self._notices: set[int] = set()
        self._down: dict[int, str] = {}      # node slot -> node id a preemption took (until its return)
        self._unclaimed: list[dict] = []
        self._notice_at = 0.0
        self._held = None                    # a failure due while recovering, for the next group
        self._skipped_preempts: set[int] = set()
        self._held_returns: list = []
        self._pool_ids: dict[int, str] = {}  # event index -> node id, for preemptions of a pool notice
        self._pool_down: set[int] = set()    # node slots such a preemption took (their return needs no group)
        self._taken: set[str] = set()        # node ids a preemption took (a drained one returns under its id)
        self._ops = None                     # the thread add_node runs on (started at the first return)
        self._joining: list = []             # (slot, since, future) of add_node calls in flight
        self.executed: list[dict] = []

    # ---- called by the controller ----------------------------------------------------------------
    def tick(self, controller) -> None:
        """Execute every event that is due (and every notice whose time came)."""
        from cfdist.cluster.states import RunningState

        running = isinstance(controller.state, RunningState)
        if self._joining:
            self._joined(controller)
        if self.t0 is None:
            if not running or controller.step_now <= getattr(controller, "_attempt_base", -1):
                return
            self.t0 = self.clock()
            controller.events.emit("schedule_started", step=controller.step_now, t=self.t0)
        now = self.clock() - self.t0
        if self.by_step:
            return self._tick_steps(controller)
        due = [i for i in range(self._next, len(self.events)) if self.events[i].kind == "preempt"
               and self.events[i].notice_s > 0 and i not in self._notices and now >= self.events[i].time_s - self.events[i].notice_s]
        if due:   # one call for the notices of one instant: together they may name every node
            self._notices.update(due)
            self._notice(controller, due, window_s=min(self.events[i].time_s for i in due) - now)
        # A group that has not trained a step yet is still recovering (restoring, or its first
        # step): the controller's recovery blocks its thread, so the first tick after one sees
        # the new group running, with every failure that fell due meanwhile.
        trained = running and controller.step_now > getattr(controller, "_attempt_base", -1)
        if self._held is not None and trained:
            e, self._held = self._held, None   # the new group trained a step: the held failure lands
            self._run_event(controller, e)
            for r in self._held_returns:       # and the node it took comes back as scheduled
                self._run_event(controller, r)
            self._held_returns = []
        while self._next < len(self.events) and self.events[self._next].time_s <= now:
            e = self.events[self._next]
            self._next += 1
            if self._next - 1 in self._pool_ids:   # the cloud does not wait for the job: on time
                self._take_noticed(controller, self._next - 1)
                continue
            if e.kind in ("crash", "preempt") and (not trained or self._held is not None):
                # Due while recovering: held until the next group trained a step (it lands then);
                # one more due meanwhile would hit the same recovery: skipped, with the reason.
                if self._held is None:
                    self._held = e
                    controller.events.emit("injection_deferred", kind=e.kind, due_s=round(e.time_s, 3),
                                           reason=f"{e.kind} due at {e.time_s:.1f}s while recovering: held "
                                                  f"until the next group trained a step")
                else:
                    controller.events.emit("injection_skipped", kind=e.kind, node=e.node, rank=e.rank,
                                           reason=f"{e.kind} due at {e.time_s:.1f}s while recovering, with "
                                                  f"a {self._held.kind} already held for the next group")
                    if e.kind == "preempt":
                        self._skipped_preempts.add(e.node)
                continue
            # A slot's preemptions and returns alternate: a return after a skipped preemption of
            # its slot is that one's (skipped too), even while an earlier one of the slot is held.
            if e.kind == "return" and e.node in self._skipped_preempts:
                self._skipped_preempts.discard(e.node)
                controller.events.emit("injection_skipped", kind="return", node=e.node,
                                       reason="its preemption was skipped")
                continue
            if e.kind == "return" and self._held is not None and self._held.kind == "preempt" \
                    and self._held.node == e.node:
                self._held_returns.append(e)   # after the held preemption
                continue
            self._run_event(controller, e)

    def _add(self, slot: int) -> None:
        """``add_node(slot)`` on a thread of its own: a node takes seconds to start (its raylet
        and agents; 2-4 s here), which on the controller's thread would hold up the detection
        of and the recovery from every failure meanwhile (a cloud's new machine boots without
        stopping the job). :meth:`_joined` warms it once it is up."""
        if self._ops is None:
            self._ops = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfdist-node-ops")
        self._joining.append((slot, self.clock(), self._ops.submit(self.add_node, slot)))

    def _joined(self, controller) -> None:
        """The nodes whose ``add_node`` ended since the last tick: ``node_joined`` (with the
        seconds it took), and their node actor and spare ranks start now, not at the next
        failure; a failed one is ``injection_failed``."""
        for item in [j for j in self._joining if j[2].done()]:
            self._joining.remove(item)
            slot, since, fut = item
            err = fut.exception()
            if err is not None:
                log.warning("bringing node slot %d back failed: %s", slot, err)
                controller.events.emit("injection_failed", kind="return", node=slot, error=str(err)[:200])
                continue
            controller.events.emit("node_joined", node=slot, join_s=round(self.clock() - since, 3))
            warm = getattr(self.backend, "warm_spare_nodes", None)
            if warm is not None:
                warm()

    @property
    def joining(self) -> int:
        """Nodes being brought back now (``add_node`` calls in flight)."""
        return len(self._joining)

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until the nodes being brought back have joined (or failed to); raises
        ``TimeoutError`` naming the slots still starting after ``timeout_s``."""
        done, pending = cf.wait([f for _, _, f in self._joining], timeout=timeout_s)
        if pending:
            slots = [s for s, _, f in self._joining if f in pending]
            raise TimeoutError(f"add_node for node slot(s) {slots} did not return within {timeout_s:.0f} s")

    def close(self) -> None:
        """At the end of the run: wait for the nodes still joining (a cluster closed under a
        starting node leaves its processes behind), then stop the thread."""
        try:
            self.settle()
        finally:
            if self._ops is not None:
                self._ops.shutdown(wait=False)
                self._ops = None

    def _run_event(self, controller, e) -> None:
        try:
            self._execute(controller, e)
        except Exception as err:  # noqa: BLE001 - a failed injection is logged, the run goes on
            log.warning("injecting %s failed: %s", e, err)
            controller.events.emit("injection_failed", kind=e.kind, error=str(err)[:200])

    def _tick_steps(self, controller) -> None:
        from cfdist.cluster.states import RunningState

        # Step-triggered: at most one per tick (the next waits for the group that replaces the
        # failed one to report progress again), while running; except the preemptions of a pool
        # notice (the cloud does not wait for the job) and the returns after them.
        if self._next >= len(self.events):
            return
        running = isinstance(controller.state, RunningState)
        e = self.events[self._next]
        if e.kind == "preempt" and e.notice_s > 0 and self._next not in self._notices:
            if not running or controller.step_now < e.step:
                return
            # The noticed preemptions of the same step are one notice (together they may name every node).
            same = [j for j in range(self._next, len(self.events)) if self.events[j].step == e.step
                    and self.events[j].kind == "preempt" and self.events[j].notice_s > 0]
            self._notices.update(same)
            self._notice_at = self.clock()   # before the controller's own clock reading: never a later kill
            self._notice(controller, same, window_s=e.notice_s)
            return
        if controller.step_now < e.step or (e.notice_s > 0 and self.clock() - self._notice_at < e.notice_s):
            return
        if self._next in self._pool_ids:
            # every kill of the pool at once, and the returns due with them: the controller
            # recovers in this same step, on as many nodes as a time schedule would give it
            while self._next in self._pool_ids:
                self._next += 1
                self._take_noticed(controller, self._next - 1)
            while self._next < len(self.events) and self.events[self._next].kind == "return" \
                    and self.events[self._next].node in self._pool_down and controller.step_now >= self.events[self._next].step:
                self._next += 1
                self._execute(controller, self.events[self._next - 1])
        elif running or (e.kind == "return" and e.node in self._pool_down):
            self._next += 1
            self._execute(controller, e)

    def claim(self, kind: str | None = None) -> dict | None:
        """The oldest injected failure not yet matched with a detection (its ``t``), or None."""
        return self._unclaimed.pop(0) if self._unclaimed else None

    # ---- the three kinds ---------------------------------------------------------------------------
    def _group(self, controller):
        from cfdist.cluster.states import RunningState

        return controller.state.group if isinstance(controller.state, RunningState) else None

    def _notice(self, controller, indices: list[int], *, window_s: float) -> None:
        """The notices of the preemptions ``indices`` (one instant), handed to the controller
        (:meth:`Controller.on_notice`). Those that make a pool notice are taken on time, even
        while the job recovers: the node ids are kept for that."""
        group = self._group(controller)
        slots = sorted({self.events[i].node for i in indices if group is not None and self.events[i].node < len(group.nodes)})
        pool = controller.on_notice(slots, window_s, source="injected",
                                    notice_s=max(self.events[i].notice_s for i in indices))
        if pool:
            for i in indices:
                if self.events[i].node in slots:
                    self._pool_ids[i] = group.nodes[self.events[i].node].node_id

    def _take_noticed(self, controller, i: int) -> None:
        """The kill of a preemption whose notice made a pool notice: the job has halted and
        accounted for the notice by its deadline (``notice_commit``), so this drains or removes
        the node, whatever the job is doing, and logs ``node_taken``."""
        e, node_id = self.events[i], self._pool_ids.pop(i)
        self._taken.add(node_id)
        self._down[e.node] = node_id
        self._pool_down.add(e.node)
        if self.remove_node is not None:
            self.remove_node(node_id)
        else:
            self._drain(node_id, group=self._group(controller), slot=e.node)
        controller.events.emit("node_taken", node=e.node, notice_s=e.notice_s)
        self.executed.append({"t": self.clock(), "kind": e.kind, "node": e.node, "rank": None})

    def _drain(self, node_id: str, *, group, slot: int) -> None:
        """Take a node out of the cluster without removing it: its ranks (of ``group``, if it
        still runs there) are killed at once, as a machine's power-off kills them
        (:meth:`RayWorkerGroup.power_off`), and the backend kills the rest of what runs there
        and excludes it from scheduling (:meth:`RayBackend.drain`)."""
        if group is not None and slot < len(group.nodes) and group.nodes[slot].node_id == node_id:
            w = group.world_size // len(group.nodes)
            for r in range(slot * w, (slot + 1) * w):
                group.power_off(r)
        self.backend.drain(node_id)

    def _execute(self, controller, e) -> None:
        group = self._group(controller)
        if e.kind == "crash":
            if group is None:
                controller.events.emit("injection_skipped", kind="crash", rank=e.rank,
                                       reason=f"crash of rank {e.rank} due while no group ran (recovering)")
                return
            rank = self._retarget(controller, e, "rank", e.rank, group.world_size)
            self._failed(controller, kind="crash", rank=rank, node=rank // max(1, group.world_size // len(group.nodes)))
            group.crash(rank)
        elif e.kind == "preempt":
            nodes = group.nodes if group is not None else []
            if e.node in self._down:
                controller.events.emit("injection_skipped", kind="preempt", node=e.node,
                                       reason=f"node slot {e.node} already down (preempted, not returned yet)")
                return
            if not nodes:
                controller.events.emit("injection_skipped", kind="preempt", node=e.node,
                                       reason=f"preemption of node slot {e.node} due while no group ran (recovering)")
                return
            slot = self._retarget(controller, e, "node", e.node, len(nodes))
            if slot in self._down:
                controller.events.emit("injection_skipped", kind="preempt", node=e.node,
                                       reason=f"retargeted node slot {slot} already down")
                return
            node = nodes[slot]
            if node.node_id in self._taken:   # the group still lists it: its failure is not recovered yet
                controller.events.emit("injection_skipped", kind="preempt", node=e.node,
                                       reason=f"node slot {slot}'s node was taken already; the group that "
                                              f"still lists it has not been replaced yet")
                self._skipped_preempts.add(e.node)
                return
            self._failed(controller, kind="preempt", node=slot, notice_s=e.notice_s)
            self._taken.add(node.node_id)
            self._down[e.node] = node.node_id
            if self.remove_node is not None:
                self.remove_node(node.node_id)
            else:
                self._drain(node.node_id, group=group, slot=slot)
        elif e.kind == "return":
            self._pool_down.discard(e.node)
            node_id = self._down.pop(e.node, None)
            if node_id is None:
                controller.events.emit("injection_skipped", kind="return", node=e.node,
                                       reason="slot not down (its preemption was skipped)")
                return
            controller.events.emit("node_returned", node=e.node)
            if self.add_node is not None:
                self._add(e.node)
            else:
                self._taken.discard(node_id)   # the drained node itself comes back
                self.backend.undrain(node_id)
        self.executed.append({"t": self.clock(), "kind": e.kind, "node": e.node, "rank": e.rank})

    @staticmethod
    def _retarget(controller, e, what: str, target: int, size: int) -> int:
        """``target`` if the group has it, else ``target % size`` (logged: never a silent no-op)."""
        if target < size:
            return target
        new = target % size
        controller.events.emit("injection_retargeted", kind=e.kind, **{what: new},
                               reason=f"{what} {target} is not in the running group ({size} {what}s): "
                                      f"{e.kind} of {what} {new} instead")
        return new

    def _failed(self, controller, **fields) -> None:
        group = self._group(controller)
        step = controller.step_now
        if group is not None:
            try:
                step = max(step, group.current_step() or 0)
            except Exception:  # noqa: BLE001
                pass
        rec = controller.events.emit("failure", step=step, injected=True, **fields)
        self._unclaimed.append(rec)
