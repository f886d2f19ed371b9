"""Restore-time copy of one committed checkpoint from a rank that holds it to ranks that lack it.

Used by :meth:`cfdist.Checkpointer.restore` when the ranks' storages disagree (node-local disks:
one node's disk is empty or its copy is corrupted) and the restore agreement
(:func:`cfdist.checkpoint.agreement.agree_restore`) picked a step that some rank can load:
that rank sends the checkpoint's files (manifest and shards, as stored) over the default process
group -- once per start, never during training -- and each receiving rank puts them into a
private ``memory://`` storage and loads them through the ordinary path, checksums included.
"""

from __future__ import annotations

import json
import struct
import uuid

import torch

from cfdist.checkpoint.format import MANIFEST, CheckpointError, parse_step_dir, step_dir
from cfdist.storage import Storage, open_storages

CHUNK = 256 << 20
"""Bytes per broadcast (bounds the transfer buffer, on the GPU with NCCL)."""


def _device():
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bundle(storages: list[Storage], step: int) -> bytes:
    """The step's files (and those of the steps its codec chain depends on) as one blob:
    8-byte header length, JSON index, contents back to back."""
    top = storages[0].read_bytes(f"{step_dir(step)}/{MANIFEST}")
    files = []
    for s in [d[0] for d in json.loads(top).get("depends_on", ())] + [step]:
        d = step_dir(s)
        manifest = top if s == step else storages[0].read_bytes(f"{d}/{MANIFEST}")
        files.append((0, f"{d}/{MANIFEST}", manifest))
        for sh in json.loads(manifest)["shards"]:
            files.append((sh["root"], f"{d}/{sh['file']}", storages[sh["root"]].read_bytes(f"{d}/{sh['file']}")))
    index = json.dumps([[root, name, len(data)] for root, name, data in files]).encode()
    return b"".join([struct.pack("<Q", len(index)), index] + [data for _, _, data in files])


def _unbundle(blob: bytes, step: int) -> list[Storage]:
    (n,) = struct.unpack("<Q", blob[:8])
    index = json.loads(blob[8:8 + n])
    base = f"memory:///cfdist-peer-{uuid.uuid4().hex}"
    storages = open_storages([f"{base}/root{r}" for r in range(1 + max(r for r, _, _ in index))])
    files, pos = [], 8 + n
    for root, name, size in index:
        step_name, _, file = name.partition("/")
        if parse_step_dir(step_name) is None or "/" in file or file in ("", ".", ".."):
            raise CheckpointError(f"a peer sent step {step} with an unexpected file name {name!r}")
        files.append((root, name, blob[pos:pos + size]))
        pos += size
    for root, name, data in sorted(files, key=lambda f: f[1].endswith(MANIFEST)):   # manifests last
        storages[root].write_file(name, [data])
    return storages


def broadcast_checkpoint(step: int, src: int, storages: list[Storage] | None, *, need: bool) -> list[Storage] | None:
    """Collective over the default group: every rank calls it with the same ``step`` and
    ``src``; ``storages`` (on ``src``) hold the committed step. Returns, where ``need``, private
    ``memory://`` storages holding a copy (verify it with :func:`cfdist.checkpoint.discovery.load_verified` and
    :func:`forget` it after loading); None elsewhere. Blocks every rank for the transfer."""
    import torch.distributed as dist

    dev = _device()
    blob = _bundle(storages, step) if dist.get_rank() == src else None
    got = _broadcast_bytes(blob, src, dev, keep=need)
    return _unbundle(got, step) if need else None


