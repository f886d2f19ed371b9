"""Resume state: JSON only, refused when exactly-once would break, and the message says why."""

from __future__ import annotations

import json

import pytest

from cfdist.data.state import (
    DataState,
    IncompatibleDataState,
    Layout,
    check_resume,
    resume_position,
)

LAYOUT = Layout(num_samples=100, batch_size=4, seed=3, shuffle=True, world_size=2, rank=1, fingerprint="abc")


def saved(**over) -> DataState:
    base = dict(
        epoch=2, consumed=40, epoch_done=False, seed=3, shuffle=True, drop_last=False,
        batch_size=4, num_samples=100, fingerprint="abc", world_size=2, epoch_world_size=2,
    )
    return DataState(**{**base, **over})


def test_state_round_trips_through_json():
    s = saved()
    assert DataState.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize(
    "mangle, words",
    [
        (lambda d: {**d, "format": "other/9"}, "not a cfdist data state"),
        (lambda d: {k: v for k, v in d.items() if k != "consumed"}, "lacks 'consumed'"),
        (lambda d: {**d, "epoch": True}, "epoch=True"),
        (lambda d: {**d, "seed": -1}, "seed=-1"),
        (lambda d: {**d, "shuffle": 1}, "shuffle=1"),
        (lambda d: {**d, "consumed": 101}, "corrupt"),
        (lambda d: [1, 2], "not a cfdist data state"),
    ],
)
def test_malformed_states_are_refused(mangle, words):
    with pytest.raises(IncompatibleDataState, match=words):
        DataState.from_dict(mangle(saved().to_dict()))


@pytest.mark.parametrize(
    "state, layout_over, words",
    [
        (saved(num_samples=90), {}, ["100 samples", "90"]),
        (saved(fingerprint="xyz"), {}, ["'abc'", "'xyz'"]),
        (saved(seed=4), {}, ["seed=3", "seed=4", "epoch 2, 40/100"]),
        (saved(shuffle=False), {}, ["shuffle=True", "shuffle=False"]),
        (saved(num_samples=90, consumed=0, epoch_done=True), {}, ["100 samples"]),  # always
    ],
)
def test_unsafe_resumes_are_refused_with_reason_and_fix(state, layout_over, words):
    layout = Layout(**{**_fields(LAYOUT), **layout_over})
    with pytest.raises(IncompatibleDataState) as err:
        resume_position(state, layout)
    for w in words + ["strict=False"]:
        assert w in str(err.value)
    epoch, consumed, done = resume_position(state, layout, strict=False)  # knowingly
    assert (epoch, consumed, done) == (state.epoch, min(state.consumed, 100), state.epoch_done)


@pytest.mark.parametrize(
    "state",
    [
        saved(world_size=3, epoch_world_size=5),  # elastic: fine
        saved(batch_size=16),  # another batch size: fine
        saved(drop_last=True),  # only the tail differs: fine
        saved(seed=9, consumed=0),  # nothing consumed yet: the new seed applies
        saved(seed=9, consumed=100, epoch_done=True),  # epoch finished: next one uses the new seed
        saved(fingerprint=None),  # nothing to compare
    ],
)
def test_safe_resumes_are_accepted(state):
    assert check_resume(state, LAYOUT) == []
    assert resume_position(state, LAYOUT) == (state.epoch, state.consumed, state.epoch_done)


def test_seed_is_irrelevant_without_shuffle():
    layout = Layout(**{**_fields(LAYOUT), "shuffle": False, "seed": 1})
    assert check_resume(saved(shuffle=False, seed=2), layout) == []


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(num_samples=0), "num_samples"),
        (dict(batch_size=0), "batch_size"),
        (dict(seed=-3), "seed"),
        (dict(rank=2), "rank"),
        (dict(world_size=True), "world_size"),
        (dict(fingerprint=5), "fingerprint"),
    ],
)
def test_layout_validation_says_what_is_wrong(over, words):
    with pytest.raises(ValueError, match=words):
        Layout(**{**_fields(LAYOUT), **over})


def _fields(layout: Layout) -> dict:
    return {k: getattr(layout, k) for k in Layout.__dataclass_fields__}
