"""Encoding a shard in the persist path, and decoding a checkpoint's tensors at read time.

The two hooks the rest of the checkpoint layer calls:

* :func:`begin` / :func:`encode_shard` / :meth:`EncodeSession.commit`, from
  :func:`cfdist.checkpoint.persist.write_checkpoint` (writer thread, writer process or node
  actor; never the training thread's gate);
* :func:`decode_tensors`, from :func:`cfdist.checkpoint.discovery.read_tensors` (the older steps a
  chain refers to are read through :mod:`cfdist.checkpoint.reader`, below discovery).
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cfdist.checkpoint.codecs import chain as chain_mod
from cfdist.checkpoint.codecs.base import REGISTRY, Codec, DecodeContext, pack_parts, raw_np_dtype, unpack_parts
from cfdist.checkpoint.format import ST_DTYPES, ST_TO_TORCH, CheckpointError, TensorEntry, step_dir
from cfdist.checkpoint.reader import read_manifest, read_stored

log = logging.getLogger("cfdist.codecs")


class ChainBroken(CheckpointError):
    """A checkpoint needs an earlier one of its codec chain (``broken``) that is unusable."""

    def __init__(self, msg: str, *, broken: int, cause: str):
        super().__init__(msg)
        self.broken, self.cause = broken, cause


class LossyCheckpointWarning(UserWarning):
    """A checkpoint written with lossy codecs was restored: the resume is not bit-exact."""


def validate_codecs(codecs) -> tuple[Codec, ...]:
    """The ``codecs=[...]`` argument as a tuple; at most one codec of each class."""
    codecs = tuple(codecs or ())
    seen = set()
    for c in codecs:
        if not isinstance(c, Codec):
            raise TypeError(f"codecs must be cfdist.codecs objects (Zstd(), Incremental(), Quantize(), "
                            f"LCDelta()), got {c!r}")
        if type(c) in seen:
            raise ValueError(f"codecs lists {type(c).__name__} twice; give each codec once "
                             f"(use its match= to choose tensors)")
        seen.add(type(c))
    return codecs


def resolve_codecs(codecs, *, mtbf_s: float | None, history: dict | None) -> tuple[Codec, ...]:
    """Validate ``codecs`` and resolve ``Quantize(bits="auto")`` with ``mtbf_s``, the MTBF the
    policy uses (``cfdist.Auto``'s, given or estimated), or when it is None with the MTBF of the
    run's restart history."""
    import time

    from cfdist.checkpoint.codecs.quantize import Quantize
    from cfdist.policy.freq import estimate_mtbf

    codecs = validate_codecs(codecs)
    if not any(isinstance(c, Quantize) and c.bits == "auto" for c in codecs):
        return codecs
    mtbf = mtbf_s
    if mtbf is None and history:
        mtbf = estimate_mtbf([r["time"] for r in history.get("restarts", []) if "time" in r], now_s=time.time())
    return tuple(c.resolve(mtbf_s=mtbf) if isinstance(c, Quantize) else c for c in codecs)


# ---- encode ------------------------------------------------------------------------------------

class EncodeSession:
    """The codecs' side of one persist: chain decisions, and what changes once it committed."""

    def __init__(self, storage, step: int, codecs: tuple[Codec, ...], session: str):
        self.codecs, self.step = codecs, step
        states = chain_mod.states_for(storage.url, session)
        self.plans = {c.name: chain_mod.ChainPlan(c, states.setdefault(c.name, chain_mod.ChainState()),
                                                  storage, step, bool(c.consecutive))
                      for c in codecs if c.kind == "chain"}
        for p in self.plans.values():
            if p.full:
                log.debug("%s: step %d is full (%s)", p.codec.name, step, p.reason)
        self.ckpt_id = uuid.uuid4().hex
        self.logical = 0
        self.stored = 0
        self._lock = threading.Lock()

    def pipeline(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]):
        chain = next((c for c in self.codecs if c.kind == "chain" and c.selects(name, dtype, shape)), None)
        value = next((c for c in self.codecs if c.kind == "value" and c.selects(name, dtype, shape)), None)
        if chain is not None and chain.lossy:
            value = None            # LCDelta quantizes already
        byte = next((c for c in self.codecs if c.kind == "bytes" and c.selects(name, dtype, shape)), None)
        return chain, value, byte

    def manifest_fields(self) -> dict:
        deps = sorted({tuple(d) for p in self.plans.values() for d in p.depends_on()})
        return {"ckpt_id": self.ckpt_id, "depends_on": [list(d) for d in deps],
                "codecs": [{"name": c.name, **c.params()} for c in self.codecs],
                "bytes_stored": self.stored}

    def commit(self) -> None:
        """Call once the checkpoint committed (the arenas must still hold its bytes)."""
        for p in self.plans.values():
            p.commit(self.step, self.ckpt_id)


