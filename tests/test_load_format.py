"""``load_format="dummy"``: a model built from its checkpoint's config with seeded random weights, laid out as a
real load leaves them; ``benchmarks/serve_load.py``'s token-id requests for a model without a tokenizer; the K2
benchmarks' cells that do not fit a GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kdray import LLM, SamplingParams
from kdray.config import K2Config
from kdray.kernels.int4 import unpack_int4
from kdray.model.checkpoint import NoWeightsError
from kdray.model.loader import load_target, model_config
from kdray.model.presets import K2_TINY, k2_random_tensors, write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/

LLAMA_TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": 256, "tie_word_embeddings": True}
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "g": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}}}
# k2-tiny with INT4 experts 64 wide: on a GPU they are tiled (widths multiples of 64), on the CPU kept as read
K2_INT4 = dict(K2_TINY, moe_intermediate_size=64, quantization_config=INT4)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]


def config_dir(path, config: dict) -> str:
    """A checkpoint directory holding only ``config.json``."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def greedy(llm: LLM, n: int = 8) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


@pytest.mark.parametrize("config", [K2_TINY, LLAMA_TINY], ids=["k2", "llama"])
def test_dummy_llm_generates_the_same_tokens_on_two_builds(tmp_path, config):
    model = config_dir(tmp_path / "cfg", config)
    first, second = (greedy(LLM(model=model, load_format="dummy", device="cpu")) for _ in range(2))
    assert first == second
    assert [len(t) for t in first] == [8, 8] and all(0 <= t < config["vocab_size"] for s in first for t in s)
    assert len({t for s in first for t in s}) > 2  # random weights, not a constant output


def test_dummy_is_not_the_checkpoints_weights(tmp_path):
    """k2-tiny's config with random weights answers otherwise than k2-tiny (its weights are never read)."""
    dummy = greedy(LLM(model=config_dir(tmp_path / "cfg", K2_TINY), load_format="dummy", device="cpu"))
    assert dummy != greedy(LLM(model="k2-tiny", device="cpu"))


