"""Checkpoint codecs (``cfdist.codecs``): make checkpoints smaller, off the training thread.

::

    ckpt = cfdist.Checkpointer(state, storage, policy,
                               codecs=[cfdist.codecs.Incremental(full_every=10),
                                       cfdist.codecs.Quantize(bits="auto", match="*embedding*"),
                                       cfdist.codecs.Zstd(level=3)])

* :class:`Zstd` - lossless compression of every tensor;
* :class:`Incremental` - Check-N-Run: only the rows changed since the reference (lossless);
* :class:`Quantize` - Check-N-Run: per-row 8/4/2-bit quantization (lossy, opt-in);
* :class:`LCDelta` - LC-Checkpoint: delta + exponent quantization + Huffman (lossy, opt-in).

Codecs run where the checkpoint is persisted (writer thread, writer process, node actor); the
snapshot at the gate still copies raw bytes. Restoring decodes transparently and warns
(:class:`LossyCheckpointWarning`) when a lossy codec was involved. The on-storage layout is
described in :mod:`cfdist.checkpoint.format`.
"""

from cfdist.checkpoint.codecs.base import Codec
from cfdist.checkpoint.codecs.incremental import Incremental
from cfdist.checkpoint.codecs.lcdelta import LCDelta
from cfdist.checkpoint.codecs.pipeline import (
    EncodedShard, LossyCheckpointWarning, TensorFrames, begin, decode_tensors, encode_shard, validate_codecs,
)
from cfdist.checkpoint.codecs.quantize import Quantize
from cfdist.checkpoint.codecs.zstd import Zstd

__all__ = ["Codec", "EncodedShard", "Incremental", "LCDelta", "LossyCheckpointWarning", "Quantize", "TensorFrames", "Zstd", "begin",
           "decode_tensors", "encode_shard", "validate_codecs"]
