"""The cluster YAMLs pass Ray's own cluster-config checks; the Serve config passes Serve's schema."""
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ["cluster/aws-8gpu.yaml", "cluster/local.yaml"]


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_yaml_passes_ray_validation(name):
    config = prepare_config(copy.deepcopy(_load(name)))  # what `ray up` does before it validates
    validate_config(config)
    assert config["max_workers"] >= 1
    setup = " ".join(config["setup_commands"])
    assert "kdray" in setup and "pip install" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def test_aws_workers_have_eight_gpus():
    workers = [t for name, t in _load("cluster/aws-8gpu.yaml")["available_node_types"].items() if name != "head"]
    assert workers and all(t["resources"]["GPU"] == 8 for t in workers)


def test_local_yaml_names_head_and_workers():
    provider = _load("cluster/local.yaml")["provider"]
    assert provider["type"] == "local" and provider["head_ip"] and provider["worker_ips"]


def test_validation_rejects_a_broken_config():
    config = _load("cluster/aws-8gpu.yaml")
    config["max_worker"] = config.pop("max_workers")  # a typo
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_serve_config_matches_serve_schema_and_builder_args():
    from ray.serve.schema import ServeDeploySchema

    from kdray.serve import ServeArgs

    config = _load("kdray/serve/config.yaml")
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "kdray.serve:app"
    ServeArgs.parse(app["args"])
