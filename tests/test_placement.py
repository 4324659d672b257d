"""Where an engine goes, decided when the app is built: the TP width checked against the model (heads, experts;
any vocabulary is padded), and a replica asking Serve for its engine's actors as bundles after its own."""
import json

import pytest
import torch

from kdray.model.presets import K2_TINY
from kdray.serve import ServeArgs, app
from kdray.serve.server import replica_options


def test_the_tp_width_is_checked_against_the_model_when_the_app_is_built(tmp_path):
    heads = (r"tp=3 does not fit model 'k2-tiny': num_attention_heads=4 is not divisible by the tensor-parallel "
             r"width 3; widths up to 8 that fit: 1, 2, 4$")
    with pytest.raises(ValueError, match=heads):
        app({"model": "k2-tiny", "tp": 3, "device": "cpu"})
    six = tmp_path / "six-experts"  # a config is enough: no weight is read
    six.mkdir()
    (six / "config.json").write_text(json.dumps(dict(K2_TINY, n_routed_experts=6, n_group=2)))
    with pytest.raises(ValueError, match=r"tp=4 with expert_parallel does not fit .*n_routed_experts=6 is not "
                                         r"divisible by the tensor-parallel width 4; widths up to 8 that fit: 1, 2$"):
        app({"model": str(six), "tp": 4, "expert_parallel": True, "device": "cpu"})
    app({"model": str(six), "tp": 4, "device": "cpu"})  # split by width, six experts are fine
    prime = tmp_path / "vocab-211"
    prime.mkdir()
    (prime / "config.json").write_text(json.dumps(dict(K2_TINY, vocab_size=211)))
    app({"model": str(prime), "tp": 4, "device": "cpu"})  # the vocabulary is padded, so it never refuses a width
    app({"model": "/weights/only/on/the/workers", "tp": 3, "device": "cpu"})  # checked in the replica instead


@pytest.mark.slow
def test_a_replica_asks_serve_for_its_engines_bundles(ray_cluster):
    gpus = replica_options(ServeArgs.parse({"model": "k2-tiny", "tp": 2, "device": "cuda", "drafter": "random"}))
    # no node of this cluster has a GPU for the drafter beside the shards': it shares shard 0's
    assert gpus == {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}, "placement_group_strategy": "STRICT_PACK",
                    "placement_group_bundles": [{"CPU": 0.5}, {"CPU": 1.0, "GPU": 1}, {"CPU": 0.5, "GPU": 1}]}
    cpu = replica_options(ServeArgs.parse({"model": "k2-tiny", "tp": 2, "device": "cpu", "drafter": "random"}))
    assert cpu["placement_group_bundles"] == [{"CPU": 0.5}] * 4  # the replica, two shards, the drafter
    assert replica_options(ServeArgs.parse({"model": "k2-tiny", "device": "cuda"})) == {
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1}}  # an engine in the replica's own process
    visible = int(torch.cuda.is_available())
    assert replica_options(ServeArgs.parse({"model": "k2-tiny"})) == {
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": visible}}  # without a device: the GPUs there are now
