"""``RankWorker``: the body of one rank's Ray actor (one process per rank).

The driver creates it pinned to a node, then calls, in order: :meth:`endpoint` (rank 0 hosts
the rendezvous store; a warm spare, created without a role, gets its ``RankInfo`` here), :meth:`join` on every rank at once (``torch.distributed`` init: gloo on
CPU, NCCL on GPU), :meth:`run` (blocks for the whole training function). While ``run`` blocks,
the actor serves :meth:`drain`, :meth:`notify` and :meth:`current_step` on other threads
(``max_concurrency`` > 1), so the driver can follow progress and deliver notices.

SIGTERM (a preempted machine shutting down) becomes an emergency ``ckpt.save()`` when the
rank's recent commit latency fits ``sigterm_grace_s``; the rank exits once it committed (or the
window passed) through :func:`cfdist.cluster.exits.exit_process` (no interpreter shutdown to race
gloo's threads). The handler is installed when the actor is built on its process's main thread
(Python runs signal handlers there only); elsewhere Ray's own handler stays.

With a ``log_dir``, the process's stderr (file descriptor 2: Python's tracebacks and torch's C++
warnings alike, e.g. gloo's and TCPStore's "Connection reset by peer" with their stack frames
when a peer dies) and cfdist's log records go to ``<log_dir>/rank-worker-<pid>.log`` instead
of Ray's worker log, which Ray forwards to the driver's console. The driver reports a recovered
failure as one line; the details are in these files.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cfdist.cluster import niceness
from cfdist.cluster.context import PreemptionHalt, RankInfo, TrainContext
from cfdist.cluster.proc_log import stderr_to_file
from cfdist.cluster.exits import exit_process
from cfdist.cluster.nodes import process_namespace

log = logging.getLogger("cfdist.worker")


class RankWorker:
    """One rank. Plain class; the driver wraps it with ``ray.remote``."""

    def __init__(self, info: RankInfo | None, *, use_gpu: bool, timeout_s: float, cpus: float,
                 sigterm_grace_s: float = 25.0, log_dir: str | None = None, live_timeout_s: float | None = None,
                 keep_live: bool = False, role_nice: int | None = None):
        self.log_path = stderr_to_file(log_dir, "rank-worker")
        """This process's log file (None: stderr stays Ray's)."""
        self.info = info
        self.use_gpu = use_gpu
        self.timeout = timedelta(seconds=timeout_s)
        if cpus >= 1:
            torch.set_num_threads(max(1, int(cpus)))
        self.ctx: TrainContext | None = None
        self._log_role()
        self._store = None
        self.sigterm_grace_s = sigterm_grace_s
        self.live_timeout_s = live_timeout_s
        """How long a live save after a failure may take (None: recovery from live state is off)."""
        self.keep_live = keep_live and live_timeout_s is not None
        """After a failure, keep the live state in this process (the driver recycles it into the
        next group, which restores from it) instead of writing it to the node's memory tier."""
        self._kept: tuple[int, tuple[dict, dict]] | None = None   # (step, content) of Checkpointer.keep_live
        self._live_saving = threading.Event()
        self.sigterm_handled = False
        self._training = False
        self._finishing = False   # the loop returned: the final checkpoint and the barrier run
        self._ended = threading.Event()   # run() returned or raised (this attempt)
        self._group_sockets: tuple[int, frozenset[int]] = (-1, frozenset())
        """``(attempt, inodes)`` of the sockets the attempt's process group opened (:meth:`join`)."""
        self._role_nice = role_nice
        """A spare started at the lowest priority returns to this one when it takes a role."""
        if role_nice is not None:
            niceness.background()   # idle until it takes a role (:mod:`cfdist.cluster.niceness`)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM: checkpoint now if it can commit within the grace window, then exit. Runs on
        the main thread; never blocks it (a helper thread waits for the commit)."""
        ctx = self.ctx if self._training else None
        save, reason = ctx._emergency_save(self.sigterm_grace_s) if ctx is not None else (False, "not training")
        log.warning("rank %s got SIGTERM: %s", getattr(self.info, "rank", "?"),
                    f"emergency checkpoint ({reason})" if save else f"exiting without a checkpoint ({reason})")
        self.sigterm_handled = True
        if not save:
            return exit_process(1)   # returns only where a test replaced os._exit
        target = ctx._step + 1
        writer = any(ck.writer for ck in ctx._ckpts)

        def wait_then_exit():
            deadline = time.time() + self.sigterm_grace_s
            while time.time() < deadline and not (writer and ctx._latest_committed() >= target):
                time.sleep(0.02)
            exit_process(1)

        threading.Thread(target=wait_then_exit, name="cfdist-sigterm", daemon=True).start()

    def _log_role(self) -> None:
        if self.info is not None:
            log.info("attempt %d: rank %d of %d (node rank %d, pid %d)", self.info.attempt, self.info.rank,
                     self.info.world_size, self.info.node_rank, os.getpid())

    def warm(self, train_fn=None, background: bool = False) -> int:
        """A spare (created with ``info=None``) gets ready for a role: imports what a rank needs;
        ``train_fn`` (an object ref, resolved by Ray) imports the training function's modules.
        ``background``: on a helper thread under ``SCHED_IDLE``, so that the ranks training
        beside it keep their cores (:mod:`cfdist.cluster.niceness`). Returns the pid."""
        # (``cfdist`` itself, with the checkpoint, data and policy layers, is loaded already: it
        # is this module's parent package.)
        if background:
            niceness.run_at_background(self._warm_up)
        else:
            self._warm_up()
        return os.getpid()

    @staticmethod
    def _warm_up() -> None:
        from cfdist.cluster import node_actor  # noqa: F401 - the ActorBackend of ctx.checkpointer

        if not dist.is_initialized():
            # A first DDP in a process imports ~800 modules (torch._dynamo, sympy, ...): seconds.
            # Pay it now, on a private one-rank group, not after a failure.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                model(torch.zeros(1, 2)).sum().backward()
                opt.step()
            finally:
                dist.destroy_process_group()

    def endpoint(self, info: RankInfo | None = None) -> dict:
        """This process's node id, IP, pid and process namespace (``ns``: where the driver shares
        it, it sees this process exit at once, :func:`cfdist.cluster.nodes.exited`); on rank 0
        also a fresh rendezvous store's port.
        ``info``: the role of a warm spare (set before anything else)."""
        import ray

        if info is not None:
            if self._role_nice is not None:   # a spare started at the lowest priority: a rank now
                niceness.foreground(self._role_nice)
                self._role_nice = None
            self.info = info
            self._log_role()

        ip = ray.util.get_node_ip_address()
        out = {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "pid": os.getpid(),
               "host": socket.gethostname(), "ns": process_namespace()}
        if self.info.rank == 0:
            # Port 0: the OS picks a free port, no probe-then-bind race.
            self._store = dist.TCPStore(ip, 0, self.info.world_size, is_master=True,
                                        timeout=self.timeout, wait_for_workers=False)
            out["port"] = self._store.port
        return out

    def join(self, host: str, port: int) -> float:
        """Initialise the default process group (blocks until every rank joined); returns seconds."""
        t0 = time.perf_counter()
        if host.startswith("127.") and not self.use_gpu:
            # All ranks on this machine (a local run): keep gloo's pairs on the loopback interface
            # instead of whatever address the hostname resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if self._store is None:
            self._store = dist.TCPStore(host, port, self.info.world_size, is_master=False, timeout=self.timeout)
        backend = "nccl" if self.use_gpu else "gloo"
        if self.use_gpu:
            torch.cuda.set_device(0)   # Ray exposes exactly this rank's GPU
        before = _socket_inodes()
        dist.init_process_group(backend, store=self._store, rank=self.info.rank,
                                world_size=self.info.world_size, timeout=self.timeout)
        self._group_sockets = (self.info.attempt, _socket_inodes() - before)
        return time.perf_counter() - t0

    def break_group(self, attempt: int) -> int:
        """A peer of attempt ``attempt`` is exiting (the driver saw it in ``/proc``): make this
        rank's collectives fail now rather than when the dying process's sockets close, once
        the kernel has freed its memory (tens of milliseconds later; a collective waiting on
        it blocks until then). Shuts down the sockets ``join`` saw the process group open
        (gloo's connections to its peers: a collective then raises gloo's "Connection closed
        by peer", as when the peer's socket closes), or aborts an NCCL group. The training
        thread's failure then takes the usual path (:meth:`_save_live`). Not for another
        attempt's group (a late call after this process was recycled into the next one).
        Returns how many sockets were shut down (an NCCL abort counts 1). Any thread."""
        attempt_of, inodes = self._group_sockets
        if self.info is None or self.info.attempt != attempt or attempt_of != attempt or not dist.is_initialized():
            return 0
        if self.use_gpu:
            dist.distributed_c10d._abort_process_group()
            return 1
        n = _shutdown_sockets(inodes)
        log.info("rank %d: a peer of attempt %d is exiting: %d of its group's sockets shut down",
                 self.info.rank, attempt, n)
        return n

    def run(self, train_fn, *, tiers: dict, node_actor, policy, keep: int,
            restore_step: int | None, restore_tier: str, staged: list | None = None,
            live_source: int | None = None) -> dict:
        """Run ``train_fn(ctx)`` to the end (blocking); then commit the final checkpoint.

        ``staged``: ``[ObjectRef]`` of the copy of ``restore_step`` to this node, still running
        (in a list: Ray does not resolve it here); ``ckpt.restore()`` waits for it.
        ``restore_tier="live"``: ``restore_step`` comes from rank ``live_source``'s process (the
        live state it kept when the previous group failed), over the new group.

        Returns ``{"value": train_fn's return (rank 0), "final_step", "latest_step", "stall_s",
        "seconds"}``. Exceptions propagate to the driver (a failure of this attempt).
        """
        device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        kept, self._kept = self._kept, None   # used by this attempt's restore, or not at all
        mine = restore_tier == "live" and kept is not None and kept[0] == restore_step   # the source, or a survivor
        self.ctx = TrainContext(info=self.info, device=device, tiers=tiers, node_actor=node_actor,
                                policy=policy, keep=keep, restore_step=restore_step,
                                restore_tier=restore_tier, live=self.live_timeout_s is not None, staged=staged,
                                live_source=live_source, kept=kept[1] if mine else None)
        t0 = time.perf_counter()
        self._training = True
        self._ended.clear()
        try:
            return self._run(train_fn, t0)
        finally:
            self._finishing = False
            self._ended.set()

    def _run(self, train_fn, t0: float) -> dict:
        try:
            value = train_fn(self.ctx)
        except BaseException as e:
            halted = isinstance(e, PreemptionHalt)
            if halted:
                log.warning("%s", e)
            else:   # the details of a failure: in this rank's log file, not on the driver's console
                log.exception("rank %d (attempt %d): the training function failed", self.info.rank, self.info.attempt)
            if isinstance(e, Exception):   # an interrupt (SIGTERM's exit, Ctrl-C) leaves at once
                self._save_live()
            raise
        finally:
            self._training = False
        self._finishing = True
        try:
            out = self.ctx._finish()
            if dist.is_initialized():
                dist.barrier()   # no rank tears the group down while another still commits
                dist.destroy_process_group()
        except Exception:
            # A peer died after the last step, while the final checkpoint (its RNG exchange) or
            # the barrier ran: this rank holds the last step's state, the run's very end.
            log.exception("rank %d (attempt %d): the end of the run failed", self.info.rank, self.info.attempt)
            self._save_live()
            raise
        out["seconds"] = time.perf_counter() - t0
        out["value"] = value if self.info.rank == 0 else None
        return out

    def _save_live(self) -> None:
        """The group failed under this rank (a peer died: a collective raised), or halted for a
        notice that names every node: it keeps the live state of the last step it completed, so
        the next group loses at most the step in progress.

        With ``keep_live`` (the driver recycles this process into the next group) it is kept in
        this process (:meth:`cfdist.Checkpointer.keep_live`: nothing written, the failure is
        reported at once) and the next group restores from it (:meth:`recycle` reports the
        step); halted for a notice (every node is taken: the process dies with its node) or
        without ``keep_live``, the node's writer writes it to the node's tiers
        (:meth:`cfdist.Checkpointer.save_live`; to disk too when halted). Any survivor keeps it,
        writer or not: when a node's writer is the rank that died, the survivor on its node
        (or on a one-node job, the only survivor) still holds the step. A save that fails or
        times out is logged; the run then rolls back to the last checkpoint, as without live
        recovery."""
        if self.live_timeout_s is None or self.ctx is None:
            return
        self._live_saving.set()
        durable = self.ctx._halt.is_set()   # a notice named every node: the memory tier dies with them
        try:
            for ck in self.ctx._ckpts:
                if getattr(ck, "_closed", False):
                    continue
                try:
                    if self.keep_live and not durable:
                        self._kept = ck.keep_live()
                    elif ck.writer:
                        ck.save_live(timeout_s=self.live_timeout_s, durable=durable)
                except Exception as err:  # noqa: BLE001 - logged; recovery falls back on the last commit
                    log.warning("rank %d: the live state could not be %s (%s: %s); the run restarts from "
                                "its last checkpoint", self.info.rank, "kept" if self.keep_live else "written",
                                type(err).__name__, err)
        finally:
            self._live_saving.clear()

    def save_kept(self, timeout_s: float) -> dict | None:
        """The driver handles this attempt's failure while a notice that names every node is
        pending: this rank kept its live state in process (:meth:`_save_live`: its collective
        failed before the halt reached it, typically because a noticed rank was killed at its
        notice, so to this rank it was an ordinary failure), but the process dies with its node.
        The node's writer writes the kept step to the node's durable tier now, from the live
        objects nothing has trained since (:meth:`cfdist.Checkpointer.save_live` with
        ``durable=True``, the halt's write: a persist of the same step already writing is
        waited for instead, and a halt that reaches this rank later writes nothing). Returns
        ``{"step": the step kept, "written": the step written or None, "why"}``, or None when
        this rank kept nothing (or still trains). Raises what the write raised (the driver logs
        it)."""
        kept = self._kept
        if kept is None or self.ctx is None or self._training:
            return None
        writers = [ck for ck in self.ctx._ckpts if ck.writer and not getattr(ck, "_closed", False)]
        if not writers:
            return {"step": kept[0], "written": None, "why": "this rank writes no checkpoints"}
        written = None
        for ck in writers:
            written = ck.save_live(timeout_s=timeout_s, durable=True)
        why = "written" if written is not None else "nothing written (the reason is in the rank's log)"
        log.warning("rank %d: a notice names every node: the step %d kept in process %s", self.info.rank, kept[0],
                    "was written to the node's disk" if written is not None else "was not written")
        return {"step": kept[0], "written": written, "why": why}

    def peer_died(self, wait_s: float = 1.5) -> bool:
        """The driver saw a rank of this attempt die: returns whether this rank is writing its
        live state, or (``keep_live``) has kept it and ended (the driver then waits for its
        outcome), waiting up to ``wait_s`` for it to start or for this rank's run to end. A rank in a collective learns of the death by itself within
        milliseconds; one at the end of its run may instead wait for the dead rank's RNG states
        of the last step (the final checkpoint's exchange) for minutes: its persists in flight
        are given up, so its run's end fails now and it writes its live state of the last step."""
        if self._finishing and not self._live_saving.is_set() and self.ctx is not None:
            for ck in self.ctx._ckpts:
                for p, _ in list(getattr(ck, "_inflight", ())):
                    if p.abandon():
                        log.info("rank %d: a peer died at the end of the run; its persist of step %d is given up "
                                 "for the live state", self.info.rank, p.step)
        deadline = time.monotonic() + wait_s
        while not (self._live_saving.is_set() or self._ended.is_set()) and time.monotonic() < deadline:
            time.sleep(0.005)
        # A rank that kept its live state in process (milliseconds) has ended by now: it is
        # waited for too, so that its outcome is collected and it is recycled with that state.
        return self._live_saving.is_set() or (self.keep_live and self._ended.is_set())

    def recycle(self) -> int:
        """Make a rank whose attempt failed (its ``run`` raised: a peer died) a warm spare again,
        in this process: drop the attempt's checkpointer (no wait for its persist), destroy the
        broken process group and forget the role and the rendezvous store. The next attempt
        gives it a role with :meth:`endpoint` and a fresh store and group with :meth:`join`, as
        for any spare (the group is re-formed in process, as NVIDIA's in-process restart does).
        Raises ``RuntimeError`` while ``run`` is still training (the driver then kills it).
        Returns ``{"pid", "live_step"}``: the step of the live state this process kept for the
        next group (:meth:`_save_live`; None: none)."""
        if self._training:
            raise RuntimeError(f"rank {getattr(self.info, 'rank', '?')} is still training; it cannot be reused")
        ctx, self.ctx = self.ctx, None
        for ck in (ctx._ckpts if ctx is not None else []):
            ck.abandon()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        self.info = None
        return {"pid": os.getpid(), "live_step": self._kept[0] if self._kept is not None else None}

    def drain(self) -> list[dict]:
        """Step, metrics and restore records since the last call (empty before ``run``)."""
        return self.ctx._drain() if self.ctx is not None else []

    def notify(self, preempted: bool = True, save: bool = True, halt: bool = False) -> None:
        """Deliver a preemption notice (see ``TrainContext.preempted``), a save request, or
        (``halt``: the notice names every node of the group) a stop at the next iteration boundary."""
        if self.ctx is not None:
            self.ctx._notify(preempted=preempted, save=save, halt=halt)

    def current_step(self) -> int:
        """Steps this rank finished in this attempt's numbering (0 before training)."""
        return self.ctx._step if self.ctx is not None else 0

    def finishing(self) -> bool:
        """Whether the loop returned and the run's end runs (the final checkpoint, the barrier):
        no steps come any more, and that is no hang."""
        return self._finishing

    def pid(self) -> int:
        return os.getpid()

    def crash(self) -> None:
        """Die now, as a crashing process does (SIGKILL: no cleanup, no exception)."""
        os.kill(os.getpid(), signal.SIGKILL)


def _socket_inodes() -> frozenset[int]:
    """Inodes of this process's open sockets (``/proc/self/fd``; empty without ``/proc``)."""
    out = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue   # closed meanwhile
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return frozenset(out)


def _shutdown_sockets(inodes) -> int:
    """``shutdown(SHUT_RDWR)`` every open socket of this process whose inode is in ``inodes``
    (the descriptor stays open: its owner closes it); returns how many. A blocked ``recv`` on
    one returns at once. A listening socket is left alone: shut down, gloo's event loop fails
    its ``accept`` and aborts the process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fd = int(fd)
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino not in inodes:
                continue
            s = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue   # closed meanwhile, or not a socket
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue   # gloo's listening socket: its loop thread aborts the process on a failed accept
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass   # closed by its peer already
        finally:
            s.detach()   # the descriptor is gloo's
    return n

