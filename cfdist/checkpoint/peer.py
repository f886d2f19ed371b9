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
    blob = _bundle(storages, step) if dist.get_rank() == src else b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    total, got = int(size.item()), bytearray()
    for off in range(0, total, CHUNK):
        n = min(CHUNK, total - off)
        if dist.get_rank() == src:
            buf = torch.frombuffer(bytearray(blob[off:off + n]), dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src)
        if need:
            got += buf.cpu().numpy().tobytes()
    return _unbundle(bytes(got), step) if need else None


def forget(storages: list[Storage], step: int) -> None:
    """Drop a received copy (and the chain it came with) from memory."""
    for st in storages:
        for name in st.listdir(""):
            if parse_step_dir(name) is not None:
                st.remove(name)

