"""``cfdist.codecs``: the public name of :mod:`cfdist.checkpoint.codecs` (checkpoint layer)."""

from cfdist.checkpoint.codecs import Codec, Incremental, LCDelta, LossyCheckpointWarning, Quantize, Zstd

__all__ = ["Codec", "Incremental", "LCDelta", "LossyCheckpointWarning", "Quantize", "Zstd"]
