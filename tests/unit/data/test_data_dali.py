"""DALIResumableIterator on CPU pipelines over real JPEG files: after a restore, batches and
random augmentations equal those of the uninterrupted run; elastic resumes stay exactly-once."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
Image = pytest.importorskip("PIL.Image")

from cfdist.data import (  # noqa: E402
    DALIResumableIterator,
    ImageFileSource,
    IncompatibleDataState,
    image_augment_graph,
    image_classification_iterator,
)

N = 11  # batch 3 on one rank: steps of 3, 3, 3, 2


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> ImageFileSource:
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    files = []
    for i in range(N):
        pixels = rng.integers(0, 256, size=(18 + i % 4, 22 + i % 3, 3), dtype=np.uint8)
        path = os.path.join(root, f"img{i:02d}.jpg")
        Image.fromarray(pixels).save(path, quality=90)
        files.append(path)
    return ImageFileSource(files, list(range(N)))  # label == index: the batches name their samples


def make(src, *, batch=3, rank=0, world=1, depth=2, seed=1):
    # depth 1 and 2: DALI's producer reaches the end of an epoch before or after the last batch
    return image_classification_iterator(
        src, batch, size=(8, 8), seed=seed, rank=rank, world_size=world, prefetch_queue_depth=depth
    )


def until_epoch(it, epochs):
    out = []
    while not (it.epoch == epochs - 1 and it.at_epoch_end()):
        for (b,) in it:
            out.append((it.epoch, b["labels"].tolist(), b["images"].clone()))
    return out


def take(it, k):
    out, gen = [], iter(it)
    while len(out) < k:
        try:
            (b,) = next(gen)
        except StopIteration:
            gen = iter(it)
            continue
        out.append((it.epoch, b["labels"].tolist(), b["images"].clone()))
    return out


def assert_same(got, ref):
    assert [(e, lab) for e, lab, _ in got] == [(e, lab) for e, lab, _ in ref]
    for (_, _, a), (_, _, b) in zip(got, ref):
        assert torch.equal(a, b)  # bit-identical augmentations


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("cut", [1, 3, 4, 5, 7])  # 4: right after the last batch of epoch 0
def test_restore_reproduces_batches_and_augmentations(jpegs, cut, depth):
    ref = until_epoch(make(jpegs, depth=depth), 2)
    assert [len(lab) for _, lab, _ in ref] == [3, 3, 3, 2] * 2
    assert ref[0][2].shape == (3, 3, 8, 8) and ref[0][2].dtype == torch.float32
    for k in range(2):
        assert sorted(sum((lab for e, lab, _ in ref if e == k), [])) == list(range(N))
    first = make(jpegs, depth=depth)
    got = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    assert isinstance(state["dali"]["checkpoint"], str)
    second = make(jpegs, depth=depth)
    second.load_state_dict(state)
    assert second.at_epoch_end() == (cut == 4)
    assert_same(got + until_epoch(second, 2), ref)


def test_same_epoch_differs_across_seeds_and_ranks(jpegs):
    a, b = until_epoch(make(jpegs, seed=1), 1), until_epoch(make(jpegs, seed=2), 1)
    assert [lab for _, lab, _ in a] != [lab for _, lab, _ in b]
    r0, r1 = make(jpegs, rank=0, world=2), make(jpegs, rank=1, world=2)
    (b0,), (b1,) = next(iter(r0)), next(iter(r1))
    assert set(b0["labels"].tolist()).isdisjoint(b1["labels"].tolist())


@pytest.mark.parametrize("before, after, steps", [(2, 3, 1), (3, 1, 1), (2, 4, 2), (1, 2, 3)])
def test_elastic_resume_is_exactly_once(jpegs, before, after, steps, caplog):
    ranks = [make(jpegs, rank=r, world=before, batch=2) for r in range(before)]
    used = []
    for it in ranks:
        gen = iter(it)
        for _ in range(steps):
            (b,) = next(gen)
            if not it.last_batch_is_padding:
                used += b["labels"].tolist()
    states = [it.state_dict() for it in ranks]
    assert len({json.dumps({k: v for k, v in s.items() if k != "dali"}) for s in states}) == 1
    resumed = [make(jpegs, rank=r, world=after, batch=2) for r in range(after)]
    with caplog.at_level(logging.WARNING, logger="cfdist.data.dali"):
        for r, it in enumerate(resumed):
            it.load_state_dict(states[r % before])
    assert "cannot be restored" in caplog.text
    counts = []
    for it in resumed:
        n = 0
        for (b,) in it:
            n += 1
            if not it.last_batch_is_padding:
                used += b["labels"].tolist()
        counts.append(n)
    assert len(set(counts)) == 1  # the same number of steps on every rank
    assert sorted(used) == list(range(N))


def test_hooks_epoch_end_and_len(jpegs):
    it = make(jpegs)
    calls = []
    it.register_before_next_hook(lambda: calls.append(it.state_dict()["consumed"]))
    assert len(it) == 4
    n = sum(1 for _ in it)
    assert n == 4 and it.at_epoch_end() and calls == [0, 3, 6, 9, 11]


def test_other_files_are_refused_by_fingerprint(jpegs):
    it = make(jpegs)
    next(iter(it))
    state = it.state_dict()
    other = ImageFileSource(list(reversed(jpegs.files)), list(range(N)))
    with pytest.raises(IncompatibleDataState, match="fingerprint"):
        make(other).load_state_dict(state)


def test_malformed_dali_part_is_refused(jpegs):
    it = make(jpegs)
    state = it.state_dict()  # before any batch: no checkpoint yet, a derived seed
    assert state["dali"]["checkpoint"] is None and state["consumed"] == 0
    state["dali"]["pipeline_iter"] = "3"
    with pytest.raises(IncompatibleDataState, match="'dali' part"):
        make(jpegs).load_state_dict(state)


def test_generic_graph_and_uneven_outputs_are_reported(jpegs):
    def graph(encoded, labels):
        from nvidia.dali import fn

        return fn.decoders.image(encoded), labels  # no resize: images of different sizes

    it = DALIResumableIterator(jpegs, graph, ["img", "label"], batch_size=4, shuffle=False)
    with pytest.raises(ValueError, match="different shapes"):
        next(iter(it))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pipeline_restore_reproduces_augmentations(jpegs):
    def make_gpu():
        return DALIResumableIterator(
            jpegs, image_augment_graph((8, 8), device="gpu"), ("images", "labels"),
            batch_size=3, seed=1, rank=0, world_size=1, device_id=0,
        )

    ref = until_epoch(make_gpu(), 2)
    assert ref[0][2].is_cuda
    first = make_gpu()
    got = take(first, 5)
    second = make_gpu()
    second.load_state_dict(first.state_dict())
    assert_same(got + until_epoch(second, 2), ref)
