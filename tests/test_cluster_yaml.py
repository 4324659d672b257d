"""The cluster YAMLs pass Ray's own cluster-config checks and start kdray for real: a head that takes no
replica, and a shared mount that holds the weights and batch data the Serve config names; the Serve config
passes Serve's schema and the builder's arguments."""
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cluster").glob("*.yaml"))
SHARED = "/shared"  # the mount every node of every cluster file makes


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def _prepared(name: str) -> dict:
    config = prepare_config(copy.deepcopy(_load(name)))  # what `ray up` does before it validates
    validate_config(config)
    return config


def _serve_args() -> dict:
    (app,) = _load("kdray/serve/config.yaml")["applications"]
    return app["args"]


def test_every_cluster_file_is_found():
    assert CLUSTERS == ["cluster/aws-8gpu.yaml", "cluster/local.yaml"]


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_yaml_passes_ray_validation(name):
    config = _prepared(name)
    assert config["max_workers"] >= 1
    setup = " ".join(config["setup_commands"])
    assert "kdray" in setup and "pip install" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


@pytest.mark.parametrize("name", CLUSTERS)
def test_the_head_takes_no_replica(name):
    """A replica asks for CPUs: a head with none to schedule keeps every replica (and its engine) on the GPU
    workers, where its shards are."""
    config = _prepared(name)
    head = config["available_node_types"][config["head_node_type"]]
    declared = head.get("resources", {}).get("CPU")
    started = " ".join(config["head_start_ray_commands"])
    assert declared == 0 or (declared is None and "--num-cpus=0" in started), (declared, started)
    assert all(t["resources"].get("GPU", 0) >= 1 for n, t in config["available_node_types"].items()
               if n != config["head_node_type"] and t.get("resources"))


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_node_mounts_the_storage_for_weights_and_batches(name):
    config = _load(name)
    for role in ("head", "worker"):
        commands = " ".join(config.get("setup_commands", []) + config.get(f"{role}_setup_commands", []))
        assert f" {SHARED}" in commands and ("mount" in commands or "ln -sfn" in commands), (role, commands)
    every = " ".join(config["setup_commands"] + config.get("worker_setup_commands", []))
    assert "mountpoint -q /shared ||" in every  # idempotent: `ray up` reruns it
    args = _serve_args()
    for key in ("model", "drafter", "batch_dir"):
        assert args[key].startswith(SHARED + "/"), (key, args[key])


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
    args = ServeArgs.parse(app["args"])
    assert args.device == "cuda"  # GPU workers may join after the app is built
    assert config["http_options"]["host"] == "127.0.0.1"  # open to other machines only when chosen
