"""Fuzz targets for the untrusted-checkpoint parsers, shared by the CI property tests
(``tests/unit/checkpoint/test_checkpoint_fuzz.py``, a few thousand cases) and ``bench/fuzz.py``
(millions).

Each target feeds one forged input through the real reading path on a ``memory://`` storage
(``discovery.read_manifest`` -> ``format.validate_manifest`` / ``check_seal``; ``discovery.read_tensors``
-> ``format.parse_safetensors_header``; ``discovery.decode_state``) and returns normally when the
outcome is acceptable: a result that is consistent with the file, or a ``CheckpointError``. Any
other exception propagates: that is a bug. Forged sizes must be refused before anything is
allocated from them, so results are checked to be no larger than the file they came from.
"""

from __future__ import annotations

import copy
import json
import struct
import uuid

import xxhash
from hypothesis import strategies as st

from cfdist.checkpoint import discovery
from cfdist.checkpoint.format import (
    FORMAT, MANIFEST, SEAL, CheckpointError, TensorEntry, parse_safetensors_header, safetensors_header,
    seal_manifest, shard_name, step_dir,
)
from cfdist.storage import open_storage

import torch

STEP = 7
SHARD = shard_name(0, 1)
_STORE = {}


def storage():
    """One ``memory://`` storage per process, reused by every case (files are overwritten)."""
    if "st" not in _STORE:
        _STORE["st"] = open_storage(f"memory://fuzz-{uuid.uuid4().hex[:8]}")
    return _STORE["st"]


def valid_checkpoint() -> tuple[dict, bytes]:
    """A small valid checkpoint: (manifest dict, shard bytes) with F32, I64, BOOL and empty tensors."""
    if "valid" not in _STORE:
        _STORE["valid"] = _build_valid()
    m, shard = _STORE["valid"]
    return copy.deepcopy(m), shard


def _build_valid() -> tuple[dict, bytes]:
    tensors = {"model/w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "model/b": torch.tensor([1, -2], dtype=torch.int64),
               "model/m": torch.tensor([True, False, True]),
               "model/e": torch.empty(0, 4)}
    entries, off, data = [], 0, b""
    for name, t in tensors.items():
        raw = t.numpy().tobytes()
        entries.append(TensorEntry(name=name, shard=0, dtype=t.dtype, shape=tuple(t.shape), offset=off,
                                   nbytes=len(raw)))
        off += len(raw)
        data += raw
    shard = safetensors_header(entries, {"format": "pt"}) + data
    m = {"format": FORMAT, "step": STEP, "epoch": 0, "epoch_end": False, "world_size": 1,
         "shards": [{"file": SHARD, "root": 0, "bytes": len(shard)}],
         "tensors": {e.name: e.to_json(xxhash.xxh3_64_hexdigest(data[e.offset:e.offset + e.nbytes]))
                     for e in entries},
         "skeleton": {"model": {k.split("/")[1]: {"__t__": k} for k in tensors}, "n": 3},
         "late": {"sched": {"last_epoch": 2}}, "rng": {}}
    return m, shard


def sliced_checkpoint() -> tuple[dict, bytes]:
    """A checkpoint of ``model/w`` alone, split into two U8 pieces, as ``writers="all"`` writes
    a tensor that a slice boundary crosses (both pieces in one file here: the reader does not care)."""
    if "sliced" not in _STORE:
        m, _ = _build_valid()
        w = m["tensors"].pop("model/w")
        tensors = {"model/w@bytes0": torch.arange(6, dtype=torch.float32)[:3].view(torch.uint8),
                   "model/w@bytes12": torch.arange(6, dtype=torch.float32)[3:].view(torch.uint8)}
        entries, off, data = [], 0, b""
        for name, t in tensors.items():
            raw = t.numpy().tobytes()
            entries.append(TensorEntry(name=name, shard=0, dtype=torch.uint8, shape=(len(raw),), offset=off,
                                       nbytes=len(raw)))
            off, data = off + len(raw), data + raw
        shard = safetensors_header(entries, {"format": "pt"}) + data
        m["tensors"] = {e.name: e.to_json(xxhash.xxh3_64_hexdigest(data[e.offset:e.offset + e.nbytes]))
                        for e in entries}
        m["skeleton"] = {"model": {"w": {"__t__": "model/w"}}, "n": 3}
        m["shards"][0]["bytes"] = len(shard)
        m["split"] = {"model/w": {"dtype": w["dtype"], "shape": w["shape"],
                                  "pieces": [["model/w@bytes0", 0, 12], ["model/w@bytes12", 12, 24]]}}
        m["slicing"] = {"writers": 2, "align": 4096}
        _STORE["sliced"] = m, shard
    m, shard = _STORE["sliced"]
    return copy.deepcopy(m), shard


def sliced_manifest_object(m: dict) -> None:
    """Target: a sliced checkpoint's manifest with its ``split`` (or anything) mutated, sealed."""
    _, shard = sliced_checkpoint()
    _put(seal_manifest(m), shard)
    _read_all(len(shard))


def _put(manifest_raw: bytes | None, shard: bytes | None) -> None:
    s = storage()
    d = step_dir(STEP)
    if manifest_raw is not None:
        s.write_file(f"{d}/{MANIFEST}", [manifest_raw], fsync=False)
    if shard is not None:
        s.write_file(f"{d}/{SHARD}", [shard], fsync=False)


def _read_all(shard_len: int) -> None:
    """The whole restore path on what is stored; checks the result against the file size."""
    sts = [storage()]
    try:
        m = discovery.read_manifest(sts, STEP)
        tensors = discovery.read_tensors(sts, STEP, m)
        discovery.decode_state(m, tensors, where="fuzz")
    except CheckpointError:
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total <= shard_len, f"{total} tensor bytes out of a {shard_len}-byte file"


