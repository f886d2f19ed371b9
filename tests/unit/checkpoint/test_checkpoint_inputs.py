"""Bad arguments to the Checkpointer fail at construction, naming what is wrong."""

from __future__ import annotations

import pytest
import torch

import cfdist
from cfdist.checkpoint.flatten import flatten


@pytest.fixture
def model():
    return torch.nn.Linear(2, 2)


@pytest.mark.parametrize("url", ["nosuchscheme://bucket/run", "ftpx://host/dir"])
def test_unknown_url_scheme_is_a_value_error(model, url):
    with pytest.raises(ValueError, match="unknown scheme"):
        cfdist.Checkpointer({"model": model}, url, cfdist.Every(1))


def test_relative_local_path_is_a_value_error(model):
    with pytest.raises(ValueError, match="relative"):
        cfdist.Checkpointer({"model": model}, "ckpt/run1", cfdist.Every(1))


class NoStateDict:
    pass


@pytest.mark.parametrize("bad", [NoStateDict(), object(), lambda: 1])
def test_state_object_without_state_dict_is_a_type_error_naming_the_key(model, bad, memory_url):
    with pytest.raises(TypeError, match=r"state\['helper'\] is a .* without state_dict\(\)"):
        cfdist.Checkpointer({"model": model, "helper": bad}, memory_url, cfdist.Every(1))


@pytest.mark.parametrize("state, why", [
    ({}, "non-empty dict"),
    ([("model", None)], "non-empty dict"),
    ({"a/b": 1}, "without '/'"),
    ({3: 1}, "non-empty str"),
])
def test_malformed_state_is_a_type_error(state, why, memory_url):
    with pytest.raises(TypeError, match=why):
        cfdist.Checkpointer(state, memory_url, cfdist.Every(1))


@pytest.mark.parametrize("kw, why", [({"keep": 0}, "keep must be an int >= 1"),
                                     ({"backend": "gpu"}, "PersistOptions.backend must be 'thread', 'process'")])
def test_bad_settings_are_value_errors(model, memory_url, kw, why):
    with pytest.raises(ValueError, match=why):
        cfdist.Checkpointer({"model": model}, memory_url, cfdist.Every(1), **kw)


def test_a_policy_that_is_not_one_is_a_type_error(model, memory_url):
    with pytest.raises(TypeError, match="policy must be a cfdist policy"):
        cfdist.Checkpointer({"model": model}, memory_url, policy=50)


def test_a_state_dict_holding_an_object_is_refused_with_its_path():
    """Checkpoints never carry code: a state_dict leaf that JSON cannot hold and that is no tensor."""
    with pytest.raises(TypeError, match="state at 'sched/fn' holds a builtins.function"):
        flatten({"sched": {"fn": lambda e: 0.9 ** e, "last_epoch": 3}})
