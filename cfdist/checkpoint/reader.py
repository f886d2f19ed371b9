"""Reading one committed checkpoint as it is stored: which steps are committed, a step's manifest,
its tensors before codecs decode them.

The lowest reading layer of :mod:`cfdist.checkpoint`: it knows the on-storage format
(:mod:`~cfdist.checkpoint.format`) and how slices join (:mod:`~cfdist.checkpoint.slices`), and
nothing about codecs, tiers, fallback or retries (:mod:`~cfdist.checkpoint.discovery` builds
those on it; the codec pipeline reads the older steps a chain refers to through it). Reading never
unpickles, and never reads outside a step's own directory. Safe from any thread; blocks on storage.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os

import torch
import xxhash

from cfdist.checkpoint import slices
from cfdist.checkpoint.format import (
    MANIFEST, ST_TO_TORCH, CheckpointError, check_seal, is_framed, parse_safetensors_header, parse_step_dir,
    step_dir, validate_manifest,
)
from cfdist.storage import Storage

READERS = 8
"""Shard files one restore reads at once."""


LATEST_HINT = "LATEST.json"
"""Written (atomically, best effort) after each commit: ``{"step": N}``. Only a hint: a step
counts only if its manifest exists. It lets discovery see a commit that a lagging object-store
listing does not show yet (listings may lag behind writes; reading a key does not)."""


def map_shard_data(storages: list[Storage], step: int, files: list[tuple[int, str]]) -> list[torch.Tensor]:
    """The data sections of committed ``step``'s shard files ``[(root, file name)]`` on local
    storages, mapped (no copy; copy-on-write, so nothing can change them): uint8 tensors laid
    out like the arenas the step was written from, starting at a page boundary (local shards pad
    their header to it). A node actor writes its local tier from its memory tier's files this
    way when the snapshot was streamed and no arena holds it any more."""
    import mmap

    out = []
    for root, name in files:
        path = storages[root].path(f"{step_dir(step)}/{name}")
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        start, _ = parse_safetensors_header(mm[:8 + int.from_bytes(mm[:8], "little")], where=path)
        out.append(torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=len(mm) - start)
                   if len(mm) > start else torch.empty(0, dtype=torch.uint8))
    return out


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


def _read_inside(st: Storage, step: int, name: str, *, private: bool = False) -> bytes | memoryview:
    """The bytes of ``<step dir>/<name>``, refusing a file that resolves outside the step directory.

    A local shard or manifest that is a symlink (to /etc/passwd, to another checkpoint) is a
    content error: nothing outside a checkpoint's own directory is ever read. ``private``: a
    writable buffer of this process's own (:meth:`Storage.read_private`).
    """
    rel = f"{step_dir(step)}/{name}"
    if getattr(st, "is_local", False):   # (a frozen in-memory copy has no paths)
        want = os.path.join(os.path.realpath(st.root), step_dir(step), name)
        real = os.path.realpath(st.path(rel))
        if real != want and os.path.lexists(st.path(rel)):
            raise CheckpointError(f"{st.url_of(rel)} resolves to {real}, outside its checkpoint directory "
                                  f"(a symlink?); refusing to read it")
    try:
        return st.read_private(rel) if private else st.read_bytes(rel)
    except IsADirectoryError:
        raise CheckpointError(f"{st.url_of(rel)} is a directory, not a file") from None


def read_manifest(storages: list[Storage], step: int) -> dict:
    """The validated, seal-checked manifest of committed ``step``.

    ``CheckpointError`` for anything wrong with its content (missing, not JSON, malformed,
    checksum); an ``OSError`` from the storage propagates (the caller retries it).
    """
    where = storages[0].url_of(f"{step_dir(step)}/{MANIFEST}")
    try:
        raw = _read_inside(storages[0], step, MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist: step {step} was never committed") from None
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{where} is not a manifest: its JSON nests too deeply") from None
    m = validate_manifest(m, where=where)
    slices.check_split(m, where=where)
    check_seal(m, where=where)
    if int(m["step"]) != step:
        raise CheckpointError(f"{where} says step {m['step']}, expected {step}")
    if max(s["root"] for s in m["shards"]) >= len(storages):
        raise CheckpointError(f"{where} is striped over {1 + max(s['root'] for s in m['shards'])} roots "
                              f"but only {len(storages)} storage URL(s) were given; pass all of them")
    return m


def read_stored(storages: list[Storage], step: int, manifest: dict, *, verify: bool = True,
                names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Read (and checksum) the tensors of a committed checkpoint into fresh CPU tensors, as stored:
    the tensors that codecs encoded stay their stored uint8 bytes
    (:func:`cfdist.checkpoint.discovery.read_tensors` decodes them).

    Shard files are read in parallel (up to :data:`READERS` at a time), each once; the pieces
    of tensors split over the writers of a sliced checkpoint are joined after their checksums.
    """
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[int, list[str]] = {}
    split = manifest.get("split") or {}
    if names is not None:
        names = set(names) | {p[0] for n in names if n in split for p in split[n]["pieces"]}
    for name, t in manifest["tensors"].items():
        if names is None or name in names:
            by_shard.setdefault(t["shard"], []).append(name)

    def read_shard(i: int, tnames: list[str]) -> None:
        sh = manifest["shards"][i]
        st = storages[sh["root"]]
        rel = f"{step_dir(step)}/{sh['file']}"
        where = st.url_of(rel)
        try:
            # private: read once into this process's memory, and the tensors below are views of
            # it (one copy; never a map of the file, which the next persist may write over)
            raw = _read_inside(st, step, sh["file"], private=True)
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing") from None
        # a framed shard (codecs under a host-memory budget) has no header: the manifest alone
        # says where each tensor is, and its checksum below checks the bytes
        start, hdr = (0, None) if is_framed(sh["file"]) else parse_safetensors_header(raw, where=where)
        data = memoryview(raw)[start:]
        for name in tnames:
            t = manifest["tensors"][name]
            a, b = t["offset"], t["offset"] + t["nbytes"]
            h = hdr.get(name) if hdr is not None and name != "__metadata__" else None
            if hdr is not None and (not h or h.get("data_offsets") != [a, b] or h.get("dtype") != t["dtype"]
                                    or h.get("shape") != t["shape"]):
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
    if len(by_shard) > 1:
        with cf.ThreadPoolExecutor(min(READERS, len(by_shard)), thread_name_prefix="cfdist-read") as ex:
            for f in [ex.submit(read_shard, i, tn) for i, tn in sorted(by_shard.items())]:
                f.result()
    else:
        for i, tn in by_shard.items():
            read_shard(i, tn)
    return slices.join(manifest, out)
