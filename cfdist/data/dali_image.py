"""Example DALI pipeline: decode and augment image files, resumable (see ``DALIResumableIterator``).

The augmentations (random resized crop, random rotation, random horizontal flip) all draw from
DALI's random operators, whose state DALI's checkpoint carries, so a resumed run augments each
sample exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cfdist.data.dali import DALIResumableIterator

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class ImageFileSource:
    """``source(index) -> (encoded bytes as uint8 array, label as int64 scalar array)``.

    Reads the file on each call (from the iterating thread, for the batches DALI prefetches);
    nothing is cached, so a resume reads only the samples it needs.
    """

    def __init__(self, files: Sequence[str], labels: Sequence[int]):
        if len(files) != len(labels):
            raise ValueError(f"{len(files)} files but {len(labels)} labels; give one label per file")
        if not files:
            raise ValueError("no image files given")
        self.files = [str(f) for f in files]
        self.labels = [int(x) for x in labels]

    @classmethod
    def from_folder(cls, root: str, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> ImageFileSource:
        """One class per sub-folder of ``root`` (sorted names -> labels 0, 1, ...), like ImageFolder."""
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        files, labels = [], []
        for label, name in enumerate(classes):
            folder = os.path.join(root, name)
            for f in sorted(os.listdir(folder)):
                if f.lower().endswith(tuple(extensions)):
                    files.append(os.path.join(folder, f))
                    labels.append(label)
        if not files:
            raise ValueError(f"no files ending in {tuple(extensions)} in the class folders of {root!r}")
        return cls(files, labels)

    def __len__(self) -> int:
        return len(self.files)

    def __call__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        data = np.fromfile(self.files[index], dtype=np.uint8)
        return data, np.array(self.labels[index], dtype=np.int64)

    def fingerprint(self) -> str:
        """Hash of the files' base names, sizes and labels, in order: a checkpoint of another
        file list is refused on resume. Reads metadata only."""
        h = hashlib.sha256()
        for f, label in zip(self.files, self.labels):
            h.update(f"{os.path.basename(f)}\0{os.path.getsize(f)}\0{label}\n".encode())
        return h.hexdigest()[:16]


def image_augment_graph(
    size: tuple[int, int] = (224, 224),
    *,
    device: str = "cpu",
    mean: Sequence[float] = (123.675, 116.28, 103.53),
    std: Sequence[float] = (58.395, 57.12, 57.375),
    max_rotation: float = 15.0,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``graph(encoded, labels) -> (images, labels)``: decode, random resized crop to ``size``,
    random rotation in ``[-max_rotation, max_rotation]`` degrees, random horizontal flip,
    normalise to float32 CHW. ``device="gpu"`` decodes with nvJPEG ("mixed") and augments on the
    GPU (needs a pipeline with ``device_id``); labels stay on the CPU."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")

    def graph(encoded: Any, labels: Any) -> tuple[Any, Any]:
        from nvidia.dali import fn, types

        images = fn.decoders.image(
            encoded, device="mixed" if device == "gpu" else "cpu", output_type=types.RGB
        )
        images = fn.random_resized_crop(images, size=list(size), random_area=[0.25, 1.0])
        angle = fn.random.uniform(range=[-max_rotation, max_rotation])
        images = fn.rotate(images, angle=angle, fill_value=0, keep_size=True)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=list(mean),
            std=list(std),
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels

    return graph


def image_classification_iterator(
    source: ImageFileSource,
    batch_size: int,
    *,
    size: tuple[int, int] = (224, 224),
    seed: int = 0,
    shuffle: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    device_id: int | None = None,
    num_threads: int = 2,
    prefetch_queue_depth: int = 2,
) -> DALIResumableIterator:
    """A resumable iterator yielding ``[{"images": float32 (B,3,H,W), "labels": int64 (B,)}]``.

    ``device_id=None`` runs on the CPU; with a CUDA device id, decoding and augmentation run on
    that GPU and ``images`` is a CUDA tensor. The source's fingerprint guards resumes.
    """
    return DALIResumableIterator(
        source,
        image_augment_graph(size, device="cpu" if device_id is None else "gpu"),
        ("images", "labels"),
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        fingerprint=source.fingerprint(),
        device_id=device_id,
        num_threads=num_threads,
        prefetch_queue_depth=prefetch_queue_depth,
    )
