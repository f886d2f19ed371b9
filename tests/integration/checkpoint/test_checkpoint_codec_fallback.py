"""A flipped byte in the base of the newest codec chain: restore falls back to an older,
independent chain (issue 19, item 5; invariant 2).

Real: the Checkpointer with ``Incremental`` and the default ``keep=2``, its writer thread,
``file://`` storage with fsync, retention after every commit, restore, ``rejected/``. Faked: the
corruption (one byte of the base's shard flipped in place, as a failing disk would). The model is
an embedding table (sparse row updates: real increments) and a linear layer.

The point: after the run, the directory holds the newest chain (18 full, 20 on it) *and* an
independent restore point (16, on the previous chain's base 10); with a byte of 18 flipped,
``restore()`` returns 16, bit-identical to the state trained to step 16. On main before this
change retention had deleted every checkpoint outside the chain of 18, and restore raised
"no usable checkpoint".
"""

from __future__ import annotations

import warnings

import pytest
import torch

import cfdist
from cfdist.codecs import Incremental

CODECS = [Incremental(full_every=4)]     # Every(2): fulls at steps 2, 10, 18; increments on them


def make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(256, 8), "out": torch.nn.Linear(8, 1)})
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(model, opt, ckpt, steps: int, *, start: int = 0, at: dict | None = None) -> None:
    """``steps`` optimizer steps on a fixed stream of 16-row batches (rows ``step*16 .. +16``, so
    each step touches a few embedding rows); ``at[s]`` gets a copy of the state after step s."""
    for s in range(start, start + steps):
        rows = (torch.arange(16) + 16 * s) % 256
        model["out"](model["emb"](rows)).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()
        if at is not None:
            at[s + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def live_steps(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "MANIFEST.json").exists())


def test_a_flipped_byte_in_the_chain_base_falls_back_to_the_previous_chain(tmp_path):
    root = tmp_path / "ckpt"
    url = f"file://{root}"
    model, opt = make(0)
    states: dict[int, dict] = {}
    ck = cfdist.Checkpointer({"model": model, "optim": opt}, url, cfdist.Every(2), codecs=CODECS)
    assert ck.config.keep == 2
    train(model, opt, ck, 20, at=states)
    ck.close()
    assert live_steps(root) == [10, 16, 18, 20]     # main: [18, 20]

    shard = root / "step-000000018" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-9] ^= 0x01                                  # one bit of the last tensor's data
    shard.write_bytes(bytes(raw))

    model2, opt2 = make(1)
    ck2 = cfdist.Checkpointer({"model": model2, "optim": opt2}, url, cfdist.Every(2), codecs=CODECS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck2.restore() == 16
    text = "\n".join(str(w.message) for w in caught)
    assert "step 20" in text and "needs step 18" in text and "failed its checksum" in text
    for k, v in states[16].items():
        assert torch.equal(model2.state_dict()[k], v), f"{k} differs from the state trained to step 16"

    # training on from 16: the next commit (18, a full one) moves the corrupt chain aside
    train(model2, opt2, ck2, 2, start=16)
    ck2.close()
    assert live_steps(root) == [10, 16, 18]
    aside = {c["step"]: c["rejected"]["why"] for c in cfdist.list_checkpoints(url, include_rejected=True)
             if "rejected" in c}
    assert sorted(aside) == [18, 20] and "failed its checksum" in aside[18]
    assert cfdist.load(url)["step"] == 18


@pytest.mark.parametrize("keep, live", [(1, [18, 20]), (3, [10, 16, 18, 20])])
def test_keep_one_keeps_one_chain_and_keep_three_needs_no_extra(tmp_path, keep, live):
    """``keep=1`` promises no fallback (the newest and its base); with ``keep=3`` the three newest
    (20, 18, 16) are independent already."""
    root = tmp_path / "ckpt"
    model, opt = make(0)
    ck = cfdist.Checkpointer({"model": model, "optim": opt}, f"file://{root}", cfdist.Every(2), keep=keep,
                             codecs=CODECS)
    train(model, opt, ck, 20)
    ck.close()
    assert live_steps(root) == live