def begin(storages, step: int, codecs, session: str | None) -> EncodeSession | None:
    """An encode session for one persist, or None without codecs (the plain format)."""
    if not codecs:
        return None
    return EncodeSession(storages[0], step, tuple(codecs), session or "default")


@dataclass
class EncodedShard:
    entries: list[TensorEntry]
    buffers: list
    extra: dict[str, dict]
    """Manifest fields per encoded tensor (codecs, parts layout, logical dtype and shape)."""

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def encode_shard(session: EncodeSession | None, entries: list[TensorEntry], arena: np.ndarray) -> EncodedShard:
    """Encode one shard's tensors from its arena (uint8). Without a session: the raw bytes,
    the entries unchanged (byte-for-byte the plain format)."""
    if session is None:
        return EncodedShard(entries, [memoryview(arena[e.offset:e.offset + e.nbytes]) for e in entries], {})
    items = []
    for e in entries:
        buf, extra = _encode_one(session, e, arena[e.offset:e.offset + e.nbytes])
        items.append((e, buf, extra))
    # Keep safetensors' alignment: wider dtypes first (encoded blobs are uint8, so they go last).
    items.sort(key=lambda it: -(it[0].dtype.itemsize if it[2] is None else 1))
    out_entries, bufs, extras, off = [], [], {}, 0
    for e, buf, extra in items:
        n = len(buf)
        if extra is None:
            out_entries.append(TensorEntry(e.name, e.shard, e.dtype, e.shape, off, n))
        else:
            out_entries.append(TensorEntry(e.name, e.shard, torch.uint8, (n,), off, n))
            extras[e.name] = extra
        bufs.append(buf)
        off += n
    with session._lock:
        session.logical += sum(e.nbytes for e in entries)
        session.stored += off
    return EncodedShard(out_entries, bufs, extras)


def _encode_one(session: EncodeSession, e: TensorEntry, raw: np.ndarray):
    codecs = session.pipeline(e.name, e.dtype, e.shape)
    if codecs == (None, None, None):
        return memoryview(raw), None
    chain = codecs[0]
    buf, metas, layout = _encode_array(codecs, e.name, e.dtype, raw.view(raw_np_dtype(e.dtype)).reshape(e.shape),
                                       session.plans[chain.name] if chain is not None else None)
    if not metas:
        return buf, None
    extra = {"codecs": metas, "logical": {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape)}}
    if layout is not None:
        extra["parts"] = layout
    return buf, extra


def _encode_array(codecs: tuple, name: str, dtype: torch.dtype, data: np.ndarray, plan):
    """``(bytes, codec metas, parts layout)`` of ``data`` (raw numpy dtype; a whole tensor or a
    frame of one) through the ``(chain, value, bytes)`` codecs; ``plan``: the chain codec's.
    No metas: ``bytes`` are ``data``'s own (a view of it), stored as they are."""
    chain, value, byte = codecs
    parts = {"data": data}
    metas = []
    if chain is not None:
        parts, m = chain.encode(name, parts, plan)
        if m:
            metas.append(m)
    if value is not None:
        parts, m = value.encode(name, parts, dtype)
        if m:
            metas.append(m)
    if metas:
        layout, bufs = pack_parts(parts)
        blob = b"".join(bufs)
    else:
        layout, blob = None, memoryview(data.reshape(-1).view(np.uint8))
    if byte is not None:
        z = byte.compress(blob)
        if z is not None:
            blob = z[0]
            metas.append(z[1])
    return (blob if isinstance(blob, memoryview) else memoryview(blob)), metas, (layout if metas else None)


