"""The ``Policy`` protocol declares every hook the Checkpointer calls, and a user's policy that has
only the two required methods (and derives from nothing) still works.

Real: a Checkpointer on ``file://`` in one process, a tiny model, its optimizer steps. Faked:
the policies (recording ones). The point: the hooks are called when the protocol's docstrings
say, PolicyBase's defaults stand in for the hooks a duck-typed policy lacks, and a policy that
lacks a required method is refused with a message naming it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import cfdist
from cfdist.policy import Auto, Every, EveryEpoch, Policy, PolicyBase, PolicyContext
from cfdist.policy.base import as_policy
from cfdist.policy.memory import MemoryEvery

HOOKS = ("should_checkpoint", "observe", "bind", "restored", "proposal", "agreed", "profile_to_save", "stats")


def _train(policy, url: str, steps: int) -> cfdist.Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, url, policy, keep=1)
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        ckpt.step(opt)
        opt.zero_grad()
    ckpt.wait()
    return ckpt


class OnlyTheTwo:
    """What a user writes: two methods, no base class, no ``k`` or ``mode``."""

    def __init__(self):
        self.asked: list[int] = []

    def should_checkpoint(self, step, *, epoch_end=False):
        self.asked.append(step)
        return step % 2 == 0

    def observe(self, m):
        pass


def test_the_protocol_and_the_base_class_declare_the_same_hooks_with_docstrings():
    declared = {n for n, v in vars(Policy).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert declared == set(HOOKS)
    for name in HOOKS:
        assert getattr(Policy, name).__doc__, f"Policy.{name} says nothing about when it is called"
        assert callable(getattr(PolicyBase, name))
    assert {"k", "mode", "mtbf_s"} <= set(Policy.__annotations__)
    assert PolicyBase.__abstractmethods__ == {"should_checkpoint", "observe"}


@pytest.mark.parametrize("policy", [Every(3), EveryEpoch(), Auto(), MemoryEvery(Every(3))])
def test_every_built_in_policy_derives_from_the_base_class(policy):
    assert isinstance(policy, PolicyBase) and isinstance(policy, Policy)
    assert as_policy(policy) is policy


def test_a_user_policy_with_only_the_two_required_methods_checkpoints_at_its_steps(tmp_path):
    user = OnlyTheTwo()
    ckpt = _train(user, f"file://{tmp_path}", 5)
    assert ckpt.policy is user and user.asked == [1, 2, 3, 4, 5]
    assert [c["step"] for c in cfdist.list_checkpoints(f"file://{tmp_path}")] == [4]
    s = ckpt.stats
    assert s["checkpoints"] == 2 and s["k"] is None and s["mode"] == "cpu"
    ckpt.close()


def test_hooks_are_called_in_the_documented_order(tmp_path):
    calls = []

    class Recording(PolicyBase):   # a subclass overriding every hook
        k, mode = None, "cpu"

        def bind(self, ctx):
            assert isinstance(ctx, PolicyContext) and ctx.world_size == 1 and ctx.state_bytes > 0
            calls.append("bind")

        def proposal(self):
            calls.append("proposal")
            return 2

        def agreed(self, k, step):
            self.k = k
            calls.append(f"agreed({k},{step})")

        def should_checkpoint(self, step, *, epoch_end=False):
            calls.append(f"should({step})")
            return step % self.k == 0

        def observe(self, m):
            calls.append(f"observe({m.step},{m.checkpointed})")

        def profile_to_save(self):
            calls.append("profile")
            return None

        def stats(self):
            return {"mine": 1, "checkpoints": -1}

    ckpt = _train(Recording(), f"file://{tmp_path}", 2)
    per_step = [c for c in calls[1:] if c not in ("proposal", "profile")]
    assert calls[0] == "bind" and calls.count("bind") == 1
    assert per_step == ["agreed(2,1)", "should(1)", "observe(1,False)", "should(2)", "observe(2,True)"]
    assert all(calls[i + 1] == "profile" for i, c in enumerate(calls) if c.startswith("observe"))
    assert ckpt.stats["mine"] == 1 and ckpt.stats["checkpoints"] == 1 and ckpt.stats["k"] == 2
    ckpt.close()


def test_a_duck_typed_policy_gets_the_hooks_it_has_and_defaults_for_the_rest():
    class Some(OnlyTheTwo):
        k, mode = 7, "gpu"

        def bind(self, ctx):
            self.ctx = ctx

        def stats(self):
            return {"x": 1}

    user = Some()
    p = as_policy(user)
    ctx = PolicyContext()
    p.bind(ctx)
    assert user.ctx is ctx and p.stats() == {"x": 1} and (p.k, p.mode) == (7, "gpu")
    assert p.proposal() == 0 and p.profile_to_save() is None and p.mtbf_s is None
    p.agreed(3, 1)   # the user's object has no agreed(): nothing happens, nothing raises
    assert p.should_checkpoint(4) is True and user.asked == [4]
    assert as_policy(OnlyTheTwo()).stats() == {}


def test_memory_every_forwards_every_hook_to_the_policy_it_wraps():
    inner = Auto(mtbf_s=100.0)
    mem = MemoryEvery(inner, every=1)
    mem.bind(PolicyContext(state_bytes=1 << 20))
    assert inner.ctx.state_bytes == 1 << 20
    assert (mem.k, mem.mode, mem.mtbf_s, mem.proposal()) == (inner.k, inner.mode, 100.0, inner.proposal())
    assert mem.stats() == inner.stats()
    duck = MemoryEvery(OnlyTheTwo(), every=2)
    assert duck.k is None and duck.mode == "cpu" and duck.stats() == {}


def test_an_object_that_is_not_a_policy_is_refused_naming_what_it_lacks(tmp_path):
    class NoObserve:
        def should_checkpoint(self, step, *, epoch_end=False):
            return False

    with pytest.raises(TypeError, match="policy must be a cfdist policy.*has no observe"):
        cfdist.Checkpointer({"model": torch.nn.Linear(1, 1)}, f"file://{tmp_path}", NoObserve())
