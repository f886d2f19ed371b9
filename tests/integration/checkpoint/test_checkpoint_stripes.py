"""Sweeping is safe: a striping set's roots are identified, and a wrong list is refused untouched.

Each test writes real checkpoints striped over three ``file://`` roots with the Checkpointer
(its start-up sweep writes each root's ``STRIPE.json``), then starts again with a wrong URL list
and checks that every file on every root is still there, byte for byte.
"""

from __future__ import annotations

import shutil

import pytest

import cfdist
from cfdist.checkpoint.format import step_dir
from cfdist.checkpoint.roots import IDENTITY, StripeSetError


@pytest.fixture
def striped(tmp_path, mlp_state, train):
    """``(urls, dirs)`` of three roots holding committed steps 2 and 4, striped."""
    dirs = [tmp_path / f"disk{i}" / "run" for i in range(3)]
    urls = [f"file://{d}" for d in dirs]
    model, opt, sched = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, urls, cfdist.Every(2), keep=2)
    train(model, opt, ckpt, 4, sched)
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(urls)] == [2, 4]
    for d in dirs:
        assert (d / IDENTITY).exists() and (d / step_dir(4)).is_dir()
    return urls, dirs


def snapshot(dirs) -> dict:
    return {str(p): p.read_bytes() for d in dirs if d.exists() for p in sorted(d.rglob("*")) if p.is_file()}


def start(urls, mlp_state):
    model, opt, sched = mlp_state()
    return cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, urls, cfdist.Every(2), keep=2)


def test_a_reordered_list_is_refused_naming_each_root_and_the_right_order(striped, mlp_state):
    """Real: three file:// roots and their identity files. Faked: nothing.
    The point: StripeSetError lists every URL with its index and holdings, and the fix gives the
    original order; not a file on any root changed; the right order still restores step 4."""
    urls, dirs = striped
    before = snapshot(dirs)
    with pytest.raises(StripeSetError) as ei:
        start([urls[1], urls[0], urls[2]], mlp_state)
    msg = str(ei.value)
    assert "reordered" in msg and f"pass the URLs in this order: {urls}" in msg
    for u in urls:
        assert u in msg
    assert "root 1 of 3" in msg and "holds 2 step directories" in msg
    with pytest.raises(StripeSetError):
        cfdist.load([urls[1], urls[0], urls[2]])
    assert snapshot(dirs) == before
    ckpt = start(urls, mlp_state)
    assert ckpt.restore() == 4
    ckpt.close()


def test_an_empty_root_0_is_refused_and_the_other_roots_keep_their_shards(striped, mlp_state):
    """Root 0 is an empty, unmounted mount point (its directory exists, empty).

    Real: the roots on disk. Faked: the unmount (root 0's directory moved away, an empty one
    put in its place).
    The point: the start is refused (root 0 has no identity while its siblings do), and the
    shards on roots 1 and 2 are all still there; after "mounting" root 0 again, step 4 restores.
    """
    urls, dirs = striped
    shutil.move(dirs[0], dirs[0].parent / "unmounted")
    dirs[0].mkdir()
    before = snapshot(dirs[1:])
    with pytest.raises(StripeSetError, match="root 0 has no STRIPE.json while its siblings do") as ei:
        start(urls, mlp_state)
    assert "mount the disk of root 0" in str(ei.value)
    assert snapshot(dirs[1:]) == before
    dirs[0].rmdir()
    shutil.move(dirs[0].parent / "unmounted", dirs[0])
    ckpt = start(urls, mlp_state)
    assert ckpt.restore() == 4
    ckpt.close()


def test_a_missing_root_is_refused(striped, mlp_state):
    """Two of the three roots given. The point: refused (the set has 3 roots), nothing removed."""
    urls, dirs = striped
    before = snapshot(dirs)
    with pytest.raises(StripeSetError, match="the set has 3 roots but 2 URL"):
        start(urls[:2], mlp_state)
    with pytest.raises(StripeSetError, match="root\\(s\\) \\[2\\] have no STRIPE.json"):
        start(urls[:2] + [urls[0].replace("disk0", "disk9")], mlp_state)
    assert snapshot(dirs) == before


def test_roots_from_before_identity_files_are_checked_against_the_newest_manifest(striped, mlp_state):
    """Roots written before identity files existed (none has one).

    The point: a reordered list is refused (the newest manifest's shards are not where the list
    says), an empty root 0 with data on the others is refused, and the right order is accepted
    and gets its identity files.
    """
    urls, dirs = striped
    for d in dirs:
        (d / IDENTITY).unlink()
    before = snapshot(dirs)
    with pytest.raises(StripeSetError, match="not where this list says"):
        start([urls[0], urls[2], urls[1]], mlp_state)
    with pytest.raises(StripeSetError, match="root 0 commits no checkpoint"):
        start([urls[0].replace("disk0", "disk9")] + urls[1:], mlp_state)
    assert snapshot(dirs) == before
    start(urls, mlp_state).close()
    assert all((d / IDENTITY).exists() for d in dirs)


def test_the_sweep_removes_staging_and_uncommitted_leftovers_only(striped, mlp_state):
    """Real: the sweep of a correctly listed set. Faked: the leftovers of crashed persists (a
    staging dir on root 1, an uncommitted step dir on root 2, an unmanifested one on root 0).
    The point: exactly those are removed; the committed steps 2 and 4 are intact on every root."""
    urls, dirs = striped
    committed = snapshot(dirs)
    (dirs[1] / f"{step_dir(6)}.tmp-abcd1234").mkdir()
    (dirs[1] / f"{step_dir(6)}.tmp-abcd1234" / "x").write_bytes(b"partial")
    (dirs[2] / step_dir(6)).mkdir()
    (dirs[2] / step_dir(6) / "shard-00002-of-00003.safetensors").write_bytes(b"partial")
    (dirs[0] / step_dir(8)).mkdir()
    start(urls, mlp_state).close()
    assert snapshot(dirs) == committed
    assert not (dirs[2] / step_dir(6)).exists() and not (dirs[0] / step_dir(8)).exists()
