"""Corruption and safety (invariants 1 and 7): damaged checkpoints are refused, never half-loaded.

Each test writes two real checkpoints (steps 2 and 4, ``keep=2``) to ``file://`` storage with
the Checkpointer, damages the newest on disk the way a failing disk, a truncating copy or an
attacker would, and restores into fresh live objects.
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import pytest
import torch

import cfdist
from cfdist.checkpoint.format import MANIFEST, CheckpointError, seal_manifest, step_dir

SHARD = "shard-00000-of-00001.safetensors"


@pytest.fixture
def ckpts(committed_run):
    """``(url, root)`` holding committed steps 2 and 4 of a small MLP/Adam/StepLR run."""
    return committed_run(2, 4)


def restore_fresh(url, mlp_state, **kw):
    """A fresh state (other seed) restored from ``url``: (step, warnings, model, checkpointer)."""
    model, opt, sched = mlp_state(seed=123)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(2), keep=2, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ckpt.restore()
    return step, [str(w.message) for w in caught], model, ckpt


def assert_model_is_step(model, url, step):
    want = cfdist.load(url, step=step)["state"]["model"]
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name


def test_flipped_bytes_fall_back_to_the_previous_checkpoint_with_file_and_checksums(ckpts, mlp_state, train):
    """A bit flip in the newest shard is detected by its checksum; restore falls back one step.

    Real: checkpoints written by the Checkpointer, xxh3 verification on restore, the fallback.
    Faked: the corruption (three bytes XORed near the end of step 4's shard, inside tensor data).
    The point: the warning names the shard file and both checksums, step 2 is loaded exactly,
    and training from there commits step 4 again over the rejected one (no "already exists").
    """
    url, root = ckpts
    shard = root / step_dir(4) / SHARD
    raw = bytearray(shard.read_bytes())
    for i in (-4, -40, -400):
        raw[i] ^= 0xA5
    shard.write_bytes(bytes(raw))

    step, warned, model, ckpt = restore_fresh(url, mlp_state)
    assert step == 2
    assert len(warned) == 1
    assert f"{url}/{step_dir(4)}/{SHARD}" in warned[0]
    assert re.search(r"failed its checksum \([0-9a-f]{16} != [0-9a-f]{16}\)", warned[0]), warned[0]
    assert_model_is_step(model, url, 2)

    train(model, ckpt.state["optim"], ckpt, 4, ckpt.state["sched"])
    ckpt.close()
    assert ckpt.stats["errors"] == 0
    assert [c["step"] for c in cfdist.list_checkpoints(url)] == [4, 6]
    assert restore_fresh(url, mlp_state)[:2] == (6, [])


@pytest.mark.parametrize("damage", ["truncate-data", "truncate-header", "delete"])
def test_truncated_or_missing_shard_falls_back(ckpts, mlp_state, damage):
    """A shard cut short (in its data or its header) or deleted makes restore fall back one step.

    Real: the committed checkpoints and the verified restore. Faked: the damage to step 4's shard.
    The point: a warning names the damaged file and why, and step 2 is loaded exactly.
    """
    url, root = ckpts
    shard = root / step_dir(4) / SHARD
    if damage == "delete":
        shard.unlink()
        why = "is missing"
    else:
        raw = shard.read_bytes()
        shard.write_bytes(raw[:len(raw) // 2] if damage == "truncate-data" else raw[:20])
        why = "truncated" if damage == "truncate-data" else "not a safetensors file"

    step, warned, model, _ = restore_fresh(url, mlp_state)
    assert step == 2
    assert len(warned) == 1 and SHARD in warned[0] and why in warned[0], warned
    assert_model_is_step(model, url, 2)


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "../step-000000002/" + SHARD, "..\\x.safetensors"])
def test_manifest_naming_a_path_outside_its_directory_is_refused(ckpts, mlp_state, tmp_path, name):
    """A manifest whose shard entry points outside the step directory is refused before any read.

    Real: restore and ``cfdist.load`` on real files. Faked: the tampered manifest, and a valid
    shard planted at the escape target ``tmp_path/x`` (so following the path would "work").
    Recorded: every path the storage is asked to read.
    The point: the error says the manifest names an unsafe shard file; no path outside the step
    directory is read, the planted file is untouched, and restore falls back to step 2.
    """
    url, root = ckpts
    planted = tmp_path / "x"
    planted.write_bytes((root / step_dir(4) / SHARD).read_bytes())
    before = planted.stat()
    man = root / step_dir(4) / MANIFEST
    m = json.loads(man.read_text())
    m["shards"][0]["file"] = name
    man.write_text(json.dumps(m))

    from cfdist.storage.base import Storage
    reads = []
    real_read = Storage.read_bytes

    def recording_read(self, rel, *a, **kw):
        reads.append(rel)
        return real_read(self, rel, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Storage, "read_bytes", recording_read)
        with pytest.raises(CheckpointError, match="unsafe or unexpected shard file"):
            cfdist.load(url, step=4)
        step, warned, model, _ = restore_fresh(url, mlp_state)
    assert step == 2 and len(warned) == 1 and "unsafe" in warned[0]
    assert_model_is_step(model, url, 2)
    assert all(r.startswith(step_dir(2) + "/") or r.startswith(step_dir(4) + "/" + MANIFEST)
               or r in ("history.json", "STRIPE.json")
               for r in reads), reads
    assert planted.stat().st_mtime_ns == before.st_mtime_ns and planted.stat().st_atime_ns == before.st_atime_ns


class _Marker:
    """Unpickling this creates the marker file: proof that loading ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


@pytest.mark.parametrize("zipfile", [True, False])
def test_pickle_in_place_of_a_shard_is_refused_without_running_it(ckpts, mlp_state, tmp_path, zipfile):
    """A ``torch.save`` pickle swapped in for a shard is refused, and its code never runs.

    Real: restore and ``cfdist.load`` on real files. Faked: the swapped shard, a pickle (zip or
    legacy format) whose ``__reduce__`` would create a marker file when unpickled.
    The point: refused as not a safetensors file, the marker never exists, restore falls back.
    """
    url, root = ckpts
    marker = tmp_path / "pwned"
    torch.save({"w": _Marker(marker)}, root / step_dir(4) / SHARD, _use_new_zipfile_serialization=zipfile)
    assert not marker.exists()

    with pytest.raises(CheckpointError, match="not a safetensors file"):
        cfdist.load(url, step=4)
    step, warned, model, _ = restore_fresh(url, mlp_state)
    assert step == 2 and len(warned) == 1 and "not a safetensors file" in warned[0]
    assert not marker.exists()


def test_nothing_usable_raises_listing_every_rejected_step(ckpts, mlp_state):
    """With every checkpoint damaged, restore raises CheckpointError naming each step and why.

    Real: the committed checkpoints and restore. Faked: step 4's shard deleted, step 2's flipped.
    The point: the error lists step 4 (missing file) and step 2 (checksum), and the live model
    keeps its own initial values (nothing half-loaded).
    """
    url, root = ckpts
    (root / step_dir(4) / SHARD).unlink()
    shard2 = root / step_dir(2) / SHARD
    raw = bytearray(shard2.read_bytes())
    raw[-8] ^= 0xFF
    shard2.write_bytes(bytes(raw))

    model, opt, sched = mlp_state(seed=123)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(2))
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError) as err:
        ckpt.restore()
    msg = str(err.value)
    assert "no usable checkpoint" in msg
    assert re.search(r"step 4 in .*is missing", msg), msg
    assert re.search(r"step 2 in .*failed its checksum", msg), msg
    assert all(torch.equal(v, init[k]) for k, v in model.state_dict().items())
    ckpt.close()


