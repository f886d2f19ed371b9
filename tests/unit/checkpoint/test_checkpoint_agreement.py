"""The agreement protocol and per-rank RNG selection, in one process.

Real: c10d ``HashStore`` (an in-process Store with the same wait/get/add/delete semantics as the
TCPStore a job has), the agreement classes, the RNG helpers. Faked: the ranks (several objects in
one thread, called in the order ranks would reach each step). The points: every rank sees rank
0's decisions and save requests at the same step; a missing publisher gives an error naming the
rank and the key; each rank gets its own RNG, old single-``rng`` manifests still load, and ranks
a checkpoint has none for get a documented, deterministic state.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cfdist
from cfdist.checkpoint import state as st
from cfdist.checkpoint.agreement import AgreementError, Channel, Frequency, RngExchange, agree_restore
from cfdist.checkpoint.flatten import flatten


def _ranks(n, lookahead=4, timeout_s=2.0):
    store = dist.HashStore()
    return [Frequency(Channel(store, rank=r, world_size=n, timeout_s=timeout_s), rank=r, lookahead=lookahead)
            for r in range(n)]


def test_every_rank_applies_rank_0s_k_and_save_requests_at_the_same_step():
    ranks = _ranks(3)
    proposals = {1: 0, 3: 7, 10: 9}   # rank 0 changes its mind at steps 3 and 10
    k0, seen = 0, {r: [] for r in range(3)}
    for step in range(101, 131):
        k0 = proposals.get(step - 100, k0)
        if step == 111:
            ranks[2].request_save()   # a notice reaching rank 2 only
        for r, f in enumerate(ranks):
            seen[r].append(f.at_step(step, lambda: k0 if r == 0 else 99))
    assert seen[0] == seen[1] == seen[2]
    ks = [k for k, _ in seen[0]]
    # windows start at 101, 105, ...: a value published at a window start is in force one window later
    assert ks[:8] == [0] * 8 and ks[8:12] == [7] * 4 and ks[12:16] == [7] * 4 and ks[16] == 9
    assert [101 + i for i, (_, save) in enumerate(seen[0]) if save] == [117]   # requested at 111
    assert ranks[1].reads == 7 and ranks[0].reads == 0


def test_one_process_applies_at_once_without_a_store():
    f = Frequency(None)
    assert f.at_step(1, lambda: 5) == (5, False)
    f.request_save()
    assert f.at_step(2, lambda: 5) == (5, True) and f.at_step(3, lambda: 5) == (5, False)
    assert f.describe().startswith("local")


def test_a_rank_waiting_for_rank_0_names_itself_and_the_key():
    ranks = _ranks(2, lookahead=2, timeout_s=0.2)
    ranks[1].at_step(1, lambda: 0)   # window 0: nothing to read
    ranks[1].at_step(2, lambda: 0)
    with pytest.raises(AgreementError, match=r"rank 1 waited 0.2 s for rank 0's checkpoint interval .*k/1"):
        ranks[1].at_step(3, lambda: 0)   # rank 0 never published window 1


def test_rng_exchange_collects_every_rank_and_cleans_up():
    store = dist.HashStore()
    chans = [Channel(store, rank=r, world_size=3, timeout_s=0.2) for r in range(3)]
    ex = [RngExchange(c, writer=(r in (0, 2))) for r, c in enumerate(chans)]   # two writers
    for r in range(3):
        ex[r].publish(8, {"r": r})
    assert ex[0].collect(8, {"r": 0}) == [{"r": 0}, {"r": 1}, {"r": 2}]
    assert store.check([chans[0].key("rng/8/1")])          # the other writer still needs them
    assert ex[2].collect(8, {"r": 2}) == [{"r": 0}, {"r": 1}, {"r": 2}]
    assert not store.check([chans[0].key("rng/8/1")])      # the last writer deleted them
    with pytest.raises(AgreementError, match=r"rank 0 .*RNG states of step 9.*rng/9/1"):
        ex[0].collect(9, {"r": 0})


def test_restore_agreement_in_one_process_keeps_the_fallback():
    tried = []

    def try_load(s):
        tried.append(s)
        return "checksum" if s == 8 else None

    assert agree_restore(None, held=[4, 8], want=None, try_load=try_load, call=1) == 4 and tried == [8, 4]
    assert agree_restore(None, held=[], want=None, try_load=try_load, call=2) is None
    with pytest.raises(cfdist.CheckpointError, match=r"no usable checkpoint \(step 8 wanted\)"):
        agree_restore(None, held=[4, 8], want=8, try_load=try_load, call=3)


# ---- per-rank RNG ----------------------------------------------------------------------------
def _flat_rng(seed):
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
    return flatten(st.rng_state(), inline_tensors=True)[0]


def test_each_rank_gets_its_own_rng_and_new_ranks_a_derived_one():
    m = {"step": 40, "world_size": 2, "rng": _flat_rng(1), "rngs": [_flat_rng(1), _flat_rng(2)]}
    r1 = st.rank_rng_state(m, 1, where="t")
    assert torch.equal(r1["torch"], torch.Generator().manual_seed(2).get_state())
    new2, new3 = (st.rank_rng_state(m, r, where="t") for r in (2, 3))   # an elastic resume on 4 ranks
    assert not torch.equal(new2["torch"], new3["torch"])
    assert torch.equal(new2["torch"], st.derived_rng_state(1, 2, 40)["torch"])   # run seed 1, rank 2, step 40
    assert torch.equal(new2["torch"], st.rank_rng_state(m, 2, where="t")["torch"])   # deterministic
    st.set_rng_state(new3)
    assert torch.get_rng_state().equal(new3["torch"]) and random.getstate() == new3["python"]


def test_old_manifests_with_one_rng_still_load():
    old_multi = {"step": 4, "world_size": 2, "rng": _flat_rng(5)}   # older cfdist: rank 0's only
    assert all(torch.equal(st.rank_rng_state(old_multi, r, where="t")["torch"],
                           torch.Generator().manual_seed(5).get_state()) for r in (0, 1))
    single = {"step": 4, "world_size": 1, "rng": _flat_rng(6)}       # one process, grown to 2
    assert torch.equal(st.rank_rng_state(single, 0, where="t")["torch"], torch.Generator().manual_seed(6).get_state())
    assert torch.equal(st.rank_rng_state(single, 1, where="t")["torch"], st.derived_rng_state(6, 1, 4)["torch"])
    with pytest.raises(cfdist.CheckpointError, match="RNG states are malformed"):
        st.rank_rng_state({"step": 4, "rngs": [{"torch": 3}], "world_size": 2}, 1, where="t")


def test_a_storage_error_on_one_rank_stops_every_rank_instead_of_rolling_back():
    """Transient is not corrupt, across ranks: rank 1's storage stays down while reading step 40
    (StorageUnavailable after its retries). Faked: that error. The point: no rank moves on to
    step 35; rank 1 raises its StorageUnavailable, rank 0 a CheckpointError naming rank 1 and 40."""
    import threading

    from cfdist.checkpoint.format import CheckpointError
    from cfdist.checkpoint.retry import StorageUnavailable

    store = dist.HashStore()
    tried = {0: [], 1: []}
    out = {}

    def run(r):
        def try_load(step):
            tried[r].append(step)
            if r == 1:
                raise StorageUnavailable(5, f"reading step {step} from file:///x failed 4 time(s)")
            return None
        try:
            out[r] = agree_restore(Channel(store, rank=r, world_size=2, timeout_s=10), held=[35, 40], want=None,
                                   try_load=try_load, call=1)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(out[1], StorageUnavailable)
    assert isinstance(out[0], CheckpointError) and "rank 1 cannot restore step 40" in str(out[0])
    assert tried == {0: [40], 1: [40]}


def test_a_thread_waiting_on_the_store_does_not_block_another_threads_add():
    """Real TCPStore on loopback, one client shared by two threads as in a rank (the RNG exchange
    or the sliced commit waits on a background thread while the training thread agrees on the
    next step). The waiter must not hold the client: the training thread's ``add`` returns while
    the waiter still waits, and the waiter then gets its key. (A blocking ``store.wait`` held the
    connection: ``add`` waited until the wait timed out, which in a job deadlocked a rank whose
    peer waited for it in a collective.)"""
    import threading
    import time

    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False)
    ch = Channel(client, rank=1, world_size=2, timeout_s=20)
    peer = Channel(server, rank=0, world_size=2, timeout_s=20)
    started, got = threading.Event(), []

    def waiter():
        started.set()
        got.append(ch.get_all(["rng/0"], what="rank 0's RNG state", fix="-"))

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    started.wait()
    time.sleep(0.2)   # the waiter is inside get_all (ordering only; nothing timed is asserted)
    assert ch.add("agree/step", 1) == 1
    assert t.is_alive() and got == []   # the add did not wait for the waiter's key or its timeout
    peer.set("rng/0", b"state")
    t.join(timeout=20)
    assert got == [[b"state"]]


def test_every_rank_binds_its_policy_to_rank_0s_history_and_profile(tmp_path):
    """Real: two Checkpointers (ranks 0 and 1, built on two threads) over a HashStore, each with
    its own ``file://`` root, as two nodes' tiers are. Only rank 0's root holds a history (a
    preemption emptied the other node's memory tier). Both Auto policies must be bound to rank
    0's: the same MTBF estimate, hence the same checkpoint steps. (Each rank read its own root:
    rank 1 had no MTBF, chose another k, and the ranks waited for each other's RNG states.)"""
    import json
    import threading
    import time

    now = time.time()
    (tmp_path / "r0").mkdir()
    (tmp_path / "r0" / "history.json").write_text(json.dumps({"started": now - 100, "restarts": [{"time": now - 50}]}))
    store, out = dist.HashStore(), {}

    def build(rank):
        model = torch.nn.Linear(4, 4)
        pol = cfdist.Auto()
        ck = cfdist.Checkpointer({"model": model}, f"file://{tmp_path}/r{rank}", pol,
                                 group=cfdist.GroupOptions(rank=rank, world_size=2, store=store), writers=True)
        out[rank] = (ck, pol)

    ts = [threading.Thread(target=build, args=(r,)) for r in (1, 0)]
    [t.start() for t in ts]
    [t.join(timeout=30) for t in ts]
    (ck0, p0), (ck1, p1) = out[0], out[1]
    assert p0.mtbf_s is not None and p0.mtbf_source == "history"
    assert (p1.mtbf_s, p1.mtbf_source) == (p0.mtbf_s, p0.mtbf_source)
    for ck in (ck0, ck1):
        ck.abandon()
