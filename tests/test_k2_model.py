"""The K2 target against transformers' DeepseekV3, the absorbed latent path, and INT4 checkpoints."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from k2_checkpoints import make_hf_k2, quantize_experts_int4, write_dequantized_twin
from safetensors.torch import load_file, save_file

from kdray import LLM, SamplingParams
import kdray.model.k2 as k2
from kdray.model.batch import prompt_chunks
from kdray.model.checkpoint import CheckpointError
from kdray.model.loader import load_target
from kdray.model.k2 import MoE

PAGE = 16


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def forward_logits(target, chunks: list[list[int]], prefix: list[int] | None = None, kv=None):
    """Run prompts (prefill when no prefix) through kdray; returns logits and the cache."""
    m = target.model
    kv = torch.zeros(m.cfg.num_hidden_layers, 64, PAGE, *m.kv_row_shape) if kv is None else kv
    B = len(chunks)
    table = torch.arange(B * 8, dtype=torch.int32).view(B, 8)
    prefix = prefix or [0] * B
    ids = torch.tensor([t for c in chunks for t in c])
    pos = torch.cat([torch.arange(p, p + len(c)) for p, c in zip(prefix, chunks)])
    batch = prompt_chunks(ids, pos, [len(c) for c in chunks], prefix, table, PAGE)  # as the engine builds it
    hidden, _ = m(batch, kv)
    return m.logits(hidden), kv


@pytest.fixture(scope="module", params=["grouped", "plain"])
def hf_k2(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"k2-{request.param}")
    model = make_hf_k2(path, request.param, seed=1)
    return model, path


def test_prefill_logits_match_transformers(hf_k2):
    hf, path = hf_k2
    target = load_target(str(path))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (32, 7, 19)]
    ours, _ = forward_logits(target, prompts)
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert rel_err(ours[start:start + len(p)], ref) < 1e-4
        start += len(p)


@pytest.mark.parametrize("form", ["absorbed", "plain"])
def test_chunks_after_the_latent_cache_match_whole_prompts(hf_k2, form, monkeypatch):
    """Chunks after cached tokens, in the absorbed form over the latent cache or (``PLAIN_CHUNK_TOKENS`` lowered) in
    the plain form over the cached rows expanded by kv_b, give the logits of the whole prompts' prefill."""
    _, path = hf_k2
    target = load_target(str(path))
    gen = torch.Generator().manual_seed(6)
    full = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (30, 21)]
    whole, _ = forward_logits(target, full)
    cut = [12, 17]
    _, kv = forward_logits(target, [f[:c] for f, c in zip(full, cut)])
    plain_calls = []
    attend = k2.mla_prefill_attention
    monkeypatch.setattr(k2, "mla_prefill_attention", lambda *a: plain_calls.append(len(a)) or attend(*a))
    if form == "plain":
        monkeypatch.setattr(k2, "PLAIN_CHUNK_TOKENS", 4)
    tail, _ = forward_logits(target, [f[c:] for f, c in zip(full, cut)], prefix=cut, kv=kv)
    assert plain_calls == ([9] * target.model.cfg.num_hidden_layers if form == "plain" else [])  # with the keys' cu
    expect = torch.cat([whole[cut[0]:30], whole[30 + cut[1]:]])
    assert rel_err(tail, expect) < 1e-5


def test_greedy_generate_matches_transformers(hf_k2):
    hf, path = hf_k2
    llm = LLM(model=str(path), spec="ar")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=32))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(p):]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    make_hf_k2(root / "bf", "grouped", seed=2)
    written = quantize_experts_int4(root / "bf", root / "q")
    write_dequantized_twin(root / "bf", root / "deq", written)
    return root, written


