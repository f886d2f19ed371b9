"""Finding, verifying and reading committed checkpoints; sweeping leftovers; copying between tiers.

A step counts only if ``step-XXXXXXXXX/MANIFEST.json`` exists on root 0. Reading never unpickles:
shards are parsed as safetensors (header JSON + raw bytes), every tensor's xxh3-64 is checked
against the manifest, and every path comes from a validated manifest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
import xxhash

from cfdist.checkpoint.format import (
    MANIFEST, ST_TO_TORCH, TMP_MARK, CheckpointError, check_seal, parse_safetensors_header, parse_step_dir,
    seal_manifest, step_dir, validate_manifest,
)
from cfdist.checkpoint import codecs
from cfdist.checkpoint.flatten import unflatten
from cfdist.storage import Storage, open_storages

log = logging.getLogger("cfdist.discovery")


LATEST_HINT = "LATEST.json"
"""Written (atomically, best effort) after each commit: ``{"step": N}``. Only a hint: a step
counts only if its manifest exists. It lets discovery see a commit that a lagging object-store
listing does not show yet (listings may lag behind writes; reading a key does not)."""


def is_committed(storage: Storage, step: int) -> bool:
    """Whether ``step`` has a manifest on this (root-0) storage: asks for the key itself, so it is
    right even while a listing lags behind writes. Use it to check the step just written."""
    return storage.exists(f"{step_dir(step)}/{MANIFEST}")


def _hinted_step(storage: Storage) -> int | None:
    try:
        step = json.loads(storage.read_bytes(LATEST_HINT)).get("step")
    except (OSError, ValueError, AttributeError):   # missing, unreadable, malformed: no hint
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def committed_steps(storage: Storage) -> list[int]:
    """Steps with a manifest on this (root-0) storage, oldest first.

    The listing plus the step named by :data:`LATEST_HINT` when its manifest exists, so that a
    commit a lagging listing hides is not taken for a missing checkpoint.
    """
    steps = set()
    for name in storage.listdir(""):
        s = parse_step_dir(name)
        if s is not None and storage.exists(f"{name}/{MANIFEST}"):
            steps.add(s)
    hinted = _hinted_step(storage)
    if hinted is not None and hinted not in steps and is_committed(storage, hinted):
        steps.add(hinted)
    return sorted(steps)


def sweep(storages: list[Storage]) -> list[str]:
    """Remove what crashed persists left: staging dirs, and step dirs never committed on root 0.

    Call once at start, from the single writer of these storages, before its first persist.
    """
    committed = set(committed_steps(storages[0]))
    removed = []
    for st in storages:
        for name in st.listdir(""):
            step = parse_step_dir(name)
            if TMP_MARK in name and (parse_step_dir(name.split(TMP_MARK)[0]) is not None
                                     or name.split(TMP_MARK)[0].endswith(".json")):
                st.remove(name)   # a staging dir, or the tmp file of a small write_atomic (hint, history)
                removed.append(st.url_of(name))
            elif step is not None and step not in committed and not is_committed(storages[0], step):
                st.remove(name)   # asked by key too: a lagging listing may hide a fresh commit
                removed.append(st.url_of(name))
    if removed:
        log.info("swept %d uncommitted leftovers: %s", len(removed), ", ".join(removed))
    return removed


def read_manifest(storages: list[Storage], step: int) -> dict:
    where = storages[0].url_of(f"{step_dir(step)}/{MANIFEST}")
    try:
        raw = storages[0].read_bytes(f"{step_dir(step)}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist: step {step} was never committed") from None
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e})") from None
    m = validate_manifest(m, where=where)
    check_seal(m, where=where)
    if int(m["step"]) != step:
        raise CheckpointError(f"{where} says step {m['step']}, expected {step}")
    if max(s["root"] for s in m["shards"]) >= len(storages):
        raise CheckpointError(f"{where} is striped over {1 + max(s['root'] for s in m['shards'])} roots "
                              f"but only {len(storages)} storage URL(s) were given; pass all of them")
    return m


def read_tensors(storages: list[Storage], step: int, manifest: dict, *, verify: bool = True,
                 names: set[str] | None = None, decode: bool = True) -> dict[str, torch.Tensor]:
    """Read (and checksum) the tensors of a committed checkpoint into fresh CPU tensors;
    ``decode=False`` leaves the tensors that codecs encoded as their stored uint8 bytes."""
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[int, list[str]] = {}
    for name, t in manifest["tensors"].items():
        if names is None or name in names:
            by_shard.setdefault(t["shard"], []).append(name)
    for i, tnames in sorted(by_shard.items()):
        sh = manifest["shards"][i]
        st = storages[sh["root"]]
        rel = f"{step_dir(step)}/{sh['file']}"
        where = st.url_of(rel)
        try:
            raw = bytearray(st.read_bytes(rel))
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing") from None
        start, hdr = parse_safetensors_header(bytes(raw[:min(len(raw), 100 << 20)]), where=where)
        data = memoryview(raw)[start:]
        for name in tnames:
            t = manifest["tensors"][name]
            h = hdr.get(name)
            a, b = t["offset"], t["offset"] + t["nbytes"]
            if not h or h.get("data_offsets") != [a, b] or h.get("dtype") != t["dtype"] or h.get("shape") != t["shape"]:
                raise CheckpointError(f"{where}: tensor {name!r} in the file does not match the manifest")
            if b > len(data):
                raise CheckpointError(f"{where} is truncated: tensor {name!r} ends at byte {b}, "
                                      f"the data section has {len(data)}")
            chunk = data[a:b]
            if verify and "xxh3" in t:
                got = xxhash.xxh3_64_hexdigest(chunk)
                if got != t["xxh3"]:
                    raise CheckpointError(f"{where}: tensor {name!r} failed its checksum "
                                          f"({got} != {t['xxh3']})")
            dtype = ST_TO_TORCH[t["dtype"]]
            if t["nbytes"] == 0:
                out[name] = torch.empty(t["shape"], dtype=dtype)
            else:
                out[name] = torch.frombuffer(chunk, dtype=torch.uint8).view(dtype).reshape(t["shape"])
    return codecs.decode_tensors(storages, step, manifest, out, verify=verify) if decode else out


def decode_state(manifest: dict, tensors: dict[str, torch.Tensor], *, where: str) -> tuple[dict, dict]:
    """``(state, rng)`` of a verified checkpoint: the skeleton filled with its tensors, plus the
    late state; ``CheckpointError`` if the skeleton is malformed (names a missing tensor, ...)."""
    try:
        state = unflatten(manifest["skeleton"], tensors)
        if not isinstance(state, dict):
            raise TypeError(f"the state is a {type(state).__name__}, not a dict")
        state.update(unflatten(manifest.get("late", {}), {}))
        rng = unflatten(manifest.get("rng", {}), {})
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{where}: the manifest's state skeleton is malformed "
                              f"({type(e).__name__}: {e})") from None
    return state, rng


def load_verified(storages: list[Storage], step: int, *, verify: bool = True) -> tuple[dict, dict]:
    """(manifest, tensors) of one committed checkpoint; CheckpointError if anything is off."""
    m = read_manifest(storages, step)
    return m, read_tensors(storages, step, m, verify=verify)


@dataclass(frozen=True)
class Candidate:
    step: int
    tier: int
    storages: list


def candidates(tiers: list[list[Storage]]) -> list[Candidate]:
    """Every committed step of every tier, newest first; ties go to the earlier (faster) tier."""
    out = []
    for i, sts in enumerate(tiers):
        try:
            steps = committed_steps(sts[0])
        except OSError as e:
            log.warning("cannot list %s: %s; skipping that tier", sts[0].url, e)
            continue
        out += [Candidate(s, i, sts) for s in steps]
    return sorted(out, key=lambda c: (-c.step, c.tier))


def find_latest(tiers: list[list[Storage]]) -> Candidate | None:
    """The newest committed step across tiers (not verified; see ``load_verified``)."""
    c = candidates(tiers)
    return c[0] if c else None


def copy_checkpoint(src: list[Storage], step: int, dst: list[Storage]) -> None:
    """Copy a committed checkpoint between tiers with the same commit protocol (manifest last).

    The steps a codec chain needs (``depends_on``) are copied first, unless ``dst`` has them."""
    m = read_manifest(src, step)
    have = set(committed_steps(dst[0])) if m.get("depends_on") else set()
    for dep, _ in m.get("depends_on", ()):
        if dep not in have:
            copy_checkpoint(src, dep, dst)
    final = step_dir(step)
    staging = {r: dst[r].staging_dir(final) for r in range(len(dst))}
    for sh in m["shards"]:
        r = sh["root"] % len(dst)
        data = src[sh["root"]].read_bytes(f"{final}/{sh['file']}")
        dst[r].write_file(f"{staging[r]}/{sh['file']}", [data])
        sh["root"] = r
    for r in range(1, len(dst)):
        if any(s["root"] == r for s in m["shards"]):
            dst[r].fsync_dir(staging[r])
            dst[r].publish(staging[r], final)
    m["roots"] = len(dst)
    dst[0].write_file(f"{staging[0]}/{MANIFEST}", [seal_manifest(m)])
    dst[0].fsync_dir(staging[0])
    dst[0].publish(staging[0], final)


# ---- public helpers ------------------------------------------------------------------------------

def list_checkpoints(storage, **storage_options) -> list[dict]:
    """Committed checkpoints in ``storage`` (URL or list of URLs), oldest first.

    Each: ``{"step", "epoch", "epoch_end", "time", "bytes", "url"}``. Reads only manifests.
    """
    sts = open_storages(storage, **storage_options)
    out = []
    for s in committed_steps(sts[0]):
        try:
            m = read_manifest(sts, s)
        except CheckpointError as e:
            log.warning("%s", e)
            continue
        out.append({"step": s, "epoch": m.get("epoch"), "epoch_end": bool(m.get("epoch_end")),
                    "time": m.get("time"), "bytes": m.get("bytes"), "url": sts[0].url_of(step_dir(s))})
    return out


def load(storage, step: int | None = None, *, verify: bool = True, **storage_options) -> dict:
    """A committed checkpoint as a plain nested dict (no live objects needed).

    ``{"step": ..., "epoch": ..., "state": {key: state_dict, ...}, "extra": {...}}`` where each
    state_dict holds CPU tensors: ``load(url)["state"]["model"]`` goes straight into
    ``model.load_state_dict``. ``step=None`` takes the newest that verifies.
    """
    sts = open_storages(storage, **storage_options)
    steps = [step] if step is not None else list(reversed(committed_steps(sts[0])))
    if not steps:
        raise CheckpointError(f"no committed checkpoint in {sts[0].url}")
    errors = []
    for s in steps:
        try:
            m, tensors = load_verified(sts, s, verify=verify)
            state, rng = decode_state(m, tensors, where=sts[0].url_of(step_dir(s)))
        except CheckpointError as e:
            if step is not None:
                raise
            errors.append(str(e))
            log.warning("%s; trying an older checkpoint", e)
            continue
        return {"step": s, "epoch": m.get("epoch"), "time": m.get("time"), "state": state, "rng": rng}
    raise CheckpointError(f"no usable checkpoint in {sts[0].url}: " + "; ".join(errors))