@pytest.mark.parametrize("device,dtype", [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("config", [K2_TINY, K2_INT4], ids=["dense-experts", "int4-experts"])
def test_dummy_weights_are_random_and_laid_out_as_a_real_load(tmp_path, config, device, dtype):
    """Every tensor of the dummy model has the real load's name, dtype and shape (INT4 experts packed as read on the
    CPU, tiled on a GPU), holds finite values, not all zero, and none of the checkpoint's; the global RNG is left
    alone."""
    path = tmp_path / "real"
    write_checkpoint(path, config, k2_random_tensors(K2Config.from_hf(config), seed=3,
                                                     int4_experts="quantization_config" in config))
    real = tensors(load_target(str(path), dtype, device).model)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    dummy = tensors(load_target(str(path), dtype, device, load_format="dummy").model)  # weights there, not read
    assert torch.equal(torch.rand(3), expected)  # its own generator: the global RNG is left as it was
    assert {n: (t.dtype, t.shape, t.device) for n, t in dummy.items()} == \
           {n: (t.dtype, t.shape, t.device) for n, t in real.items()}
    if "quantization_config" in config:
        tiled = device == "cuda"
        assert {t.dim() for n, t in dummy.items() if n.endswith("w13_packed")} == {4 if tiled else 3}
    for name, t in dummy.items():
        if name.endswith("inv_freq"):  # computed from the config, not a weight
            continue
        values = t.float() if t.is_floating_point() else t.view(torch.uint8).float()
        assert values.isfinite().all() and values.abs().sum() > 0, name
        assert not torch.equal(t, real[name]), name


def test_dummy_int4_experts_are_symmetric_about_zero(tmp_path):
    """Dummy INT4 experts take every value in [-7, 7] and average zero (uniform nibbles would give q = -8 as well and
    a mean of -1/2, a part every expert row shares)."""
    model = load_target(config_dir(tmp_path / "cfg", K2_INT4), "float32", "cpu", load_format="dummy").model
    q = torch.cat([unpack_int4(t, t.shape[-1] * 8).flatten() for n, t in tensors(model).items()
                   if n.endswith("_packed")]).float()
    assert q.min() == -7 and q.max() == 7 and len(q.unique()) == 15
    assert abs(q.mean().item()) < 0.02


def test_a_dummy_k2_shard_keeps_its_tokens_apart():
    """A 12-layer K2 shard of k2_step's kind (INT4 experts, 64 of them here), 17 tokens after a random latent cache:
    at the last MoE layer the tokens' inputs are not alike and the router reaches about as many experts as a uniform
    router would (with uniform nibbles: cosine 0.18 and 47 experts; symmetric: 0.005 and 58, a uniform router
    56)."""
    from benchmarks.k2_step import shard_hf_config, touched_experts, verify_batch
    from kdray.model.dummy import fill_random
    from kdray.model.k2 import K2Model, MoE

    hf = shard_hf_config(12)
    hf.update(hidden_size=512, vocab_size=1024, n_routed_experts=64, q_lora_rank=128, kv_lora_rank=128,
              intermediate_size=256)
    cfg = K2Config.from_hf(hf)
    model = fill_random(K2Model(cfg, torch.float32))
    cosines = []

    def mean_cosine(moe, args):
        x = torch.nn.functional.normalize(args[0].float(), dim=-1)
        c = x @ x.t()
        cosines.append(((c.sum() - c.diagonal().sum()) / (len(x) * (len(x) - 1))).item())

    hook = [m for m in model.modules() if isinstance(m, MoE)][-1].register_forward_pre_hook(mean_cosine)
    batch, kv = verify_batch(cfg, 1, 16, 256, "cpu", torch.float32)
    with torch.no_grad():
        touched = touched_experts(model, lambda: model(batch, kv))
    hook.remove()
    uniform = 64 * (1 - (1 - 1 / 64) ** (17 * cfg.num_experts_per_tok))
    assert cosines[0] < 0.1
    assert touched[-1] >= 0.85 * uniform


def test_a_preset_and_a_gguf_take_dummy_from_their_config(smollm2):
    dummy = load_target("smollm2-135m", load_format="dummy")  # the preset is a GGUF file
    assert dummy.config == smollm2.config and dummy.tokenizer is not None
    assert dummy.tokenizer.encode("hello world") == smollm2.tokenizer.encode("hello world")
    real = tensors(smollm2.model)
    for name, t in tensors(dummy.model).items():
        assert t.shape == real[name].shape and (name.endswith("inv_freq") or not torch.equal(t, real[name])), name


def test_bad_load_format_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match="load_format='bogus' must be one of auto, dummy"):
        LLM(model="k2-tiny", load_format="bogus", device="cpu")
    with pytest.raises(ValueError, match="load_format='bogus' must be one of auto, dummy"):
        load_target("k2-tiny", load_format="bogus")


def test_a_loaded_target_refuses_a_load_format():
    target = load_target("k2-tiny")
    with pytest.raises(ValueError, match="load_format='dummy' chooses how a model given by name is loaded"):
        LLM(model=target, load_format="dummy")


def test_a_config_only_directory_without_dummy_says_how_to_run_it(tmp_path):
    model = config_dir(tmp_path / "cfg", K2_TINY)
    with pytest.raises(NoWeightsError, match=r"no model.safetensors .*load_format='dummy'"):
        load_target(model)
    with pytest.raises(NoWeightsError, match="load_format='dummy'"):
        LLM(model=model, device="cpu")


def test_k2_shard_config_directory_holds_the_shards_config(tmp_path):
    from benchmarks.k2_step import shard_config
    from benchmarks.serve_load import write_id_model_config

    path = write_id_model_config("k2-shard", tmp_path / "shard", layers=3)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    assert model_config(str(path)) == shard_config(3)
    assert shard_config(3).num_hidden_layers == 3 and shard_config(3).quantization.group_size == 32


def test_benchmark_cells_past_the_gpus_memory_are_reported_and_the_rest_run(capsys):
    """k2_step's 32x64 cell does not fit an 80 GB H100: its row says OOM and the cells after it still run."""
    from benchmarks.common import run_cells

    def measure(cell):
        if cell == "32x64":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.85 GiB.\nmore")
        return [cell, "ok"]

    rows = run_cells(["1x0", "32x64", "8x0"], measure, lambda cell: [cell, "OOM"])
    assert rows == [["1x0", "ok"], ["32x64", "OOM"], ["8x0", "ok"]]
    assert "# 32x64: out of memory (CUDA out of memory. Tried to allocate 8.85 GiB.)" in capsys.readouterr().out


def test_serve_load_id_prompts_share_their_prefix_and_differ_after_it():
    from benchmarks.serve_load import id_prompts

    prompts = id_prompts(vocab=500, n=5, prefix_tokens=100)
    assert [len(p) for p in prompts] == [132] * 5
    assert all(p[:100] == prompts[0][:100] for p in prompts)
    assert len({tuple(p[100:]) for p in prompts}) == 5
    assert all(0 <= t < 500 for p in prompts for t in p) and len(set(prompts[0])) > 50
    assert id_prompts(500, 5, 100) == prompts  # seeded
    longer = id_prompts(500, 5, 100, own_tokens=11)  # a 90% hit rate
    assert [len(p) for p in longer] == [111] * 5 and longer[0][:100] == prompts[0][:100]
    assert id_prompts(500, 5, 100, seed=1)[0][:100] != prompts[0][:100]


@pytest.mark.parametrize("name", ["llama3-8b", "codellama-34b"])
def test_serve_load_dense_models_are_their_published_configs_with_random_weights(tmp_path, name):
    from benchmarks.serve_load import DENSE_CONFIGS, model_args, parse_args

    args = parse_args(["--model", name, "--workload", "shared-prefix", "--own-tokens", "228"])
    assert args.specs == ["ar"]
    builder = model_args(args, tmp_path)
    assert builder["load_format"] == "dummy" and builder["served_model_name"] == name
    assert builder["max_model_len"] == 2048 + 228 + 256
    cfg = model_config(builder["model"])
    assert cfg.architecture == "llama" and cfg.vocab_size == DENSE_CONFIGS[name]["vocab_size"]
    published = DENSE_CONFIGS[name]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == tuple(published[k] for k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"))
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in published)
    with pytest.raises(SystemExit):  # no tokenizer: the chat workload is refused up front
        parse_args(["--model", name])
    with pytest.raises(SystemExit):
        parse_args(["--model", name, "--workload", "shared-prefix", "--own-tokens", "0"])
    # long prompts as token ids: a context for them, room for the streams and an arrival
    args = parse_args(["--model", name, "--workload", "long-prompt", "--long-tokens", "16384", "--concurrency", "8"])
    builder = model_args(args, tmp_path / "long")
    assert (builder["max_model_len"], builder["max_num_seqs"]) == (16384 + 256, 10)


def test_serve_load_sends_token_ids_as_a_completion_and_text_as_a_chat():
    from benchmarks.serve_load import parse_args, request_body

    path, body = request_body("k2-shard", [3, 4, 5], 16)
    assert path == "/v1/completions" and body["prompt"] == [3, 4, 5] and body["return_token_ids"] is True
    assert body["stream"] is True and body["max_tokens"] == 16 and "messages" not in body
    path, body = request_body("m", "a question", 16, system="shared")
    assert path == "/v1/chat/completions" and "return_token_ids" not in body
    assert body["messages"] == [{"role": "system", "content": "shared"}, {"role": "user", "content": "a question"}]
    assert parse_args(["--model", "k2-shard", "--workload", "shared-prefix"]).specs == ["ar"]
    assert parse_args([]).specs == ["ar", "chain", "ddtree:auto"]
    with pytest.raises(SystemExit):  # no tokenizer: the chat workload is refused up front
        parse_args(["--model", "k2-shard"])


def test_serve_load_long_prompt_streams_decode_until_the_last_prompt_is_in(monkeypatch):
    """The long-prompt workload's streams keep sending requests until the last long prompt has its first token, so
    their gaps span the arrivals (single requests of a fast model used to end before the first prompt came)."""
    import asyncio

    import benchmarks.serve_load as sl

    log = []  # (time, kind) of each request's end

    async def fake_request(session, url, model, prompt, max_tokens, system=None):
        await asyncio.sleep(0.004 if len(prompt) < 1000 else 0.02)
        log.append((asyncio.get_running_loop().time(), "long" if len(prompt) >= 1000 else "stream"))
        return {"gaps": [0.001] * max_tokens}

    async def fake_scrape(session, url):
        return {'kdray_step_seconds_count{stage="total"}': 10.0,
                'kdray_step_seconds_bucket{le="0.1",stage="total"}': 10.0}

    monkeypatch.setattr(sl, "one_request", fake_request)
    monkeypatch.setattr(sl, "scrape", fake_scrape)
    args = sl.parse_args(["--model", "llama3-8b", "--workload", "long-prompt", "--long-tokens", "2000",
                          "--long-every", "0.03", "--concurrency", "2", "--max-tokens", "3"])
    r = asyncio.run(sl.long_prompts("http://x", "llama3-8b", args, [], 2))
    last_long = max(t for t, kind in log if kind == "long")
    assert [kind for _, kind in log].count("long") == 3
    assert sum(kind == "stream" for t, kind in log if t < last_long) > 20  # decoding while the prompts arrive
    assert sum(kind == "stream" for t, kind in log if t > last_long) <= 2  # and each stream stops after the last
    assert r["gap_p50"] == 0.001 and r["gap_max"] == 0.001