@pytest.mark.parametrize("tamper, why", [
    (lambda m: m["skeleton"]["model"].update({"0.weight": {"__t__": "model/0.wEight"}}), "skeleton is malformed"),
    (lambda m: m["tensors"]["model/0.weight"].update(nbytes=12), "inconsistent shape"),
    (lambda m: m.update(skeleton=[1, 2]), "skeleton is malformed"),
])
def test_a_manifest_that_parses_but_does_not_add_up_falls_back(ckpts, mlp_state, tamper, why):
    """A manifest that is valid JSON but inconsistent is rejected like a corrupt shard.

    Real: the committed checkpoints, restore and ``cfdist.load``. Faked: step 4's manifest
    edited (a skeleton naming a tensor that is not there, a size that does not match the shape,
    a skeleton that is not a dict).
    The point: no KeyError/RuntimeError escapes; restore warns why and loads step 2.
    """
    url, root = ckpts
    man = root / step_dir(4) / MANIFEST
    m = json.loads(man.read_text())
    tamper(m)
    man.write_bytes(seal_manifest(m))   # re-sealed: the checks behind the manifest checksum
    with pytest.raises(CheckpointError, match=why):
        cfdist.load(url, step=4)
    step, warned, model, _ = restore_fresh(url, mlp_state)
    assert step == 2 and len(warned) == 1 and why in warned[0], warned
    assert_model_is_step(model, url, 2)


