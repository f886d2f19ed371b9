"""cfdist inside a Ray Train ``TorchTrainer`` loop: checkpoints reported to Ray Train by reference.

::

    from cfdist.ray_train import RayTrainReporter, run_storage

    def train_func(config):                       # runs on every Ray Train worker
        model = ray.train.torch.prepare_model(Net())
        loader = cfdist.ResumableLoader(dataset, 32, seed=0)
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "data": loader},
                                   storage=run_storage(), policy=cfdist.Every(50))
        reporter = RayTrainReporter(ckpt, every=50)
        reporter.restore()                        # Ray Train's checkpoint, or cfdist's newest
        for x, y in loader:
            loss_fn(model(x), y).backward(); ckpt.step(opt); opt.zero_grad()
            reporter.maybe_report({"loss": loss.item()})
        reporter.close()

cfdist writes its step directories *inside* the Ray Train run's directory (:func:`run_storage`),
so a committed step directory is a checkpoint Ray Train manages in place: it is reported with
``CheckpointUploadMode.NO_UPLOAD`` (a reference: nothing is copied, nothing uploaded, the
training loop does not wait for storage). ``Result.checkpoint`` is then cfdist's newest
reported step directory; Ray Train's own restarts (``FailureConfig``) resume from the newest
committed step, and a new run resumes from ``Result.checkpoint`` passed to
:meth:`RayTrainReporter.restore` (through ``train_loop_config``).

Ray Train's ``report`` is a barrier: every worker calls :meth:`RayTrainReporter.maybe_report`
at the same steps (every ``every`` steps); rank 0 attaches the newest committed checkpoint not
yet reported. cfdist's retention (``keep``) may delete step directories Ray Train reported
earlier; the newest reported one is kept as long as ``keep >= 2``.
"""

from __future__ import annotations

import logging
import os

from cfdist.checkpoint import Checkpointer
from cfdist.checkpoint.format import parse_step_dir, step_dir
from cfdist.storage import open_storages

log = logging.getLogger("cfdist.ray_train")

SUBDIR = "cfdist"


def run_storage(subdir: str = SUBDIR) -> str:
    """The fsspec URL of ``subdir`` inside the current Ray Train run's directory (call on a
    Ray Train worker). Local and S3/GCS storage paths are supported."""
    import ray.train

    sc = ray.train.get_context().get_storage()
    return _url(f"{sc.experiment_fs_path.rstrip('/')}/{subdir}", sc.storage_filesystem)


def _url(path: str, filesystem) -> str:
    """A pyarrow filesystem path -> the fsspec URL cfdist opens."""
    kind = getattr(filesystem, "type_name", "local")
    schemes = {"local": "file://", "s3": "s3://", "gcs": "gs://"}
    if kind not in schemes:
        raise ValueError(f"Ray Train storage filesystem {kind!r} has no cfdist URL scheme; use a local, "
                         f"s3:// or gs:// RunConfig(storage_path=...)")
    return schemes[kind] + (os.path.abspath(path) if kind == "local" else path)


class RayTrainReporter:
    """Reports a :class:`cfdist.Checkpointer`'s committed checkpoints to Ray Train by reference.

    Build it on every worker after the Checkpointer (whose ``storage`` is :func:`run_storage`).
    Call :meth:`maybe_report` after every ``ckpt.step(...)`` on every worker.
    """

    def __init__(self, ckpt: Checkpointer, every: int = 50):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (steps between Ray Train reports), got {every!r}")
        self.ckpt, self.every = ckpt, every
        self.reported: int | None = None
        self.reports = 0

    def restore(self, checkpoint=None) -> int | None:
        """Restore the newest committed checkpoint: ``checkpoint`` (a ``ray.train.Checkpoint``
        such as an earlier run's ``Result.checkpoint``, passed in through ``train_loop_config``:
        Ray Train 2.x deprecates ``resume_from_checkpoint``), else Ray Train's own
        (``ray.train.get_checkpoint()`` after a restart), searched as a further tier, or a newer
        one in this run's storage. Returns the restored step or None. Every worker."""
        import ray.train

        given = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
        if given is not None:
            base, _, name = given.path.rstrip("/").rpartition("/")
            if parse_step_dir(name) is None:
                raise ValueError(f"Ray Train's checkpoint {given.path} is not a cfdist step directory "
                                 f"(step-NNNNNNNNN); was it reported by cfdist.ray_train?")
            url = _url(base, given.filesystem)
            if all(t[0].url.rstrip("/") != url.rstrip("/") for t in self.ckpt.tiers):
                self.ckpt.tiers.append(open_storages(url))      # an earlier run's directory
        step = self.ckpt.restore()
        self.reported = step
        return step

    def maybe_report(self, metrics: dict | None = None) -> bool:
        """Every ``every`` steps: ``ray.train.report`` on every worker, rank 0 attaching the
        newest committed step directory by reference. Returns whether it reported."""
        if self.ckpt.step_count % self.every:
            return False
        self.report(metrics)
        return True

    def report(self, metrics: dict | None = None) -> None:
        """``ray.train.report`` now (every worker, the same number of times)."""
        import ray.train

        metrics = {"step": self.ckpt.step_count, **(metrics or {})}
        checkpoint = None
        latest = self.ckpt.latest_step
        if self.ckpt.writer and self.ckpt.rank == 0 and latest is not None and latest != self.reported:
            checkpoint = ray.train.Checkpoint(path=_path(self.ckpt.storages[0].url_of(step_dir(latest))),
                                              filesystem=_filesystem())
            metrics["cfdist_step"] = latest
            self.reported = latest
        ray.train.report(metrics, checkpoint=checkpoint,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
        self.reports += 1

    def close(self, metrics: dict | None = None) -> None:
        """Commit the last checkpoint (``ckpt.close()``) and report it. Every worker, once."""
        self.ckpt.save(block=True)
        self.ckpt.close()
        self.report(metrics)


def _path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url.split("://", 1)[1]


def _filesystem():
    import ray.train

    return ray.train.get_context().get_storage().storage_filesystem
