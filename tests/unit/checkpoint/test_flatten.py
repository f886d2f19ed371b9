"""flatten's fast path for plain values (the RNG state's 625-int tuple) says what the general path says."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import torch

from cfdist.checkpoint import state as st
from cfdist.checkpoint.flatten import flatten, unflatten


def test_python_rng_state_round_trips_and_keeps_its_tuple_tags():
    r = random.Random(7)
    r.random()
    skel, tensors = flatten({"python": r.getstate()}, inline_tensors=True)
    assert tensors == {}
    _, ints, _ = skel["python"]["__tuple__"]
    assert ints == {"__tuple__": list(r.getstate()[1])}
    back = unflatten(json.loads(json.dumps(skel)), {})
    assert back["python"] == r.getstate()
    q = random.Random()
    q.setstate(back["python"])
    assert [q.random() for _ in range(5)] == [r.random() for _ in range(5)]


def test_runs_of_plain_values_and_the_values_that_need_tags():
    obj = {"ints": (1, 2, 3), "mixed": [1, "a", None, True], "empty": (), "floats": [1.5, float("nan")],
           "inf": float("-inf"), "nested": [(1, 2), [3]], "bytes": [1, b"x"]}
    skel, _ = flatten(obj)
    assert skel["ints"] == {"__tuple__": [1, 2, 3]}
    assert skel["mixed"] == [1, "a", None, True]
    assert skel["empty"] == {"__tuple__": []}
    assert skel["floats"] == [1.5, {"__float__": "nan"}]   # a float in the run: each value walked
    assert skel["inf"] == {"__float__": "-inf"}
    assert skel["nested"] == [{"__tuple__": [1, 2]}, [3]]
    assert skel["bytes"] == [1, {"__bytes__": "eA=="}]
    back = unflatten(json.loads(json.dumps(skel)), {})
    assert back["ints"] == (1, 2, 3) and back["empty"] == () and back["nested"] == [(1, 2), [3]]
    assert math.isnan(back["floats"][1]) and back["inf"] == float("-inf") and back["bytes"] == [1, b"x"]


def test_a_skeleton_list_is_a_copy_of_the_state_list():
    live = [1, 2, 3]
    skel, _ = flatten({"v": live})
    skel["v"].append(4)
    assert live == [1, 2, 3]


def test_subclasses_of_plain_types_take_the_general_path():
    skel, _ = flatten({"s": [np.str_("a")], "f": np.float64(2.5), "i": [np.int64(3)], "size": torch.Size([2, 3])})
    assert skel == {"s": ["a"], "f": 2.5, "i": [3], "size": {"__tuple__": [2, 3]}}
    assert type(skel["s"][0]) is str and type(skel["f"]) is float and type(skel["i"][0]) is int


def test_the_whole_rng_capture_round_trips():
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    skel, _ = flatten(st.rng_state(), inline_tensors=True)
    want = (torch.rand(3), np.random.rand(3), random.random())
    st.set_rng_state(unflatten(json.loads(json.dumps(skel)), {}))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
