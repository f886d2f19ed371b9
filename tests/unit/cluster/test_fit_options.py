"""``cfdist.fit``'s settings: the plain keywords, then three groups (tiers, recovery, output).

Pure, no Ray: :meth:`FitConfig.build` is what ``cfdist.fit`` and the ``cfdist fit`` command call
before anything starts, so a mistake is refused before a cluster is. The points: a group's
fields land in the run's config; a grouped setting given one by one (the spelling before the
groups) joins its group and ``fit`` warns naming the group; the same setting given both ways,
a wrong type and an unknown name are refused; the YAML command takes the groups as mappings,
``--set group.field=value`` and the old top-level keys.
"""

from __future__ import annotations

import pytest

import cfdist
from cfdist.cli import UsageError, fit_groups
from cfdist.cluster.config import GROUP_OF, GROUPS, FitConfig


def test_the_groups_land_in_the_runs_config():
    c = FitConfig.build(storage="/tmp/x", num_nodes=2, tiers=cfdist.TierOptions(shared_every=3, keep=4),
                        recovery=cfdist.RecoveryOptions(min_nodes=2, warm_spares=False),
                        output=cfdist.OutputOptions(progress=False))
    assert (c.num_nodes, c.shared_every, c.keep, c.min_nodes, c.warm_spares, c.progress) == (2, 3, 4, 2, False, False)
    assert c.poll_s == cfdist.OutputOptions().poll_s and c.memory_tier is True


def test_every_grouped_setting_has_one_group_and_the_config_the_same_default():
    assert set(GROUP_OF) == {f for cls in GROUPS.values() for f in cls.__dataclass_fields__}
    plain = FitConfig(storage="/tmp/x")
    for name, group in GROUP_OF.items():
        assert getattr(plain, name) == getattr(GROUPS[group](), name), name


def test_settings_one_by_one_join_their_group_and_two_spellings_of_one_are_refused():
    c = FitConfig.build(storage="/tmp/x", flat={"shared_every": 7, "progress": False})
    assert (c.shared_every, c.progress) == (7, False)
    with pytest.raises(ValueError, match=r"shared_every= and tiers= both given; pass shared_every as "
                                         r"tiers=cfdist.TierOptions\(shared_every=...\) only"):
        FitConfig.build(storage="/tmp/x", tiers=cfdist.TierOptions(), flat={"shared_every": 7})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'shared_evry'; the grouped settings are "
                                        r"tiers=cfdist.TierOptions"):
        FitConfig.build(storage="/tmp/x", flat={"shared_evry": 7})
    with pytest.raises(TypeError, match=r"recovery=...\) must be a cfdist.RecoveryOptions"):
        FitConfig.build(storage="/tmp/x", recovery=cfdist.TierOptions())


def test_fit_warns_for_the_old_spelling_naming_the_group_before_starting_anything(tmp_path):
    """The storage is refused by the config's validation, which runs before Ray: the warning
    came first, and nothing started."""
    with pytest.warns(DeprecationWarning, match=r"cfdist.fit\(shared_every=\) is deprecated: pass "
                                                r"tiers=cfdist.TierOptions\(shared_every=...\)"):
        with pytest.raises(ValueError, match=r"must be an absolute path"):
            cfdist.fit(lambda ctx: None, storage="relative/dir", shared_every=5)


def test_the_yaml_takes_groups_as_mappings_and_the_old_top_level_keys():
    cfg = fit_groups({"storage": "/x", "tiers": {"shared_every": 5}, "min_nodes": 1, "output": {"progress": False}},
                     "run.yaml")
    assert cfg["tiers"] == cfdist.TierOptions(shared_every=5)
    assert cfg["recovery"] == cfdist.RecoveryOptions(min_nodes=1)
    assert cfg["output"] == cfdist.OutputOptions(progress=False) and "min_nodes" not in cfg
    with pytest.raises(UsageError, match=r"run.yaml: tiers: unknown key\(s\) 'min_nodes'; its keys are"):
        fit_groups({"tiers": {"min_nodes": 1}}, "run.yaml")
    with pytest.raises(UsageError, match=r"shared_every given both at the top level and under tiers"):
        fit_groups({"tiers": {"shared_every": 1}, "shared_every": 2}, "run.yaml")
    with pytest.raises(UsageError, match=r"recovery must be a mapping"):
        fit_groups({"recovery": 3}, "run.yaml")
