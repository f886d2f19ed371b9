"""On-storage format: step directories, safetensors-compatible shards, the manifest.

::

    <storage>/
      step-000001200/
        MANIFEST.json                       # written last: the commit (on root 0 only)
        shard-00000-of-00002.safetensors    # on root 0
      (root 1)/step-000001200/shard-00001-of-00002.safetensors

A shard is a plain safetensors file (``safetensors.torch.load_file`` reads it): 8-byte
little-endian header length, JSON header (padded with spaces so that the data starts at a
multiple of 8 bytes, or of 4096 when the shard was written with ``O_DIRECT``), then the tensors'
bytes back to back, ordered by element size (largest first) so every tensor is aligned.
The manifest holds the skeleton of the state, every tensor's shard/offset/dtype/shape and its
xxh3-64 checksum, and the small state (iterator, RNG, scheduler, step, epoch).

**Sliced checkpoints** (``Checkpointer(writers="all" | N)``, :mod:`cfdist.checkpoint.slices`).
Writer ``w`` of ``N`` writes shard ``w*R + j`` of ``N*R`` on root ``j`` (``R`` roots); each of
its manifest ``shards`` entries adds ``"writer": w``. A tensor split between writers is stored
as 1-D ``U8`` pieces named ``<name>@bytes<start>`` (ordinary entries, each with its checksum),
and the manifest adds::

    "slicing": {"writers": 2, "align": 4096}
    "split":   {"<name>": {"dtype": "F32", "shape": [4096, 1024],
                           "pieces": [["<name>@bytes0", 0, 8388608], ["<name>@bytes8388608", 8388608, 16777216]]}}

Readers join the pieces (in order, tiling the tensor's bytes exactly) after their checksums.
A shared-tier checkpoint uploaded in slices by ``cfdist.fit``'s node actors also records
``"by": "nodes"`` and ``"nodes"`` (each writer's node name, writer 0 first) in ``"slicing"``.

**Codecs** (``Checkpointer(codecs=[...])``, :mod:`cfdist.checkpoint.codecs`). Without codecs
the format above is unchanged, byte for byte. With codecs, an encoded tensor stays in the same
shard, as a 1-D ``U8`` tensor of its encoded bytes (so the shard is still a valid safetensors
file, and offsets, sizes and checksums in the manifest describe the stored bytes as for any
tensor); its manifest entry adds::

    "codecs":  [{"name": "incremental", "ref": 1190, "ref_id": "...", ...},
                {"name": "quantize", "bits": 8, ...}, {"name": "zstd", "level": 3, "nbytes": ...}]
    "parts":   [[part name, numpy dtype, shape, offset, nbytes], ...]   # the payload's layout
    "logical": {"dtype": "F32", "shape": [1000000, 64]}                 # what decoding returns

Decoding applies the codecs in reverse order (zstd first); ``parts`` names only numeric numpy
dtypes. The manifest also gains ``ckpt_id`` (a random id: a chain refers to a step *and* its
id, so a step replaced by another run is never mistaken for the one encoded against),
``depends_on`` (``[[step, ckpt_id], ...]``: every checkpoint a restore of this one reads;
retention keeps them), ``codecs`` (the codecs and parameters of the Checkpointer) and
``bytes_stored``. ``safetensors.torch.load_file`` still opens such a shard, but encoded tensors
come out as their uint8 bytes: read them with ``cfdist.load``.

**Framed shards** (codecs under a host-memory budget, ``Checkpointer(host_memory=..., codecs=[...])``).
The snapshot streams through chunks and is encoded window by window, so a shard's encoded size
is known only once it was written: such a shard is ``shard-i-of-n.frames``, the tensors' bytes
back to back from byte 0 with no header (the manifest alone describes them; offsets, sizes and
checksums as above). A tensor no codec selects is stored as it is (at a multiple of 8 bytes).
An encoded tensor is still one contiguous 1-D ``U8`` range, cut into independently decoded
*frames*; its manifest entry has ``logical`` as above, ``codecs`` (the names of the codecs its
frames used, for readers that only ask which ones) and::

    "frames": [[offset, nbytes, start, count, shape, codecs, parts], ...]

``offset``/``nbytes``: the frame's bytes within the tensor's stored range; ``start``/``count``:
the elements of the flattened tensor it decodes to (the frames tile the tensor in order);
``shape``: the array the codecs saw (``[rows, ...]`` for whole rows, ``[1, n]`` for part of a
row at a window's edge); ``codecs``/``parts``: as for a whole tensor (``[]``/``null``: stored
raw). A chain codec's frame decodes against the same elements of its reference.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

import torch

FORMAT = "cfdist/1"
MANIFEST = "MANIFEST.json"
STEP_RE = re.compile(r"^step-(\d{9,})$")
SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.(safetensors|frames)$")
FRAMES_EXT = ".frames"
"""A shard written with codecs under a host-memory budget: no header (see the module doc)."""
TMP_MARK = ".tmp-"

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
ST_TO_TORCH = {v: k for k, v in ST_DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint is unusable: missing, uncommitted, corrupted, unsafe or incompatible."""


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(i: int, n: int, *, framed: bool = False) -> str:
    return f"shard-{i:05d}-of-{n:05d}" + (FRAMES_EXT if framed else ".safetensors")


