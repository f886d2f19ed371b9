"""The Checkpointer's settings: a few plain keywords, three groups, one way to say who writes.

Real: Checkpointers on local directories, a c10d ``HashStore`` standing in for the job's store
(two ranks in one process: the constructor only reads it). The points: every old flat keyword
still works, lands in its group and warns with the new spelling; an old keyword beside its
group, a contradicting ``writer=`` and a keyword that never existed are refused; ``writers=``
alone says who writes (``True``/``False`` per rank included); the groups validate their fields.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist

import cfdist
from cfdist.checkpoint.options import LEGACY

VALUES = {"backend": "process", "persist_timeout_s": 7.0, "io": "buffered", "verify": False,
          "read_retry": cfdist.RetryPolicy(tries=2), "rank": 0, "world_size": 1, "store": None,
          "lookahead": 3, "agree_timeout_s": 60.0}


def _ck(tmp_path, **kw):
    return cfdist.Checkpointer({"w": torch.zeros(3)}, f"file://{tmp_path}/c", cfdist.Every(2), **kw)


def test_the_constructor_takes_the_newcomers_keywords_first_and_everything_else_by_keyword():
    params = list(inspect.signature(cfdist.Checkpointer.__init__).parameters.values())[1:]
    assert [p.name for p in params[:4]] == ["state", "storage", "policy", "keep"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[3:] if p.kind is not p.VAR_KEYWORD)
    named = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
    assert len(named) == 14 and "writer" not in named and "backend" not in named   # 14th: host_memory


def test_the_groups_land_in_the_config(tmp_path):
    ck = _ck(tmp_path, keep=3, buffers=2, persist=cfdist.PersistOptions(timeout_s=5, io="buffered"),
             load=cfdist.LoadOptions(verify=False), group=cfdist.GroupOptions(lookahead=4))
    try:
        c = ck.config
        assert (c.keep, c.buffers, c.persist.timeout_s, c.persist.io, c.load.verify, c.group.lookahead) == \
            (3, 2, 5, "buffered", False, 4)
        assert c.persist.backend == "thread" and c.load.read_retry == cfdist.RetryPolicy()
    finally:
        ck.close()


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_every_old_keyword_still_works_lands_in_its_group_and_warns_with_the_new_spelling(tmp_path, name):
    group, field = LEGACY[name]
    with pytest.warns(DeprecationWarning, match=rf"{name}=.*deprecated: pass {group}=cfdist\.\w+\({field}="):
        ck = _ck(tmp_path, **{name: VALUES[name]})
    try:
        assert getattr(getattr(ck.config, group), field) == VALUES[name]
    finally:
        ck.close()


def test_an_old_keyword_beside_its_group_or_an_unknown_keyword_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"persist_timeout_s= and persist= both given; pass persist_timeout_s "
                                         r"as persist=cfdist.PersistOptions\(timeout_s=...\) only"):
        _ck(tmp_path, persist_timeout_s=3, persist=cfdist.PersistOptions())
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'persist_timeout'"):
        _ck(tmp_path, persist_timeout=3)


def test_writers_alone_says_who_writes_and_the_old_writer_keyword_maps_onto_it(tmp_path):
    store = dist.HashStore()
    group = {r: cfdist.GroupOptions(rank=r, world_size=2, store=store) for r in (0, 1)}
    ck1 = _ck(tmp_path / "a", writers=True, group=group[1])     # rank 1 writes its node's copy
    ck0 = _ck(tmp_path / "b", writers=False, group=group[0])
    assert (ck1.writer, ck0.writer) == (True, False)
    default = _ck(tmp_path / "c", group=group[1])                 # "node": rank 0 only
    assert default.writer is False
    with pytest.warns(DeprecationWarning, match=r"writer=.*deprecated: pass writers=True"):
        old = _ck(tmp_path / "d", writer=True, group=group[1])
    assert old.writer is True and old.config.writers is True
    with pytest.raises(ValueError, match=r"writer=True contradicts writers=False; pass writers= only"):
        _ck(tmp_path / "e", writer=True, writers=False, group=group[1])
    for ck in (ck1, ck0, default, old):
        ck.close()


@pytest.mark.parametrize("bad, match", [
    (dict(persist=cfdist.PersistOptions), r"persist= must be a cfdist.PersistOptions"),
    (dict(writers="every"), r"writers must be 'node' .*True/False"),
])
def test_bad_settings_are_named(tmp_path, bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _ck(tmp_path, **bad)


def test_the_groups_validate_their_fields():
    with pytest.raises(ValueError, match=r"PersistOptions.backend must be 'thread', 'process'"):
        cfdist.PersistOptions(backend="threads")
    with pytest.raises(ValueError, match=r"PersistOptions.timeout_s must be a number of seconds > 0, or None"):
        cfdist.PersistOptions(timeout_s=0)
    with pytest.raises(TypeError, match=r"LoadOptions.read_retry must be a cfdist.RetryPolicy"):
        cfdist.LoadOptions(read_retry=3)
    with pytest.raises(ValueError, match=r"GroupOptions.lookahead must be an int >= 1"):
        cfdist.GroupOptions(lookahead=0)
    with pytest.raises(ValueError, match=r"GroupOptions.rank must be an int >= 0"):
        cfdist.GroupOptions(rank=-1)
    with pytest.raises(TypeError):
        cfdist.PersistOptions("thread")        # keyword-only: a positional value is ambiguous


def test_no_warning_from_the_new_spelling(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ck(tmp_path, writers=True, persist=cfdist.PersistOptions(timeout_s=9)).close()