def _broadcast_bytes(data: bytes | None, src: int, dev, *, keep: bool = True) -> bytes | None:
    """Collective over the default group: rank ``src`` sends ``data`` (its length first, then
    :data:`CHUNK`-sized pieces), and every rank returns it; with ``keep=False`` the pieces only
    pass through (None: this rank needs no copy)."""
    import torch.distributed as dist

    me = dist.get_rank()
    size = torch.tensor([len(data) if me == src else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    total, got = int(size.item()), bytearray()
    for off in range(0, total, CHUNK):
        n = min(CHUNK, total - off)
        if me == src:
            buf = torch.frombuffer(bytearray(data[off:off + n]), dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src)
        if keep and me != src:
            got += buf.cpu().numpy().tobytes()
    if not keep:
        return None
    return data if me == src else bytes(got)


def forget(storages: list[Storage], step: int) -> None:
    """Drop a received copy (and the chain it came with) from memory."""
    for st in storages:
        for name in st.listdir(""):
            if parse_step_dir(name) is not None:
                st.remove(name)



def broadcast_state(content: tuple[dict, dict] | None, src: int, *, why: str = "",
                    into: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """Collective over the default group: rank ``src`` sends ``content``, the ``(manifest,
    tensors)`` of a step held in its process (a survivor's live state,
    :meth:`cfdist.checkpoint.live.LiveState.content`), and every rank returns it (``src`` its
    own tensors, no copy; the others the tensors they received). Nothing touches storage: the
    manifest travels as JSON, the tensors in :data:`CHUNK` pieces, each large one straight
    into its destination (:data:`DIRECT_MIN`), the small ones packed into one buffer. ``src``
    with ``content=None`` makes every rank raise ``CheckpointError`` (``why`` says why it has
    none).

    ``into``: on a receiving rank, tensors by name to receive into in place (a replacement
    rank's own parameters and buffers: memory it touched already, where fresh buffers cost a
    page fault per page and a second copy at the apply); those whose dtype, shape or layout
    differ, and every name missing from it, get fresh CPU tensors. They are overwritten before
    the state is checked against the live objects: pass only tensors whose values may be lost."""
    import torch.distributed as dist

    dev = _device()
    me = dist.get_rank()
    if me == src:
        if content is None:
            header = json.dumps({"missing": why or "no live state"}).encode()
        else:
            manifest, tensors = content
            names = sorted(tensors)
            header = json.dumps({"manifest": manifest, "tensors": [
                [n, str(tensors[n].dtype).removeprefix("torch."), list(tensors[n].shape)] for n in names]}).encode()
    else:
        header = None
    head = json.loads(_broadcast_bytes(header, src, dev))
    if "missing" in head:
        raise CheckpointError(f"rank {src} holds no live state to restore from: {head['missing']}")
    if me == src:
        _broadcast_tensors([content[1][n] for n, _, _ in head["tensors"]], src, dev)
        return content
    out = {n: _destination(into.get(n) if into else None, getattr(torch, d), tuple(shape))
           for n, d, shape in head["tensors"]}
    _broadcast_tensors([out[n] for n, _, _ in head["tensors"]], src, dev)
    return head["manifest"], out


DIRECT_MIN = 1 << 20
"""Bytes from which a tensor travels on its own, straight from its place on the sender into its
place on the receivers (over gloo); smaller ones are packed into one buffer (one collective for
all of them, where an optimizer's hundreds of small tensors would cost a round trip each)."""


def _destination(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """``t`` (detached) when a broadcast can write into it in place, else a fresh CPU tensor."""
    if (t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.device.type == "cpu"
            and t.is_contiguous()):
        return t.detach()
    return torch.empty(shape, dtype=dtype)


def _direct(tensors: list[torch.Tensor], dev) -> list[bool]:
    """Which of ``tensors`` travel on their own (:data:`DIRECT_MIN`); decided from their sizes
    alone, the same on every rank. Over NCCL everything is packed (staged through the GPU)."""
    if dev.type != "cpu":
        return [False] * len(tensors)
    return [t.numel() * t.element_size() >= DIRECT_MIN for t in tensors]


def _broadcast_tensors(tensors: list[torch.Tensor], src: int, dev) -> None:
    """Broadcast ``tensors`` (the same shapes and dtypes on every rank; on ``src`` the values):
    the large ones on their own, in place, the rest as one byte buffer, all in :data:`CHUNK`
    pieces, filled back into them on the other ranks."""
    import torch.distributed as dist

    me = dist.get_rank()
    direct = _direct(tensors, dev)
    for t, d in zip(tensors, direct):
        if d:
            flat = t.detach().to(dev).contiguous().reshape(-1).view(torch.uint8)   # in place on receivers
            for off in range(0, flat.numel(), CHUNK):
                dist.broadcast(flat[off:off + CHUNK], src)
    packed = [t for t, d in zip(tensors, direct) if not d]
    sizes = [t.numel() * t.element_size() for t in packed]
    total = sum(sizes)
    if total == 0:
        return
    if me == src:
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else
                          torch.empty(0, dtype=torch.uint8) for t in packed]).to(dev)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
    for off in range(0, total, CHUNK):
        dist.broadcast(flat[off:off + CHUNK], src)
    if me == src:
        return
    flat = flat.cpu()
    pos = 0
    for t, n in zip(packed, sizes):
        if n:
            t.reshape(-1).view(torch.uint8).copy_(flat[pos:pos + n])
        pos += n
