"""Retention with codec chains (issue 19, item 5): a corrupt byte in a chain's base must leave
an independent restore path. Pure tables over :func:`cfdist.checkpoint.retention.choose`, and a
run simulated commit by commit the way ``Incremental`` / ``LCDelta`` build their chains."""

from __future__ import annotations

import pytest

from cfdist.checkpoint.retention import Committed, choose, independent_fallback, needs

A = {"run": "a", "restores": []}


def chains(n: int, *codecs: tuple[str, int | None], every: int = 2) -> list[tuple[int, tuple[int, ...]]]:
    """``(step, depends)`` of ``n`` checkpoints taken every ``every`` steps, as the chain codecs
    write them (:class:`cfdist.checkpoint.codecs.chain.ChainPlan`): each codec ``(variant,
    full_every)`` writes its first checkpoint and every ``full_every``-th full (None: only the
    first); an ``"intermittent"`` increment needs the chain's full one, a ``"consecutive"`` one
    (``LCDelta`` too) every checkpoint of its chain so far. Several codecs: the union."""
    out = []
    state = [(None, []) for _ in codecs]          # per codec: (base, links)
    for i in range(n):
        step, deps = every * (i + 1), set()
        for j, (variant, full_every) in enumerate(codecs):
            base, links = state[j]
            if base is None or (full_every is not None and len(links) >= full_every):
                state[j] = (step, [step])
                continue
            deps |= {base} if variant == "intermittent" else set(links)
            links.append(step)
        out.append((step, tuple(sorted(deps))))
    return out


def run(history, *, keep, keep_epoch_ends=0, epoch_ends=()):
    """Commit ``history`` one by one, applying retention after each; the live steps at the end."""
    live: dict[int, Committed] = {}
    for step, deps in history:
        live[step] = Committed(step, step in epoch_ends, A, deps)
        plan = choose(list(live.values()), keep=keep, keep_epoch_ends=keep_epoch_ends, newest=step)
        assert not plan.move_aside
        for s in plan.delete:
            del live[s]
        yield sorted(live), plan


def final(history, **kw):
    *_, (live, plan) = run(history, **kw)
    return live, plan.fallback


INC4 = ("intermittent", 4)     # Incremental(full_every=4): fulls at steps 2, 10, 18 (every=2)
CON4 = ("consecutive", 4)      # Incremental(variant="consecutive", full_every=4), or LCDelta(full_every=4)

TABLE = [
    # history                                 keep kee ends   -> live at the end                 fallback
    # no codecs: nothing changes (every checkpoint stands alone)
    (chains(10),                               1,  0,  (),       [20],                              None),
    (chains(10),                               2,  0,  (),       [18, 20],                          None),
    (chains(10),                               3,  0,  (),       [16, 18, 20],                      None),
    # Incremental, intermittent: 18 is the base of 20; the fallback 16 needs 10 only
    (chains(10, INC4),                         1,  0,  (),       [18, 20],                          None),
    (chains(10, INC4),                         2,  0,  (),       [10, 16, 18, 20],                  16),
    # keep=3: 16 is one of the three newest, which need nothing in common: no extra
    (chains(10, INC4),                         3,  0,  (),       [10, 16, 18, 20],                  None),
    (chains(12, INC4),                         3,  0,  (),       [10, 16, 18, 20, 22, 24],          16),
    # a new full one: the keep newest are independent already, the old chain goes
    (chains(9, INC4),                          2,  0,  (),       [10, 16, 18],                      None),
    # consecutive (and LCDelta): the fallback 16 needs its whole chain
    (chains(10, CON4),                         1,  0,  (),       [18, 20],                          None),
    (chains(10, CON4),                         2,  0,  (),       [10, 12, 14, 16, 18, 20],          16),
    (chains(12, CON4),                         2,  0,  (),       [10, 12, 14, 16, 18, 20, 22, 24],  16),
    (chains(10, CON4),                         3,  0,  (),       [10, 12, 14, 16, 18, 20],          None),
    # one-shot (full_every=None): one chain is all there is, nothing to fall back on
    (chains(6, ("consecutive", None)),         2,  0,  (),       [2, 4, 6, 8, 10, 12],              None),
    (chains(6, ("intermittent", None)),        2,  0,  (),       [2, 10, 12],                       None),
    # Incremental(full_every=3) and LCDelta(full_every=4) together: the union of both chains
    (chains(10, ("intermittent", 3), ("consecutive", 4)),
                                               2,  0,  (),       [10, 12, 14, 16, 18, 20],          16),
    # an epoch end is kept with its chain, and does not replace the newest fallback
    (chains(10, CON4),                         2,  1,  (8,),     [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], 16),
    (chains(10, INC4),                         2,  1,  (8,),     [2, 8, 10, 16, 18, 20],            16),
    (chains(10, INC4),                         1,  1,  (8,),     [2, 8, 18, 20],                    None),
]