def is_framed(file: str) -> bool:
    """Whether a manifest's shard file is a framed shard (no safetensors header)."""
    return file.endswith(FRAMES_EXT)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives: its shard, its byte range inside the shard's data section."""

    name: str
    shard: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self, checksum: str | None) -> dict:
        d = {"shard": self.shard, "dtype": ST_DTYPES[self.dtype], "shape": list(self.shape),
             "offset": self.offset, "nbytes": self.nbytes}
        if checksum is not None:
            d["xxh3"] = checksum
        return d


def safetensors_header(entries: list[TensorEntry], metadata: dict[str, str] | None = None, *,
                       align: int = 8) -> bytes:
    """The 8-byte length + JSON header for one shard whose entries are back to back from 0.

    The JSON is padded with spaces so that the data section starts at a multiple of ``align``
    (8: safetensors' own rule; 4096 for ``O_DIRECT`` writes straight from the arena). Trailing
    spaces are valid JSON: every safetensors reader (and :func:`parse_safetensors_header`)
    reads such a header."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for e in entries:
        hdr[e.name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [e.offset, e.offset + e.nbytes]}
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


MAX_HEADER = 100 << 20
"""Largest safetensors header accepted (the ``safetensors`` library's own limit)."""


def parse_safetensors_header(head: bytes | bytearray, *, where: str) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file's first bytes. Refuses anything else.

    ``head`` holds at least the 8-byte length and the header (the whole file will do). Every
    entry is checked: a known dtype, a shape of counts, ``data_offsets`` whose length equals
    dtype size x shape. Whether the offsets fit the file is the reader's check (it knows the size).
    """
    if len(head) < 8:
        raise CheckpointError(f"{where} is not a safetensors file (only {len(head)} bytes)")
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if n > MAX_HEADER or 8 + n > len(head):
        raise CheckpointError(f"{where} is not a safetensors file (header length {n} is implausible "
                              f"or truncated); it may be a pickle or a corrupted file")
    try:
        hdr = json.loads(bytes(head[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not a safetensors file: header is not JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{where} is not a safetensors file: its header nests too deeply") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{where} is not a safetensors file: header is not an object")
    for name, e in hdr.items():
        if name == "__metadata__":
            if not (isinstance(e, dict) and all(isinstance(v, str) for v in e.values())):
                raise CheckpointError(f"{where}: safetensors __metadata__ must map strings to strings")
            continue
        dt = e.get("dtype") if isinstance(e, dict) else None
        shape = e.get("shape") if isinstance(e, dict) else None
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(dt, str) and dt in ST_TO_TORCH and _is_shape(shape) and isinstance(offs, list) and len(offs) == 2
                and all(_is_count(o) for o in offs) and offs[1] - offs[0] == _nbytes(dt, shape)):
            raise CheckpointError(f"{where}: safetensors entry {name!r} is malformed (dtype {dt!r}, shape "
                                  f"{shape!r}, data_offsets {offs!r}: the byte range must be dtype size x shape)")
    return 8 + n, hdr


SEAL = "manifest_xxh3"


def _canonical(m: dict) -> bytes:
    return json.dumps({k: v for k, v in m.items() if k != SEAL}, sort_keys=True, separators=(",", ":")).encode()


def seal_manifest(m: dict) -> bytes:
    """The manifest's bytes with a checksum of its own content, so a flipped bit in a small
    value (lr, iterator position, RNG) is caught like a flipped bit in a tensor."""
    import xxhash

    m = dict(m)
    m[SEAL] = xxhash.xxh3_64_hexdigest(_canonical(m))
    return json.dumps(m).encode()


def check_seal(m: dict, *, where: str) -> None:
    import xxhash

    if SEAL not in m:
        raise CheckpointError(f"{where}: manifest has no {SEAL!r}; it was not written by cfdist or was edited")
    try:
        got = xxhash.xxh3_64_hexdigest(_canonical(m))
    except (RecursionError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: manifest cannot be checksummed ({type(e).__name__}: {e})") from None
    if got != m[SEAL]:
        raise CheckpointError(f"{where}: manifest failed its checksum ({got} != {m[SEAL]})")


def validate_manifest(m: object, *, where: str) -> dict:
    """Structural checks on a parsed manifest; every path it names must stay inside the step dir."""
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: manifest is not a JSON object")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: unknown checkpoint format {m.get('format')!r} (this cfdist reads {FORMAT!r})")
    for key in ("step", "shards", "tensors", "skeleton"):
        if key not in m:
            raise CheckpointError(f"{where}: manifest lacks {key!r}")
    if not _is_count(m["step"]):
        raise CheckpointError(f"{where}: manifest has an invalid step {m['step']!r}")
    if not isinstance(m["tensors"], dict):
        raise CheckpointError(f"{where}: manifest's tensors are not an object")
    shards = m["shards"]
    if not isinstance(shards, list) or not shards:
        raise CheckpointError(f"{where}: manifest has no shards")
    for i, s in enumerate(shards):
        f = s.get("file") if isinstance(s, dict) else None
        if not isinstance(f, str) or not SHARD_RE.match(f) or "/" in f or "\\" in f:
            raise CheckpointError(f"{where}: manifest names an unsafe or unexpected shard file {f!r}; "
                                  f"refusing to read it (shard files must look like shard-00000-of-00001.safetensors)")
        if not _is_count(s.get("root")):
            raise CheckpointError(f"{where}: shard {i} has an invalid root index {s.get('root')!r}")
    for name, t in m["tensors"].items():
        if not isinstance(t, dict) or not isinstance(t.get("shard"), int) or not 0 <= t["shard"] < len(shards):
            raise CheckpointError(f"{where}: tensor {name!r} points at a shard that does not exist")
        if not isinstance(t.get("dtype"), str) or t["dtype"] not in ST_TO_TORCH:
            raise CheckpointError(f"{where}: tensor {name!r} has unknown dtype {t.get('dtype')!r}")
        shape, off, nb = t.get("shape"), t.get("offset"), t.get("nbytes")
        if not (_is_shape(shape) and _is_count(off) and _is_count(nb) and nb == _nbytes(t["dtype"], shape)):
            raise CheckpointError(f"{where}: tensor {name!r} has an inconsistent shape {shape!r}, "
                                  f"offset {off!r} or size {nb!r}")
    return m


_INT64 = 1 << 63


def _is_count(v: object) -> bool:
    """A non-negative int that fits an int64 (torch sizes and file offsets)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _INT64


def _is_shape(v: object) -> bool:
    """A list of at most 64 counts whose product (zeros counted as 1) fits an int64, so torch's
    size and stride arithmetic cannot overflow even for an empty tensor."""
    return (isinstance(v, list) and len(v) <= 64 and all(_is_count(d) for d in v)
            and math.prod(max(d, 1) for d in v) < _INT64)


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * ST_TO_TORCH[dtype].itemsize
