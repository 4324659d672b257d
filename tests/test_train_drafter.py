"""DFlash drafter training: the dense many-anchor forward, the block layout, and a tiny run on k2-tiny."""
from __future__ import annotations

import json

import torch

from kdray.engine.request import SamplingParams
from kdray.llm import LLM
from kdray.model.batch import ForwardBatch, pack_bits
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import load_target
from kdray.train_drafter import lr_at, main, make_blocks, topic_passages


def test_dense_forward_matches_the_cached_forward():
    """One block after S context tokens: the training forward equals the inference forward over the paged cache."""
    target = load_target("k2-tiny")
    d = DFlashDrafter.random_for(target.config, block_size=4, dtype=torch.float32, device="cpu", seed=3)
    S, bs, page = 11, 4, 4
    g = torch.Generator().manual_seed(0)
    features = torch.randn(S, len(d.cfg.target_layer_ids) * d.cfg.hidden_size, generator=g)
    embeds = torch.randn(bs, d.cfg.hidden_size, generator=g)
    positions = torch.arange(S, S + bs)

    cache = torch.zeros(d.cfg.num_hidden_layers, 4, page, *d.kv_row_shape)
    table = torch.arange(4, dtype=torch.int32)[None]
    d.add_context(features, torch.arange(S), torch.arange(S), cache)
    batch = ForwardBatch.build(torch.zeros(bs, dtype=torch.int64), positions, [bs], [S], table, page,
                               pack_bits(torch.ones(1, bs, bs, dtype=torch.bool)))
    cached = d(embeds, batch, cache)

    mask = torch.ones(1, bs, S + bs, dtype=torch.bool)
    dense = d.forward_dense(embeds[None], positions[None], features[None], torch.arange(S)[None], mask)[0]
    torch.testing.assert_close(dense, cached, rtol=1e-4, atol=1e-4)


def test_blocks_sit_in_the_response_and_see_only_earlier_context():
    tokens = torch.arange(100, 130).view(1, 30)
    blocks = make_blocks(tokens, torch.tensor([30]), torch.tensor([10]), num_anchors=6, block_size=4,
                         mask_token_id=7, gamma=4.0, generator=torch.Generator().manual_seed(0))
    anchors = blocks.positions.view(6, 4)[:, 0]
    assert ((anchors >= 10) & (anchors <= 28)).all() and anchors.unique().numel() == 6
    ids = blocks.ids.view(6, 4)
    assert (ids[:, 0] == tokens[0, anchors]).all() and (ids[:, 1:] == 7).all()
    assert (blocks.labels[0] == 100 + (anchors[:, None] + torch.arange(1, 4)).clamp(max=29)).all()
    for i, a in enumerate(anchors.tolist()):
        rows = blocks.mask[0, 4 * i:4 * i + 4]  # [4, 30 + 24]
        assert rows[:, :a].all() and not rows[:, a:30].any()
        assert rows[:, 30 + 4 * i:30 + 4 * i + 4].all() and rows[:, 30:].sum() == 16
        expected = torch.exp(-torch.arange(3.0) / 4.0) * (a + torch.arange(1, 4) < 30)
        torch.testing.assert_close(blocks.weights[0, i], expected)


def test_passages_come_from_python_and_hold_out_whole_topics():
    train, heldout = topic_passages(800)
    assert len(train) > 200 and 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.2
    assert max(map(len, train + heldout)) <= 800 and not set(train) & set(heldout)


def test_a_few_steps_reduce_the_loss_and_write_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "drafter"
    assert main(["--model", "k2-tiny", "--output", str(out), "--device", "cpu", "--max-chars", "60",
                 "--num-prompts", "4", "--max-new-tokens", "12", "--layers", "1", "--target-layers", "2",
                 "--block-size", "8", "--steps", "24", "--batch-size", "4", "--anchors", "8", "--lr", "3e-3",
                 "--log-every", "1", "--checkpoints", "1", "--eval-prompts", "1", "--eval-tokens", "4",
                 "--eval-budget", "8"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    losses = [r["loss"] for r in log["curve"]]
    assert len(losses) == 24 and sum(losses[-4:]) < sum(losses[:4]) - 1.0
    assert set(log["evals"][0]) == {"step", "tau_chain", "tau_ddtree"}
    assert (out / "train_log.csv").read_text().startswith("step,")

    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 8 and config["dflash_config"]["target_layer_ids"] == [1]
    llm = LLM(model="k2-tiny", drafter=str(out), spec="ddtree", budget=8)
    res = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4))
    assert len(res[0].outputs[0].token_ids) == 4


def test_a_timed_run_spreads_its_schedule_and_checkpoints_over_the_time(tmp_path):
    out = tmp_path / "drafter"
    assert main(["--model", "k2-tiny", "--output", str(out), "--device", "cpu", "--max-chars", "60",
                 "--num-prompts", "4", "--max-new-tokens", "12", "--layers", "1", "--target-layers", "2",
                 "--block-size", "8", "--train-seconds", "3", "--batch-size", "4", "--anchors", "8",
                 "--log-every", "1", "--checkpoints", "2", "--eval-prompts", "1", "--eval-tokens", "4",
                 "--eval-budget", "8"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    curve = log["curve"]
    assert 3.0 <= log["train_seconds"] < 4.5 and log["steps"] == len(curve) > 10
    assert [e["step"] for e in log["evals"]][-1] == log["steps"] and len(log["evals"]) == 2
    peak = max(range(len(curve)), key=lambda i: curve[i]["lr"])
    assert curve[-1]["lr"] < 0.05 * curve[peak]["lr"] and peak < len(curve) / 4  # warmed up early, decayed by the end


def test_lr_warms_up_then_decays_to_zero():
    values = [lr_at(i / 100, 0.1) for i in range(100)]
    assert values[0] > 0 and abs(values[10] - 1) < 1e-9 and max(values) <= 1
    assert all(a <= b for a, b in zip(values[:10], values[1:11])) and all(a >= b for a, b in zip(values[10:], values[11:]))
    assert values[-1] < 1e-3


def test_smollm2_ships_a_loadable_drafter_and_other_models_none():
    from kdray.model.presets import builtin_drafter

    path = builtin_drafter("smollm2-135m")
    d = DFlashDrafter.from_pretrained(path, torch.bfloat16, "cpu")
    assert (d.cfg.hidden_size, d.cfg.vocab_size, d.cfg.num_target_layers, d.cfg.block_size) == (576, 49152, 30, 16)
    assert builtin_drafter("k2-tiny") is None and builtin_drafter(path) is None
