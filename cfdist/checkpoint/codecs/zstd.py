"""``Zstd``: lossless zstandard compression of each encoded tensor (its serialized parts).

Per tensor, one zstd frame with the content size in its header; decoding refuses a frame
whose size differs from the one the manifest records (no decompression bombs). A tensor that
does not shrink is stored as it was (the manifest then names no ``zstd`` for it), so ``Zstd``
never makes a checkpoint bigger than a few header bytes per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cfdist.checkpoint.codecs.base import Codec, _patterns, matches, register
from cfdist.checkpoint.format import CheckpointError


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ImportError("cfdist.codecs.Zstd needs the zstandard package: pip install 'cfdist[zstd]'") from None
    return zstandard


@register
@dataclass(frozen=True)
class Zstd(Codec):
    """Lossless zstd compression of every selected tensor (default: all of them)."""

    level: int = 3
    """zstd level, 1 (fastest) .. 22 (smallest); 3 is zstd's default."""
    match: str | tuple[str, ...] | None = None
    """Glob(s) on tensor names (``"model/*"``); None selects every tensor."""
    threads: int = 0
    """zstd worker threads per tensor (0: compress on the persisting thread)."""

    kind: ClassVar[str] = "bytes"
    name: ClassVar[str] = "zstd"
    lossy: ClassVar[bool] = False
    work: ClassVar[float] = 1.0   # the frame (never larger than its input: else stored as it was)

    def __post_init__(self):
        if not (isinstance(self.level, int) and 1 <= self.level <= 22):
            raise ValueError(f"Zstd(level={self.level!r}): level must be an int in 1..22 (3 is the default)")
        if not (isinstance(self.threads, int) and self.threads >= 0):
            raise ValueError(f"Zstd(threads={self.threads!r}) must be an int >= 0")
        object.__setattr__(self, "_pats", _patterns(self.match))
        _zstd()

    def params(self) -> dict:
        return {"level": self.level}

    def selects(self, name, dtype, shape) -> bool:
        return matches(self._pats, name)

    def compress(self, data) -> tuple[bytes, dict] | None:
        """(frame, meta), or None when compressing does not shrink ``data``."""
        n = len(data)
        if n < 64:
            return None
        out = _zstd().ZstdCompressor(level=self.level, threads=self.threads).compress(data)
        if len(out) >= n:
            return None
        return out, {"name": self.name, "level": self.level, "nbytes": n}

    @staticmethod
    def decompress(frame, meta: dict, *, where: str) -> bytes:
        zstd = _zstd()
        n = meta.get("nbytes")
        try:
            out = zstd.ZstdDecompressor().decompress(frame, max_output_size=n)
        except zstd.ZstdError as e:
            raise CheckpointError(f"{where}: zstd frame does not decode ({e})") from None
        if len(out) != n:
            raise CheckpointError(f"{where}: zstd frame holds {len(out)} bytes, the manifest says {n}")
        return out