def manifest_bytes(raw: bytes) -> None:
    """Target: arbitrary bytes as MANIFEST.json, next to a valid shard."""
    _, shard = valid_checkpoint()
    _put(raw, shard)
    _read_all(len(shard))


def manifest_object(m: object, *, seal: bool) -> None:
    """Target: an arbitrary JSON value as the manifest, sealed (so validation is reached) or not."""
    _, shard = valid_checkpoint()
    try:
        raw = seal_manifest(m) if seal and isinstance(m, dict) else json.dumps(m).encode()
    except (ValueError, RecursionError):
        return   # not JSON-serializable: cannot be a file's content
    _put(raw, shard)
    _read_all(len(shard))


def shard_bytes(shard: bytes) -> None:
    """Target: arbitrary bytes as the shard of a valid manifest."""
    m, _ = valid_checkpoint()
    _put(seal_manifest(m), shard)
    _read_all(len(shard))


def header_object(hdr: object, data: bytes, *, sync_manifest: bool) -> None:
    """Target: an arbitrary JSON header (+ data) as a safetensors file. ``sync_manifest``: the
    manifest is rewritten to agree with the header (so reading gets past the cross-check)."""
    raw = json.dumps(hdr).encode()
    shard = struct.pack("<Q", len(raw)) + raw + data
    m, _ = valid_checkpoint()
    try:
        start, parsed = parse_safetensors_header(shard, where="fuzz")
    except CheckpointError:
        parsed = None
    if sync_manifest and isinstance(parsed, dict):
        m["tensors"] = {k: {"shard": 0, "dtype": v["dtype"], "shape": v["shape"], "offset": v["data_offsets"][0],
                            "nbytes": v["data_offsets"][1] - v["data_offsets"][0]}
                        for k, v in parsed.items() if k != "__metadata__"}
        m["skeleton"] = {k: {"__t__": k} for k in m["tensors"]}
    _put(seal_manifest(m), shard)
    _read_all(len(shard))


# ---- strategies -----------------------------------------------------------------------------------

INTS = st.one_of(st.integers(-3, 70), st.integers(-2 ** 70, 2 ** 70),
                 st.sampled_from([2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from(["F32", "I64", "BOOL", "U8", "F8_E4M3", "PICKLE",
                                                           SHARD, "../x", "/etc/passwd", "__t__", "__small__"]))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)


@st.composite
def mutated_manifest(draw, sliced: bool = False) -> dict:
    """A valid manifest (``sliced``: :func:`sliced_checkpoint`'s, mutated under ``split``) with
    one to three values replaced (by path) with arbitrary JSON."""
    m, _ = sliced_checkpoint() if sliced else valid_checkpoint()
    root = m["split"] if sliced else m
    for _ in range(draw(st.integers(1, 3))):
        node, key = root, None
        for i in draw(st.lists(st.integers(0, 10), min_size=1, max_size=5)):
            keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = keys[i % len(keys)]
            child = node[key]
            if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
                break
            node, key = child, None
        if key is not None and key != SEAL:
            node[key] = draw(JSON)
    return m


@st.composite
def mutated_bytes(draw, base: bytes) -> bytes:
    """``base`` with flipped bytes, a cut, or inserted junk."""
    b = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "set8"]))
        if kind == "flip" and b:
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            b = b[:draw(st.integers(0, len(b)))]
        elif kind == "insert":
            i = draw(st.integers(0, len(b)))
            b[i:i] = draw(st.binary(max_size=16))
        elif kind == "set8" and len(b) >= 8:   # forge the header length
            b[:8] = struct.pack("<Q", draw(st.sampled_from([0, 1, 7, len(b), 2 ** 31, 2 ** 63, 2 ** 64 - 1,
                                                              100 << 20, (100 << 20) + 1])))
    return bytes(b)


@st.composite
def forged_header(draw) -> tuple[dict, bytes]:
    """A header of entries with arbitrary (often inconsistent) dtype/shape/offsets, and data."""
    n = draw(st.integers(0, 3))
    hdr = {}
    for i in range(n):
        e = {"dtype": draw(st.sampled_from(["F32", "I64", "BOOL", "U8", "F16", "C64", "X", 3])),
             "shape": draw(st.one_of(st.lists(INTS, max_size=4), JSON)),
             "data_offsets": draw(st.one_of(st.lists(INTS, min_size=2, max_size=2), JSON))}
        if draw(st.booleans()):   # make the byte range agree with dtype x shape where possible
            try:
                from cfdist.checkpoint.format import _nbytes
                a = draw(st.integers(0, 64))
                e["data_offsets"] = [a, a + _nbytes(e["dtype"], e["shape"])]
            except Exception:  # noqa: BLE001 - an unusable dtype/shape: keep the forged offsets
                pass
        hdr[f"model/t{i}"] = e
    if draw(st.booleans()):
        hdr["__metadata__"] = draw(JSON)
    return hdr, draw(st.binary(max_size=128))


MANIFEST_BYTES = st.one_of(st.binary(max_size=64),
                           mutated_bytes(seal_manifest(valid_checkpoint()[0])),
                           st.builds(lambda d: b"[" * d + b"]" * d, st.integers(1, 5_000)),
                           st.builds(lambda d: b'{"a":' * d + b"1" + b"}" * d, st.integers(1, 5_000)))
SHARD_BYTES = st.one_of(st.binary(max_size=64), mutated_bytes(valid_checkpoint()[1]))
