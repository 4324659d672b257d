"""DFlash drafter training: the dense many-anchor forward, the block layout, features per batch, tiny runs on k2-tiny
(one, timed, and split into resumed runs), and the per-category held-out tau benchmark."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from kdray.engine.request import SamplingParams
from kdray.llm import LLM
from kdray.model.batch import ForwardBatch, pack_bits
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import load_target
from kdray.train_drafter import Corpus, lr_at, main, make_blocks, target_features, topic_passages
from kdray.train_state import STATE_FILE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
pytestmark = pytest.mark.usefixtures("one_thread")


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


def timed_run(out: Path, **flags) -> list[str]:
    """train-drafter's arguments for a timed run of k2-tiny with two checkpoints into ``out``, plus ``flags``
    (``train_seconds=3`` -> ``--train-seconds 3``)."""
    fixed = {"model": "k2-tiny", "device": "cpu", "max_chars": 60, "layers": 1, "target_layers": 2, "block_size": 8,
             "checkpoints": 2, "eval_prompts": 1}
    return ["--output", str(out)] + [a for k, v in {**fixed, **flags}.items() for a in (f"--{k.replace('_', '-')}",
                                                                                         str(v))]


def test_a_timed_run_spreads_its_schedule_and_checkpoints_over_the_time(tmp_path):
    out = tmp_path / "drafter"
    assert main(timed_run(out, num_prompts=4, max_new_tokens=12, train_seconds=3, batch_size=4, anchors=8,
                          log_every=1, eval_tokens=4, eval_budget=8)) == 0
    log = json.loads((out / "train_log.json").read_text())
    curve = log["curve"]
    assert 3.0 <= log["train_seconds"] < 4.5 and log["steps"] == len(curve) > 10
    assert [e["step"] for e in log["evals"]][-1] == log["steps"] and len(log["evals"]) == 2
    peak = max(range(len(curve)), key=lambda i: curve[i]["lr"])
    assert curve[-1]["lr"] < 0.05 * curve[peak]["lr"] and peak < len(curve) / 4  # warmed up early, decayed by the end


@pytest.mark.parametrize("tick", [0.011, 0.013, 0.017, 0.019])
def test_the_step_that_ends_a_timed_schedule_is_checkpointed(tmp_path, monkeypatch, tick):
    """However the clock falls between steps, the run ends with a checkpoint of its last step: a clock read after the
    step's checkpoint check once ended the loop without one, losing the run's last steps (the drafter exported and the
    log are those of the checkpoint before). The clock here advances ``tick`` seconds at every reading."""
    import itertools

    from kdray import train_drafter

    clock = itertools.count()
    monkeypatch.setattr(train_drafter.time, "perf_counter", lambda: next(clock) * tick)
    out = tmp_path / "drafter"
    assert main(timed_run(out, num_prompts=2, max_new_tokens=4, train_seconds=0.6, batch_size=2, anchors=2,
                          log_every=100, eval_tokens=2, eval_budget=4)) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["complete"] and log["train_seconds"] >= 0.6
    assert log["evals"][-1]["step"] == log["steps"] == log["curve"][-1]["step"]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_computed_per_batch_equal_one_pass_over_the_whole_corpus(dtype):
    target = load_target("k2-tiny", dtype, "cpu")
    rng = random.Random(0)
    seqs = [[rng.randrange(1024) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    corpus = Corpus.build(seqs, [3] * len(seqs), torch.device("cpu"))
    layers = (0, 2)
    whole = target_features(target, torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs], layers,
                            tokens_per_pass=60, seqs_per_pass=3)  # [sum(len), 2 * 64], other groups of sequences
    assert whole.dtype == dtype and whole.shape == (sum(map(len, seqs)), 128)
    idx = [7, 2, 5, 0]
    tokens, features, lens, prompt_lens = corpus.batch(idx, target, layers)
    S = max(len(seqs[i]) for i in idx)
    assert tokens.shape == (4, S) and features.shape == (4, S, 128) and features.dtype == dtype
    assert lens.tolist() == [len(seqs[i]) for i in idx] and prompt_lens.tolist() == [3] * 4
    for b, i in enumerate(idx):
        n, start = len(seqs[i]), sum(map(len, seqs[:i]))
        assert tokens[b].tolist() == seqs[i] + [seqs[i][-1]] * (S - n)  # padded with the last token
        torch.testing.assert_close(features[b, :n], whole[start:start + n])  # passes of other sizes: rounding only
        assert torch.equal(features[b, n:], features[b, n - 1].expand(S - n, -1))


RUN = ["--model", "k2-tiny", "--device", "cpu", "--max-chars", "60", "--num-prompts", "4", "--max-new-tokens", "12",
       "--layers", "1", "--target-layers", "2", "--block-size", "8", "--steps", "6", "--batch-size", "2",
       "--anchors", "8", "--lr", "3e-3", "--log-every", "1", "--checkpoints", "1", "--eval-prompts", "1",
       "--eval-tokens", "4", "--eval-budget", "8"]
ONE_STEP = ["--train-seconds", "1e-9"]  # a run stops after its first step (its time is checked after each step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """6 steps in one run, and in three: one step, one more (resumed), the rest (resumed)."""
    one, split = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("split")
    assert main([*RUN, "--output", str(one)]) == 0
    assert main([*RUN, "--output", str(split), *ONE_STEP]) == 0
    assert torch.load(split / STATE_FILE, weights_only=True)["step"] == 1
    assert main([*RUN, "--output", str(split), *ONE_STEP, "--resume"]) == 0
    assert main([*RUN, "--output", str(split), "--resume"]) == 0
    return one, split


def test_a_run_split_into_resumed_runs_ends_as_one_run_does(runs):
    one, split = (torch.load(d / STATE_FILE, weights_only=True) for d in runs)
    assert one["step"] == split["step"] == 6 and one["log"]["complete"] and split["log"]["complete"]
    assert one["drafter"].keys() == split["drafter"].keys()
    for name, w in one["drafter"].items():
        assert torch.equal(w, split["drafter"][name]), name
    for a, b in zip(one["optimizer"]["state"].values(), split["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    curves = [[(r["step"], r["lr"], r["loss"]) for r in s["log"]["curve"]] for s in (one, split)]
    assert curves[0] == curves[1] and len(curves[0]) == 6
    assert [(r["from_step"], r["to_step"]) for r in split["log"]["runs"]] == [(0, 1), (1, 2), (2, 6)]
    assert [e["step"] for e in split["log"]["evals"]] == [1, 2, 6]  # each run saves a checkpoint when it stops
    assert json.loads((runs[1] / "train_log.json").read_text())["steps"] == 6
    assert (runs[0] / "model.safetensors").read_bytes() == (runs[1] / "model.safetensors").read_bytes()


def test_a_resume_with_other_settings_is_refused_naming_them(runs, tmp_path, capsys):
    from kdray.cli import main as kdray_main

    split = str(runs[1])
    assert main([*RUN, "--output", split, "--resume"]) == 0  # the schedule is done
    assert "nothing to do" in capsys.readouterr().err
    changed = [a if a != "3e-3" else "1e-3" for a in RUN]
    assert kdray_main(["train-drafter", *changed, "--layers", "2", "--output", split, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--lr: 0.003 then, 0.001 now" in err and "--layers: 1 then, 2 now" in err and "--batch-size" not in err
    with pytest.raises(ValueError, match=r"training data .* \{'sequences': 4, .* \{'sequences': 3,"):
        main([*RUN, "--num-prompts", "3", "--output", split, "--resume"])
    with pytest.raises(ValueError, match="pass --resume to continue it"):
        main([*RUN, "--output", split])
    with pytest.raises(ValueError, match="holds no training state"):
        main([*RUN, "--output", str(tmp_path), "--resume"])


def test_init_starts_a_new_run_from_a_drafters_weights(runs, tmp_path):
    """--init loads the weights (lr 0 keeps them: the export equals the source) with a new schedule; a drafter of
    another shape is refused naming the field."""
    one = runs[0]
    still = [a if a != "3e-3" else "0" for a in RUN]
    assert main([*still, "--steps", "1", "--output", str(tmp_path / "a"), "--init", str(one)]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    state = torch.load(tmp_path / "a" / STATE_FILE, weights_only=True)
    assert state["step"] == 1 and state["log"]["args"]["init"] == str(one)
    with pytest.raises(ValueError, match="num_hidden_layers 1 there, 2 here"):
        main([*RUN, "--layers", "2", "--output", str(tmp_path / "b"), "--init", str(one)])
    with pytest.raises(SystemExit):
        main([*RUN, "--output", str(one), "--init", str(one), "--resume"])


def test_drafter_tau_prints_a_row_per_category_and_mode(tmp_path, capsys):
    from benchmarks.drafter_tau import main as drafter_tau

    target = load_target("k2-tiny")
    for seed in (1, 2):
        DFlashDrafter.random_for(target.config, block_size=8, dtype=torch.float32, device="cpu",
                                 seed=seed).save(tmp_path / f"drafter{seed}")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = [{"id": str(i), "source": "words", "doc": f"words:{i}", "kind": "word", "category": c,
             "prompt": f"Prompt {i} about {c}."} for i, c in enumerate(["math", "code", "math", "writing", "code"])]
    (corpus / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tau.json"
    assert drafter_tau(["--corpus", str(corpus), "--model", "k2-tiny", "--device", "cpu", "--drafter",
                        str(tmp_path / "drafter1"), "--compare", str(tmp_path / "drafter2"), "--budgets", "8", "16",
                        "--prompts-per-category", "1", "--max-tokens", "6", "--json", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| category | sampling | mode | tau drafter1 | tau drafter2 | drafter2 / drafter1 |"
    cells = [line.split(" | ")[:3] for line in lines[1:]]
    assert cells == [[f"| {c}", s, m] for c in ("code", "math", "writing", "all") for s in ("greedy", "T=0.7")
                     for m in ("chain", "ddtree 8", "ddtree 16")]
    result = json.loads(out.read_text())
    assert result["prompts"] == {"code": 1, "math": 1, "writing": 1}
    taus = [v for d in result["tau"].values() for m in d.values() for t in m.values() for v in t.values()]
    assert len(taus) == 2 * 3 * 2 * 4 and all(1.0 <= v <= 9.0 for v in taus)