def test_a_flipped_small_value_in_the_manifest_fails_its_checksum(ckpts, mlp_state):
    """A bit flip in a plain value (the scheduler's lr) is caught like one in a tensor.

    Real: committed checkpoints, restore. Faked: step 4's manifest edited without re-sealing.
    The point: load refuses step 4 naming the manifest checksum; restore falls back to step 2.
    """
    url, root = ckpts
    man = root / step_dir(4) / MANIFEST
    m = json.loads(man.read_text())
    m["epoch_end"] = not m.get("epoch_end")
    man.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="manifest failed its checksum"):
        cfdist.load(url, step=4)
    step, warned, model, _ = restore_fresh(url, mlp_state)
    assert step == 2 and len(warned) == 1 and "manifest failed its checksum" in warned[0], warned
    assert_model_is_step(model, url, 2)


@pytest.mark.parametrize("what", ["shard->/etc/passwd", "shard->outside copy", "manifest->outside copy", "step dir"])
def test_symlinks_out_of_the_checkpoint_directory_are_refused(ckpts, mlp_state, train, tmp_path, what):
    """A shard, manifest or step directory that is a symlink leading outside its checkpoint
    directory is refused, even when its target is a perfectly valid file.

    Real: restore, ``cfdist.load`` and retention on real files and symlinks. Faked: the
    planted symlinks (to /etc/passwd, or to an exact copy of the original placed outside).
    The point: ``CheckpointError`` naming the link and where it resolves; restore falls back to
    step 2; after training on, the link target outside is unchanged (nothing written through it).
    """
    url, root = ckpts
    d4 = root / step_dir(4)
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "step dir":
        target = outside / step_dir(4)
        d4.rename(target)
        d4.symlink_to(target, target_is_directory=True)
        watched = target / SHARD
    else:
        name = SHARD if what.startswith("shard") else MANIFEST
        if what == "shard->/etc/passwd":
            target = pathlib.Path("/etc/passwd")
        else:
            target = outside / name
            target.write_bytes((d4 / name).read_bytes())
        (d4 / name).unlink()
        (d4 / name).symlink_to(target)
        watched = target
    before = watched.read_bytes()
    with pytest.raises(CheckpointError, match="outside its checkpoint directory"):
        cfdist.load(url, step=4)
    step, warned, model, ckpt = restore_fresh(url, mlp_state)
    assert step == 2 and len(warned) == 1 and "outside its checkpoint directory" in warned[0]
    train(model, ckpt.state["optim"], ckpt, 2, ckpt.state["sched"])
    ckpt.close()
    assert watched.read_bytes() == before