def encode_work(codecs) -> float:
    """Host memory, in multiples of the input, that encoding one chunk holds beside the chunk:
    each codec's temporaries and output (:attr:`~cfdist.checkpoint.codecs.base.Codec.work`)
    and the packed parts; 0 without codecs. Under a host-memory budget each root's writer
    encodes one chunk at a time, and the budget sets this much aside for it."""
    codecs = tuple(codecs or ())
    return 1.0 + sum(c.work for c in codecs) if codecs else 0.0


class TensorFrames:
    """One tensor of a framed shard (codecs under a host-memory budget), encoded as the
    snapshot's windows stream by: each window's part of it becomes one or more frames, decoded
    independently (:func:`_decode_frames`). A frame is whole rows (dimension 0) of the tensor,
    or the part of one row at a window's edge (shape ``[1, n]``); a window holding the whole
    tensor gives one frame of its own shape (small tensors encode as they would whole).
    ``codecs`` is what the session chose for the tensor (chosen once, on the whole tensor's
    name, dtype and shape)."""

    def __init__(self, session: EncodeSession, e: TensorEntry):
        self.session, self.e = session, e
        self.codecs = session.pipeline(e.name, e.dtype, e.shape)
        self.encoded = self.codecs != (None, None, None)
        self.raw_dt = raw_np_dtype(e.dtype)
        self.frames: list[list] = []
        self.nbytes = 0
        self._names: set[str] = set()

    def _pieces(self, a: int, b: int):
        """``(start, stop, shape)`` of the frames for elements ``[a, b)``."""
        shape = tuple(self.e.shape)
        if a == 0 and b == math.prod(shape):
            yield a, b, shape
            return
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        if a % row:
            h = min(b, (a // row + 1) * row)
            yield a, h, (1, h - a)
            a = h
        k = (b - a) // row
        if k:
            yield a, a + k * row, (k,) + shape[1:]
            a += k * row
        if a < b:
            yield a, b, (1, b - a)

    def encode(self, lo: int, raw: np.ndarray) -> list[tuple[memoryview, bool]]:
        """Frames of the tensor's bytes ``[lo, lo + len(raw))`` (``raw``: uint8, a view of the
        chunk): ``[(bytes, is a view of raw)]``, in order; a view must stay in the chunk until
        it was written, the rest are the frames' own memory."""
        isz = self.raw_dt.itemsize
        first = lo // isz
        out = []
        chain = self.codecs[0]
        for a, b, shape in self._pieces(first, first + len(raw) // isz):
            data = raw[(a - first) * isz:(b - first) * isz].view(self.raw_dt).reshape(shape)
            plan = None
            if chain is not None:
                plan = chain_mod.FramePlan(self.session.plans[chain.name], self.e.shape, a, b, shape)
            buf, metas, layout = _encode_array(self.codecs, self.e.name, self.e.dtype, data, plan)
            self.frames.append([self.nbytes, len(buf), a, b - a, list(shape), metas, layout])
            self._names.update(m["name"] for m in metas)
            self.nbytes += len(buf)
            out.append((buf, not metas))
        return out

    def extra(self) -> dict:
        """The tensor's manifest fields beside its stored range (see :mod:`cfdist.checkpoint.format`)."""
        with self.session._lock:
            self.session.logical += self.e.nbytes
            self.session.stored += self.nbytes
        return {"codecs": [{"name": n} for n in sorted(self._names)], "frames": self.frames,
                "logical": {"dtype": ST_DTYPES[self.e.dtype], "shape": list(self.e.shape)}}


# ---- decode ------------------------------------------------------------------------------------

def is_encoded(manifest: dict) -> bool:
    return any("codecs" in t for t in manifest["tensors"].values())


def lossy_codecs(manifest: dict) -> list[str]:
    return sorted({m["name"] for t in manifest["tensors"].values() for m in t.get("codecs", ())
                   if m.get("name") in REGISTRY and REGISTRY[m["name"]].lossy})


def _decode_one(stored: torch.Tensor, t: dict, ctx: DecodeContext) -> np.ndarray:
    """One encoded tensor's raw numpy array (its logical shape, raw dtype)."""
    if "frames" in t:
        return _decode_frames(stored.numpy(), t["frames"], ctx)
    return _decode_blob(stored.numpy(), t["codecs"], t.get("parts"), ctx)


def _decode_frames(blob: np.ndarray, frames, ctx: DecodeContext) -> np.ndarray:
    """A framed tensor (:class:`TensorFrames`): each frame decoded on its own into its elements;
    a chain codec's frame against the same elements of its reference (decoded once per call)."""
    raw_dt = raw_np_dtype(ctx.dtype)
    n = math.prod(ctx.shape)
    out = np.empty(n, dtype=raw_dt)
    refs: dict = {}
    at = 0

    def load_ref(step, ckpt_id, start, stop, shape):
        if (step, ckpt_id) not in refs:
            refs[step, ckpt_id] = ctx.load_ref(step, ckpt_id).reshape(-1)
        return refs[step, ckpt_id][start:stop].reshape(shape)

    if not isinstance(frames, list):
        raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: frames are not a list")
    for f in frames:
        try:
            off, nb, start, count, shape, metas, layout = f
            ok = (all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, nb, start, count))
                  and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                  and math.prod(shape) == count and start == at and off + nb <= len(blob))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: frame {f!r} does not fit its "
                                  f"{len(blob)}-byte payload or does not follow element {at}")
        fctx = DecodeContext(ctx.name, ctx.dtype, tuple(shape), ctx.where,
                             lambda s, i, _a=start, _b=start + count, _sh=tuple(shape): load_ref(s, i, _a, _b, _sh))
        out[start:start + count] = _decode_blob(blob[off:off + nb], metas, layout, fctx).reshape(-1)
        at += count
    if at != n:
        raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: its frames hold {at} of {n} elements")
    return out.reshape(ctx.shape)