def test_int4_experts_load_packed_and_match_dequantized(int4_pair):
    root, written = int4_pair
    q = load_target(str(root / "q"))
    deq = load_target(str(root / "deq"))
    prompts = [list(range(3, 40)), list(range(100, 113))]
    a, _ = forward_logits(q, prompts)
    b, _ = forward_logits(deq, prompts)
    assert rel_err(a, b) < 1e-4
    moe = q.model.layers[1].mlp
    assert moe.w13_packed.dtype == torch.int32
    inner = moe.inner
    for e in range(moe.experts):
        base = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(moe.w13_packed[e, :inner], written[f"{base}.gate_proj"]["weight_packed"])
        assert torch.equal(moe.w13_packed[e, inner:], written[f"{base}.up_proj"]["weight_packed"])
        assert torch.equal(moe.w2_packed[e], written[f"{base}.down_proj"]["weight_packed"])
        assert torch.equal(moe.w2_scale[e], written[f"{base}.down_proj"]["weight_scale"])
    assert not moe.tile_experts()  # width 32: not a multiple of 64, stays as loaded


def test_tiled_int4_experts_compute_the_same(tmp_path):
    """The tiled layout MoE.load gives the experts on a GPU (tile_experts) computes the same logits."""
    make_hf_k2(tmp_path / "bf", "grouped", seed=3, moe_inner=64)
    quantize_experts_int4(tmp_path / "bf", tmp_path / "q")
    q = load_target(str(tmp_path / "q"))
    prompts = [list(range(3, 20))]
    a, _ = forward_logits(q, prompts)
    moes = [m for m in q.model.modules() if isinstance(m, MoE)]
    assert all(m.tile_experts() for m in moes) and moes[0].w13_packed.dim() == 4
    assert not moes[0].tile_experts()  # once
    assert torch.equal(forward_logits(q, prompts)[0], a)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(int4_pair, tmp_path):
    bad = _copy(int4_pair[0] / "bf", tmp_path / "bad")
    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.0.self_attn.kv_b_proj.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.kv_b_proj.weight.*missing"):
        load_target(str(bad))


def test_wrong_shape_names_expected_and_found(int4_pair, tmp_path):
    bad = _copy(int4_pair[0] / "bf", tmp_path / "bad")
    t = load_file(str(bad / "model.safetensors"))
    t["model.norm.weight"] = torch.ones(63)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\[63\].*expected \[64\]"):
        load_target(str(bad))


def test_unknown_model_type(int4_pair, tmp_path):
    bad = _copy(int4_pair[0] / "bf", tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model_type 'mixtral'"):
        load_target(str(bad))


def test_corrupt_index_and_missing_shard(int4_pair, tmp_path):
    bad = _copy(int4_pair[0] / "bf", tmp_path / "bad")
    (bad / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt index"):
        load_target(str(bad))
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "gone.st"}}))
    with pytest.raises(CheckpointError, match="shard 'gone.st'.*missing"):
        load_target(str(bad))


def test_sharded_checkpoint_loads(int4_pair, tmp_path):
    src = int4_pair[0] / "bf"
    dst = tmp_path / "sharded"
    dst.mkdir()
    t = load_file(str(src / "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, str(dst / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(src / "config.json", dst / "config.json")
    a, _ = forward_logits(load_target(str(src)), [[1, 2, 3]])
    b, _ = forward_logits(load_target(str(dst)), [[1, 2, 3]])
    assert torch.equal(a, b)


@pytest.mark.parametrize("field,value,message", [
    ("num_experts_per_tok", 99, "num_experts_per_tok=99"),
    ("n_group", 3, "n_group=3 must divide"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim=7 must be even"),
])
def test_config_values_that_do_not_fit(field, value, message):
    from kdray.config import K2Config
    from kdray.model.presets import K2_TINY

    with pytest.raises(ValueError, match=message):
        K2Config.from_hf({**K2_TINY, field: value})


def test_missing_config_field():
    from kdray.config import K2Config
    from kdray.model.presets import K2_TINY

    raw = dict(K2_TINY)
    del raw["kv_lora_rank"]
    with pytest.raises(ValueError, match="missing required field 'kv_lora_rank'"):
        K2Config.from_hf(raw)


def test_k2_tiny_preset_is_deterministic_and_generates():
    llm = LLM(model="k2-tiny", spec="ar")
    a = llm.generate(prompt_token_ids=[[5, 6, 7], [9] * 20], sampling_params=SamplingParams(max_tokens=8))
    b = llm.generate(prompt_token_ids=[[5, 6, 7], [9] * 20], sampling_params=SamplingParams(max_tokens=8))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 8 for o in a)
