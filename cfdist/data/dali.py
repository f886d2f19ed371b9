"""``DALIResumableIterator``: a DALI pipeline fed by the resumable partition, checkpointed whole.

The indices come from the same plan as :class:`~cfdist.data.ResumableLoader` (exactly once,
elastic). They enter the pipeline through an ``external_source`` whose callback takes DALI's
``BatchInfo`` and is therefore checkpointable: it derives its batch from ``(epoch_idx,
iteration)`` alone, so DALI's prefetching does not disturb the position. DALI's own checkpoint
(``enable_checkpointing=True``) restores the state of every random operator as of the last batch
consumed, so augmentations after a resume equal those of the uninterrupted run.

DALI is imported lazily: ``import cfdist.data`` works where DALI is not installed.
"""

from __future__ import annotations

import base64
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from cfdist.data.cursor import CursorPosition, EpochCursor
from cfdist.data.hooks import BeforeNextHooks
from cfdist.data.partition import derive_seed
from cfdist.data.state import DataState, IncompatibleDataState

log = logging.getLogger(__name__)

_PIPELINE_SEED_TAG = 0xDA11


def _to_torch(tl: Any, name: str, device_id: int | None) -> torch.Tensor:
    """Copy one DALI output batch (``TensorList``) into a new torch tensor, as the plugin does."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    shapes = tl.shape()
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            f"DALI output {name!r} has samples of different shapes ({shapes[:4]}...); a batch must "
            "be one tensor: make the output uniform in the graph (resize/crop/pad)"
        )
    on_gpu = type(tl).__name__ == "TensorListGPU"
    device = torch.device("cuda", device_id) if on_gpu else torch.device("cpu")
    out = torch.empty((len(shapes), *shapes[0]), dtype=to_torch_type[tl.dtype], device=device)
    stream = torch.cuda.current_stream(device) if on_gpu else None
    feed_ndarray(tl.as_tensor(), out, cuda_stream=stream)
    return out


class DALIResumableIterator(CursorPosition, BeforeNextHooks):
    """Batches from a DALI pipeline over this rank's share of each epoch, resumable exactly.

    Args:
        source: ``source(index) -> tuple of numpy arrays``, one sample's raw inputs (e.g. the
            bytes of a JPEG as ``uint8`` and its label). Called in the iterating thread, for
            batches DALI prefetches.
        graph: ``graph(*inputs) -> DataNode | tuple[DataNode, ...]``, the DALI graph from the
            source's outputs to the pipeline's outputs; called once per pipeline build, inside
            the pipeline's scope (use ``nvidia.dali.fn``).
        output_names: names of the graph's outputs, keys of each yielded dict.
        batch_size: samples per batch on this rank.
        num_samples: dataset size; defaults to ``len(source)``.
        num_inputs: number of arrays ``source`` returns; defaults to ``graph``'s parameter count.
        seed, shuffle, rank, world_size, drop_last, fingerprint: as for
            :class:`~cfdist.data.ResumableLoader` (same partition, same padding rule).
        device_id: CUDA device of the pipeline, or ``None`` for a CPU-only pipeline.
        num_threads, prefetch_queue_depth: DALI pipeline settings.

    Yields ``[{name: torch.Tensor}]`` per batch, like ``DALIGenericIterator`` (one dict, as one
    pipeline). Position, hooks, epochs and padding behave as in ``ResumableLoader``.
    ``state_dict()`` adds ``"dali"``: this rank's DALI checkpoint (base64 of DALI's serialized
    string) and where the pipeline stood; it is used when restored on the same rank of a world
    of the same size. After an elastic resume the position is exact but each rank's random
    operators restart from a seed derived from ``(seed, rank, world_size, epoch, consumed)``.
    """

    def __init__(
        self,
        source: Callable[[int], Sequence[np.ndarray]],
        graph: Callable[..., Any],
        output_names: Sequence[str],
        *,
        batch_size: int,
        num_samples: int | None = None,
        num_inputs: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        fingerprint: str | None = None,
        device_id: int | None = None,
        num_threads: int = 2,
        prefetch_queue_depth: int = 2,
    ):
        super().__init__()
        if num_samples is None:
            num_samples = len(source)  # type: ignore[arg-type]
        if num_inputs is None:
            params = inspect.signature(graph).parameters.values()
            if any(p.kind is p.VAR_POSITIONAL for p in params):
                raise ValueError("graph takes *args: pass num_inputs (arrays per sample from source)")
            num_inputs = len(params)
        if not output_names or len(set(output_names)) != len(output_names):
            raise ValueError(f"output_names must be distinct and non-empty, got {list(output_names)}")
        self._source, self._graph = source, graph
        self._names = list(output_names)
        self._num_inputs = num_inputs
        self._device_id = device_id
        self._num_threads = num_threads
        self._prefetch = prefetch_queue_depth
        self._cursor = EpochCursor.for_rank(
            num_samples=num_samples, batch_size=batch_size, seed=seed, shuffle=shuffle,
            drop_last=drop_last, rank=rank, world_size=world_size, fingerprint=fingerprint,
        )
        self._pipe = None
        self._pending: dict | None = None  # DALI part of a loaded state, used at the next build
        self._pipeline_seed = 0
        self._dali_epoch = 0  # pipeline epochs (resets) so far, as DALI counts them
        self._dali_iter = 0  # batches consumed from the pipeline since its last reset
        self._base = (0, 0)  # (DALI epoch, DALI iteration) at which the cursor's plan starts
        self._last_padding = False

    # --- pipeline ---------------------------------------------------------------------
    def _fresh_seed(self) -> int:
        cur, lay = self._cursor, self._cursor.layout
        parts = (lay.seed, lay.rank, lay.world_size, cur.epoch, cur.consumed, _PIPELINE_SEED_TAG)
        return derive_seed(*parts) % (2**31)

    def _build(self) -> None:
        from nvidia.dali import Pipeline, fn

        pend, self._pending = self._pending, None
        checkpoint = None
        if pend is not None and pend["checkpoint"] is not None:
            checkpoint = base64.b64decode(pend["checkpoint"])
            self._dali_epoch, self._dali_iter = pend["pipeline_epoch"], pend["pipeline_iter"]
        else:
            self._dali_epoch, self._dali_iter = 0, 0
        self._pipeline_seed = pend["pipeline_seed"] if pend is not None else self._fresh_seed()
        self._base = (self._dali_epoch, self._dali_iter)
        self._cursor.replan()

        pipe = Pipeline(
            batch_size=self._cursor.layout.batch_size,
            num_threads=self._num_threads,
            device_id=self._device_id,
            seed=self._pipeline_seed,
            prefetch_queue_depth=self._prefetch,
            enable_checkpointing=True,
            checkpoint=checkpoint,
        )
        with pipe:
            inputs = fn.external_source(
                source=self._feed, num_outputs=self._num_inputs, batch=True, batch_info=True
            )
            outs = self._graph(*inputs)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            if len(outs) != len(self._names):
                raise ValueError(
                    f"graph returned {len(outs)} outputs but output_names has {len(self._names)}: "
                    f"{self._names}"
                )
            pipe.set_outputs(*outs)
        pipe.build()
        self._pipe = pipe

    def _feed(self, info: Any) -> list[list[np.ndarray]]:
        """external_source callback: the inputs of DALI iteration ``info.iteration``."""
        base_epoch, base_iter = self._base
        if info.epoch_idx != base_epoch:
            raise RuntimeError(
                f"DALI asked for pipeline epoch {info.epoch_idx} but the plan is for {base_epoch}"
            )
        cur = self._cursor
        k = info.iteration - base_iter
        if k >= len(cur.plan.sizes):
            raise StopIteration
        indices, _ = cur.batch(k)
        samples = [self._source(i) for i in indices]
        return [[np.asarray(s[j]) for s in samples] for j in range(self._num_inputs)]

    def _finish_pipeline_epoch(self) -> None:
        """Let the live pipeline hit the end of its epoch and reset it for the next one."""
        try:
            self._pipe.run()
        except StopIteration:
            pass
        else:
            raise RuntimeError("the DALI pipeline produced a batch past the end of the epoch's plan")
        self._pipe.reset()
        self._dali_epoch, self._dali_iter = self._dali_epoch + 1, 0

    def _drop_pipeline(self) -> None:
        self._pipe = None

    # --- iteration --------------------------------------------------------------------
    def __iter__(self) -> DALIResumableIterator:
        """Continue the current epoch, or start the next one if the current one is finished."""
        cur = self._cursor
        if cur.done:
            if self._pipe is None and self._pending is not None and self._pending["checkpoint"]:
                self._build()  # restore the random operators' state before moving on
            if self._pipe is not None:
                self._finish_pipeline_epoch()
            cur.start_epoch(cur.epoch + 1)
            self._base = (self._dali_epoch, 0)
            cur.plan  # noqa: B018 - an empty epoch is done at once
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        self._run_before_next()
        cur = self._cursor
        if cur.done:
            raise StopIteration
        if self._pipe is None:
            self._build()
        if cur.steps_left == 0:
            raise StopIteration
        try:
            outs = self._pipe.run()
        except StopIteration:
            raise RuntimeError(
                f"the DALI pipeline ended its epoch early ({cur.steps_left} planned batches left)"
            ) from None
        batch = {n: _to_torch(tl, n, self._device_id) for n, tl in zip(self._names, outs)}
        _, self._last_padding = cur.batch(cur.step_in_plan)
        cur.advance()
        self._dali_iter += 1
        return [batch]

    # --- position ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the epoch in progress. Jumping
        elsewhere mid-epoch rebuilds the pipeline (its random state restarts from a seed)."""
        cur = self._cursor
        if epoch == cur.epoch and not cur.done:
            return
        if epoch == cur.epoch + 1 and cur.done:
            iter(self)  # the ordinary next epoch: keep the pipeline's random state
            return
        self._drop_pipeline()
        self._pending = None
        cur.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Position (as :class:`ResumableLoader`) plus ``"dali"``, this rank's pipeline state.
        Call between steps; ``Pipeline.checkpoint()`` costs a serialisation of the random
        operators' states (small; no I/O)."""
        lay = self._cursor.layout
        if self._pipe is not None:
            dali = {
                "checkpoint": base64.b64encode(self._pipe.checkpoint()).decode("ascii"),
                "pipeline_epoch": self._dali_epoch,
                "pipeline_iter": self._dali_iter,
                "pipeline_seed": self._pipeline_seed,
            }
        elif self._pending is not None:  # loaded, not built yet: hand the same state on
            dali = {k: self._pending[k] for k in _DALI_KEYS if k not in ("rank", "world_size")}
        else:  # never built: the pipeline a restore builds is the one this iterator would build
            dali = {
                "checkpoint": None,
                "pipeline_epoch": 0,
                "pipeline_iter": 0,
                "pipeline_seed": self._fresh_seed(),
            }
        position = self._cursor.state().to_dict()
        return {**position, "dali": {"rank": lay.rank, "world_size": lay.world_size, **dali}}

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Resume from ``state``; see :meth:`ResumableLoader.load_state_dict`. The DALI part is
        used if it was saved by the same rank of a world of the same size, else ignored (with a
        warning): the position stays exact, the augmentation random state does not."""
        self._cursor.load(DataState.from_dict(state), strict=strict)
        self._drop_pipeline()
        self._last_padding = False
        self._pending = None
        dali = state.get("dali")
        lay = self._cursor.layout
        if dali is None:
            return
        _check_dali_part(dali)
        if (dali["rank"], dali["world_size"]) == (lay.rank, lay.world_size):
            self._pending = dict(dali)
        else:
            log.warning(
                "DALI state saved by rank %d of %d cannot be restored on rank %d of %d: the "
                "position is exact, but random augmentations restart from a derived seed",
                dali["rank"], dali["world_size"], lay.rank, lay.world_size,
            )


_DALI_KEYS = ("rank", "world_size", "pipeline_epoch", "pipeline_iter", "pipeline_seed", "checkpoint")


def _check_dali_part(dali: object) -> None:
    def is_count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    ok = isinstance(dali, dict) and all(is_count(dali.get(k)) for k in _DALI_KEYS[:-1])
    ok = ok and (dali.get("checkpoint") is None or isinstance(dali.get("checkpoint"), str))
    if not ok:
        raise IncompatibleDataState(
            f"the 'dali' part of the data state is malformed: {dali!r:.200}; pass the dict "
            "returned by DALIResumableIterator.state_dict()"
        )