def _decode_blob(blob: np.ndarray, metas, layout, ctx: DecodeContext) -> np.ndarray:
    """The raw numpy array (``ctx``'s shape) that codecs ``metas`` encoded into ``blob``."""
    if not isinstance(metas, list) or not all(isinstance(m, dict) and m.get("name") in REGISTRY for m in metas):
        raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r} names unknown codecs {metas!r}; "
                              f"it was written by a newer cfdist")
    metas = list(metas)
    if metas and metas[-1]["name"] == "zstd":
        blob = np.frombuffer(REGISTRY["zstd"].decompress(blob, metas.pop(), where=ctx.where), dtype=np.uint8)
    raw_dt = raw_np_dtype(ctx.dtype)
    if layout is not None:
        parts = unpack_parts(blob, layout, where=f"{ctx.where} tensor {ctx.name!r}")
    else:
        if len(blob) != math.prod(ctx.shape) * raw_dt.itemsize:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r} decodes to {len(blob)} bytes, "
                                  f"expected {ctx.shape} {ctx.dtype}")
        parts = {"data": blob.view(raw_dt)}
    for m in reversed(metas):
        parts = REGISTRY[m["name"]].decode(parts, m, ctx)
    data = parts["data"]
    if data.dtype != raw_dt or data.size != math.prod(ctx.shape):
        raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r} decodes to {data.size} {data.dtype} values, "
                              f"expected {ctx.shape} {ctx.dtype}")
    return data.reshape(ctx.shape)


