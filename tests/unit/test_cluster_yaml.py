"""cluster.yaml: a Ray cluster-launcher config that Ray's own schema accepts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


def _load() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _schema() -> dict[str, Any]:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_cluster_yaml_matches_rays_schema() -> None:
    config = _load()
    jsonschema.validate(config, _schema())
    # Ray's own check, after filling in the provider's defaults as `ray up` does.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_has_head_cpu_and_gpu_groups_that_install_raysync() -> None:
    config = _load()
    nodes = config["available_node_types"]
    assert config["head_node_type"] in nodes
    workers = {name: spec for name, spec in nodes.items() if name != config["head_node_type"]}
    gpu = [
        name for name, spec in workers.items() if spec["node_config"]["InstanceType"].startswith(("g", "p"))
    ]
    cpu = [name for name, spec in workers.items() if name not in gpu]
    assert gpu and cpu, f"want a CPU and a GPU worker group, got {sorted(workers)}"
    assert any("pip install" in cmd and "raysync" in cmd for cmd in config["setup_commands"])
    assert "CHANGE" in CLUSTER_YAML.read_text()


def test_schema_check_catches_a_broken_config() -> None:
    """The check above can fail: a typo in a key is refused by the same schema."""
    config = _load()
    config["available_node_types"]["cpu.worker"]["min_worker"] = 1  # typo for min_workers
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        jsonschema.validate(config, _schema())
