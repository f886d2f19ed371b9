"""Never lose a committed checkpoint (invariants 2 and 8): transient is not corrupt, rolling back
never deletes.

Each test writes real checkpoints with the Checkpointer to ``file://`` storage (steps 35 and 40,
``keep=2``), then restores through a storage wrapper that injects the fault, and checks on disk
that every committed checkpoint is still there (live or under ``rejected/``).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import cfdist
from cfdist.checkpoint.format import SHARD_RE, step_dir
from cfdist.checkpoint.rejected import REASON, REJECTED
from cfdist.checkpoint.retry import RetryPolicy, StorageUnavailable
from cfdist.cli import main as cli
from cfdist.storage import open_storage
from cfdist.testing import flaky

FAST = RetryPolicy(tries=4, first_delay_s=0.01, max_delay_s=0.02)
SHARD = "shard-00000-of-00001.safetensors"


@pytest.fixture
def run40(committed_run):
    """``(url, root)`` holding committed steps 35 and 40 (``Every(5)``, ``keep=2``)."""
    return committed_run(5, 40)


def fresh(storage, mlp_state, **kw):
    model, opt, sched = mlp_state(seed=123)
    return cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, storage, cfdist.Every(5), keep=2,
                               load=cfdist.LoadOptions(read_retry=FAST), **kw)


def restore(ckpt, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ckpt.restore(**kw)
    return step, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_transient_read_errors_are_retried_and_the_newest_checkpoint_is_kept(run40, mlp_state, train):
    """The issue's scenario: the first reads of step 40's tensor file fail with EIO, then the
    storage works again.

    Real: checkpoints written by the Checkpointer, the restore path, retention on the next
    commits. Faked: the EIO, by a wrapper failing the first two reads of step 40's shard.
    The point: restore retries and loads step 40 (no fallback, no warning), the following
    commits keep 40, and nothing is moved aside.
    """
    url, root = run40
    st = flaky(open_storage(url), match=f"{step_dir(40)}/*.safetensors", failures=2)
    ckpt = fresh(st, mlp_state)
    step, warned = restore(ckpt)
    assert step == 40 and warned == []
    assert st.injected == 2 and st.calls == 3
    train(ckpt.state["model"], ckpt.state["optim"], ckpt, 5, ckpt.state["sched"])
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [40, 45]
    assert not (root / REJECTED).exists()


def test_storage_that_stays_down_raises_naming_url_and_step_and_rolls_nothing_back(run40, mlp_state, train):
    """A storage error that outlasts the retries is raised, never taken for corruption.

    Real: the restore path and the retry policy (4 tries). Faked: every read of step 40's
    shard fails with EIO.
    The point: ``StorageUnavailable`` (an OSError) names the URL and step 40; step 35 was not
    loaded; a later restore, once the storage works, loads 40 and both checkpoints are intact.
    """
    url, root = run40
    st = flaky(open_storage(url), match=f"{step_dir(40)}/*", failures=None)
    ckpt = fresh(st, mlp_state)
    with pytest.raises(StorageUnavailable) as ei:
        restore(ckpt)
    msg = str(ei.value)
    assert isinstance(ei.value, OSError)
    assert f"step 40 from {url}/{step_dir(40)}" in msg and "failed 4 time(s)" in msg and "may be intact" in msg
    assert ckpt.step_count == 0 and st.injected == 4
    st.heal()
    assert restore(ckpt) == (40, [])
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [35, 40]


def test_a_tier_whose_listing_fails_is_not_skipped(run40, mlp_state, tmp_path):
    """``candidates()`` used to skip a tier it could not list, silently restoring an older step
    from another tier. Real: two file:// tiers. Faked: the first tier's listing fails with EIO.
    The point: restore raises StorageUnavailable naming that tier; it does not load the other."""
    url, _ = run40
    other = f"file://{tmp_path / 'other'}"
    st = flaky(open_storage(url), match="", verbs=("listdir",), failures=0)
    ckpt = fresh(st, mlp_state, restore_from=[other])
    st.failures = None   # from now on every listing of the root fails
    with pytest.raises(StorageUnavailable, match=r"listing the checkpoints of tier 0 \(file://"):
        restore(ckpt)
    assert st.injected == 4 and ckpt.step_count == 0
    ckpt.close()


def test_corrupt_newest_falls_back_and_is_moved_aside_not_deleted(run40, mlp_state, train):
    """A content error (checksum) does make restore fall back; the rejected checkpoint is then
    moved aside by the first commit, with a REASON.json, and can still be read.

    Real: Checkpointer, retention, ``cfdist ls --all``, ``cfdist.load``. Faked: the bit flips.
    The point: restore loads 35 with a warning; after training to 45, step 40 sits in
    ``rejected/`` with why (the checksum message), when and which step replaced it, ``ls --all``
    lists it, and ``load(url, step=40)`` reads it (failing its checksum, as it should:
    ``verify=False`` reads the bytes).
    """
    url, root = run40
    shard = root / step_dir(40) / SHARD
    raw = bytearray(shard.read_bytes())
    raw[-8] ^= 0xFF
    shard.write_bytes(bytes(raw))
    ckpt = fresh(url, mlp_state)
    step, warned = restore(ckpt)
    assert step == 35 and len(warned) == 1 and "failed its checksum" in warned[0]
    train(ckpt.state["model"], ckpt.state["optim"], ckpt, 10, ckpt.state["sched"])
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [40, 45]   # the new 40 and 45
    everything = cfdist.list_checkpoints(url, include_rejected=True)
    aside = [c for c in everything if "rejected" in c]
    assert [c["step"] for c in aside] == [40]
    why = aside[0]["rejected"]
    assert "restore rejected it" in why["why"] and "failed its checksum" in why["why"]
    assert why["replaced_by"] == 40 and why["when"] > 0
    tag_dir = root / REJECTED / aside[0]["url"].split(f"/{REJECTED}/")[1].split("/")[0]
    assert json.loads((tag_dir / REASON).read_text())["step"] == 40
    assert (tag_dir / step_dir(40) / SHARD).read_bytes() == bytes(raw)       # the very bytes, kept
    old = cfdist.load(aside[0]["url"].rsplit("/", 1)[0], step=40, verify=False)
    assert old["step"] == 40 and set(old["state"]) >= {"model", "optim"}


def test_restoring_an_older_step_moves_newer_ones_aside_and_they_stay_readable(run40, mlp_state, train, capsys):
    """The user restores step 35 on purpose; the newer step 40 (intact) is not deleted.

    Real: everything (Checkpointer, retention, the ``cfdist ls --all`` command, ``cfdist.load``
    and ``restore(step=...)`` reading from ``rejected/``). Faked: nothing.
    The point: after committing 36 from 35, step 40 is under ``rejected/`` with the reason,
    ``cfdist ls --all`` shows it, ``load(url, step=40)`` and ``restore(step=40)`` load it bit
    for bit, and retention deleted only ancestors.
    """
    url, root = run40
    want40 = cfdist.load(url, step=40)["state"]["model"]
    model, opt, sched = mlp_state(seed=1)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(3), keep=2,
                               load=cfdist.LoadOptions(read_retry=FAST))
    assert restore(ckpt, step=35) == (35, [])
    train(model, opt, ckpt, 3, sched)
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [35, 36]
    assert not (root / step_dir(40)).exists()
    aside = [c for c in cfdist.list_checkpoints(url, include_rejected=True) if "rejected" in c]
    assert [c["step"] for c in aside] == [40]
    assert "restore(step=35) chose an older step" in aside[0]["rejected"]["why"]
    assert aside[0]["rejected"]["replaced_by"] == 36

    assert cli(["ls", url, "--all", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], "rejected" in r) for r in rows] == [(35, False), (36, False), (40, True)]

    got = cfdist.load(url, step=40)["state"]["model"]
    assert all(torch.equal(got[k], want40[k]) for k in want40)
    again = fresh(url, mlp_state)
    assert restore(again, step=40)[0] == 40
    assert all(torch.equal(again.state["model"].state_dict()[k], want40[k]) for k in want40)
    again.close()


def test_a_new_run_in_the_same_directory_moves_the_old_run_aside(run40, mlp_state, train):
    """A run that starts without restoring (a new lineage) commits step 5: the old run's 35 and
    40 are moved aside, not deleted (they used to be deleted as "stale").

    Real: Checkpointer and retention on file://. Faked: nothing.
    The point: live = [5, 10]; rejected/ holds 35 and 40 with their shards.
    """
    url, root = run40
    model, opt, sched = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(5), keep=2)
    train(model, opt, ckpt, 10, sched)
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [5, 10]
    aside = sorted(c["step"] for c in cfdist.list_checkpoints(url, include_rejected=True) if "rejected" in c)
    assert aside == [35, 40]
    shards = [p for p in (root / REJECTED).rglob("*.safetensors") if SHARD_RE.match(p.name)]
    assert len(shards) == 2


def test_copying_to_a_tier_that_holds_another_checkpoint_of_the_step_moves_it_aside(run40, mlp_state, train, tmp_path):
    """The shared tier holds step 40 of a run that was rolled back; the new run's step 40 arrives.

    Real: ``transfer.freeze``/``commit_frozen`` (what node actors use for the shared tier and
    peer copies) between two file:// tiers. Faked: nothing.
    The point: the same checkpoint again is not rewritten (False); a different one of the same
    step moves the old one aside (REASON names the source) and commits the new one.
    """
    from cfdist.cluster import transfer

    url, _ = run40
    shared = [open_storage(f"file://{tmp_path / 'shared'}")]
    src = [open_storage(url)]
    assert transfer.commit_frozen(transfer.freeze(src, 40), 40, shared, source="node a", keep=2)
    assert not transfer.commit_frozen(transfer.freeze(src, 40), 40, shared, source="node a", keep=2)
    old = cfdist.load(shared[0].url, step=40)["state"]["model"]
    ckpt = fresh(url, mlp_state)
    assert restore(ckpt, step=35)[0] == 35
    train(ckpt.state["model"], ckpt.state["optim"], ckpt, 5, ckpt.state["sched"])   # a new step 40
    ckpt.close()
    assert transfer.commit_frozen(transfer.freeze(src, 40), 40, shared, source="node b", keep=2)
    new = cfdist.load(shared[0].url, step=40)["state"]["model"]
    assert not all(torch.equal(old[k], new[k]) for k in old)
    aside = [c for c in cfdist.list_checkpoints(shared[0].url, include_rejected=True) if "rejected" in c]
    assert [c["step"] for c in aside] == [40] and "arrived from node b" in aside[0]["rejected"]["why"]