def _decode(storages, step: int, manifest: dict, stored: dict, refs: dict, lossy: set, verify: bool) -> dict:
    """``{name: raw numpy}`` for the encoded tensors among ``stored``."""
    where = storages[0].url_of(step_dir(step))
    lossy.update(lossy_codecs(manifest))
    out = {}
    for name in stored:
        t = manifest["tensors"][name]
        if "codecs" not in t:
            continue
        lg = t.get("logical") or {}
        if lg.get("dtype") not in ST_TO_TORCH or not isinstance(lg.get("shape"), list):
            raise CheckpointError(f"{where}: tensor {name!r} has no valid logical dtype/shape")

        def load_ref(ref_step, ref_id, _name=name):
            return _load_ref(storages, step, ref_step, ref_id, _name, refs, lossy, verify)

        ctx = DecodeContext(name, ST_TO_TORCH[lg["dtype"]], tuple(lg["shape"]), where, load_ref)
        out[name] = _decode_one(stored[name], t, ctx)
    return out


def decode_tensors(storages, step: int, manifest: dict, stored: dict[str, torch.Tensor], *,
                   verify: bool = True) -> dict[str, torch.Tensor]:
    """Decode what :func:`~cfdist.checkpoint.reader.read_stored` read (verified bytes).

    Tensors without codecs pass through untouched. Chain codecs read the steps they refer to
    (each step once per call; their stored bytes stay in memory until it returns); a
    missing, corrupt or replaced step raises ``CheckpointError`` naming it. Warns
    (:class:`LossyCheckpointWarning`) once per call when a lossy codec is involved.
    """
    if not is_encoded(manifest):
        return stored
    lossy: set = set()
    decoded = _decode(storages, step, manifest, stored, {}, lossy, verify)
    out = dict(stored)
    for name, arr in decoded.items():
        out[name] = from_raw_numpy(arr, ST_TO_TORCH[manifest["tensors"][name]["logical"]["dtype"]])
    if lossy:
        warnings.warn(f"checkpoint step {step} in {storages[0].url} was written with lossy codecs "
                      f"({', '.join(sorted(lossy))}): the resume is not bit-exact", LossyCheckpointWarning,
                      stacklevel=3)
    return out


def _load_ref(storages, step: int, ref_step: int, ref_id: str, name: str, refs: dict, lossy: set,
              verify: bool) -> np.ndarray:
    """Tensor ``name`` as step ``ref_step`` decodes it (raw numpy)."""
    try:
        if not (isinstance(ref_step, int) and ref_step < step):
            raise CheckpointError(f"step {ref_step!r} is not older")
        if ref_step not in refs:
            m = read_manifest(storages, ref_step)
            refs[ref_step] = (m, read_stored(storages, ref_step, m, verify=verify))
        m, stored = refs[ref_step]
        if m.get("ckpt_id") != ref_id:
            raise CheckpointError(f"it is not the checkpoint it was encoded against (id {m.get('ckpt_id')} "
                                  f"!= {ref_id}): another run replaced it")
        if name not in stored:
            raise CheckpointError(f"it has no tensor {name!r}")
        t = stored[name]
        if "codecs" not in m["tensors"][name]:
            return to_raw_numpy(t)
        return _decode(storages, ref_step, m, {name: t}, refs, lossy, verify)[name]
    except ChainBroken as e:
        raise ChainBroken(f"step {step} in {storages[0].url} needs step {e.broken} (through step {ref_step}), "
                          f"which is unusable: {e.cause}; steps from {e.broken} to {step} of this chain are lost",
                          broken=e.broken, cause=e.cause) from None
    except CheckpointError as e:
        raise ChainBroken(f"step {step} in {storages[0].url} needs step {ref_step} (tensor {name!r} is encoded "
                          f"against it), which is unusable: {e}; steps from {ref_step} to {step} of this chain "
                          f"are lost", broken=ref_step, cause=str(e)) from None


def to_raw_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bits as a numpy array of its raw dtype (shares memory)."""
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()]).numpy().view(raw_np_dtype(t.dtype))
    return t.numpy()


def from_raw_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    a = np.ascontiguousarray(a if a.flags.writeable else a.copy()).reshape(a.shape)   # (keeps 0-d 0-d)
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        a = a.view({1: np.uint8, 2: np.int16}[a.itemsize])
    return torch.from_numpy(a).view(dtype)
