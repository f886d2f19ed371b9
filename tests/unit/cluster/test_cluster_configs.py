"""``cluster_configs/*.yaml`` pass Ray's own cluster-config validation (what ``ray up`` runs:
``prepare_config`` fills provider defaults, ``validate_config`` checks the JSON schema and the
node-type rules). No cloud API is called."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

pytest.importorskip("jsonschema")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "cluster_configs", "*.yaml")))


def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def test_there_is_a_local_an_aws_spot_and_a_gcp_preemptible_config():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"local.yaml", "aws-spot.yaml", "gcp-preemptible.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_passes_ray_validation(path):
    cfg = prepare_config(copy.deepcopy(_load(path)))
    validate_config(cfg)
    assert cfg["cluster_name"].startswith("cfdist")


@pytest.mark.parametrize("name, market", [("aws-spot.yaml", "spot"), ("gcp-preemptible.yaml", "SPOT")])
def test_cloud_workers_are_preemptible_and_the_head_runs_no_rank(name, market):
    cfg = _load(os.path.join(ROOT, "cluster_configs", name))
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    workers = [t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"]]
    assert workers and all(market in str(t["node_config"]) for t in workers)


def test_validation_rejects_a_broken_config():
    cfg = _load(os.path.join(ROOT, "cluster_configs", "aws-spot.yaml"))
    cfg["available_node_types"]["gpu_spot"]["min_workerz"] = 1   # typo
    with pytest.raises(Exception, match="min_workerz"):
        validate_config(prepare_config(cfg))