@pytest.mark.parametrize("history, keep, kee, ends, live, fallback", TABLE)
def test_retention_keeps_an_independent_fallback_beside_a_chain(history, keep, kee, ends, live, fallback):
    assert final(history, keep=keep, keep_epoch_ends=kee, epoch_ends=ends) == (live, fallback)


def test_the_table_models_the_codecs_chains():
    """The simulator writes what ChainPlan writes: fulls every ``full_every``, intermittent
    increments on the base, consecutive ones on the whole chain so far."""
    assert chains(6, INC4) == [(2, ()), (4, (2,)), (6, (2,)), (8, (2,)), (10, ()), (12, (10,))]
    assert chains(6, CON4) == [(2, ()), (4, (2,)), (6, (2, 4)), (8, (2, 4, 6)), (10, ()), (12, (10,))]


@pytest.mark.parametrize("codecs", [(INC4,), (CON4,), (("intermittent", 3), ("consecutive", 4)),
                                    (("intermittent", 10),), (("consecutive", 2),)])
@pytest.mark.parametrize("keep", [2, 3])
def test_no_single_corrupt_checkpoint_leaves_nothing_to_restore(codecs, keep):
    """Invariant 2 as a property, after every commit of a 40-checkpoint run: once a second chain
    exists, for every live checkpoint x some live ancestor restore point does not need x (a
    flipped byte in x falls back to it), and the keep newest are live with their chains."""
    history = chains(40, *codecs)
    second_full = next(s for s, d in history[1:] if not d)
    for live, _plan in run(history, keep=keep):
        by = {s: Committed(s, False, A, dict(history)[s]) for s in live}
        assert all(needs(s, by) <= set(live) for s in live[-keep:])
        if live[-1] < second_full:
            continue
        for x in live:
            assert any(x not in needs(s, by) and needs(s, by) <= set(live) for s in live), (x, live)


@pytest.mark.parametrize("codecs", [(INC4,), (CON4,), (("intermittent", 3), ("consecutive", 4))])
def test_keep_one_never_keeps_a_fallback(codecs):
    """``keep=1`` means one restore point, with codecs as without: the newest and what it needs."""
    history = chains(30, *codecs)
    for (step, deps), (live, plan) in zip(history, run(history, keep=1)):
        assert plan.fallback is None and live == sorted({step, *deps})


def test_independent_fallback_needs_a_wholly_committed_readable_chain():
    by = {10: Committed(10, False, A), 16: Committed(16, False, A, (10,)), 18: Committed(18, False, A),
          20: Committed(20, False, A, (18,))}
    assert independent_fallback([20, 18], [16, 10], by) == (16, frozenset({18}))
    del by[10]                                              # 16's base is gone: 16 cannot restore
    assert independent_fallback([20, 18], [16], by) == (None, frozenset({18}))
    by[10] = Committed(10, None, A)                         # 10's manifest is unreadable
    assert independent_fallback([20, 18], [16, 10], by) == (None, frozenset({18}))
    assert independent_fallback([20], [16], by) == (None, frozenset())   # one point: nothing shared


def test_the_issues_directory_keeps_74_and_its_base_beside_the_chain_of_76():
    """The killed run of the issue: 76 full, 78 and 80 increments on it (intermittent), the
    previous chain 66 .. 74. Today's main deleted all of 66 .. 74, so a flipped byte in 76 left
    nothing; now 74 and its base 66 stay, and only 68 .. 72 go."""
    committed = [Committed(66, False, A), *(Committed(s, False, A, (66,)) for s in (68, 70, 72, 74)),
                 Committed(76, False, A), Committed(78, False, A, (76,)), Committed(80, False, A, (76,))]
    plan = choose(committed, keep=2, keep_epoch_ends=0, newest=80)
    assert (plan.delete, plan.move_aside, plan.fallback, plan.shared) == ([68, 70, 72], [], 74, (76,))


def test_after_falling_back_past_the_corrupt_base_its_chain_is_moved_aside():
    """Restore fell back to 16 (18 was corrupt); the run commits a new full 18 (lineage
    restores=[16]; the old 18 was moved aside before the write): 20 is moved aside, 16 and its
    base stay as the keep newest, which are independent: no fallback needed."""
    a16 = {"run": "a", "restores": [16]}
    committed = [Committed(10, False, A), Committed(16, False, A, (10,)), Committed(18, False, a16),
                 Committed(20, False, A, (18,))]
    plan = choose(committed, keep=2, keep_epoch_ends=0, newest=18)
    assert (plan.delete, [s for s, _ in plan.move_aside], plan.fallback) == ([], [20], None)
