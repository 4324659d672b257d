"""Llama-family target against HF transformers: random tiny checkpoints and SmolLM2-135M from its GGUF."""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import transformers

from kdray.config import LlamaConfig, load_model_config
from kdray.model.batch import ForwardBatch, causal_tree_mask, pack_bits
from kdray.model.llama import LlamaModel
from kdray.model.loader import load_target
from kdray.model.parallel import Collectives, SingleGroup


pytestmark = pytest.mark.usefixtures("one_thread")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def new_cache(model, tokens: int, seqs: int = 1, page_size: int = 4) -> torch.Tensor:
    """A zeroed ``[layers, P, S, 2, Hkv, D]`` cache with ``ceil(tokens / S)`` pages per sequence."""
    pages = seqs * -(-tokens // page_size)
    return torch.zeros(model.cfg.num_hidden_layers, pages, page_size, *model.kv_row_shape, dtype=model.dtype)


def run(model, cache, seqs: list[list[int]], prefix_lens: list[int], tree_mask=None, positions=None,
        target_layer_ids=()):
    """One pass over ``seqs`` (sequence b's tokens follow ``prefix_lens[b]`` cached ones; pages split evenly)
    -> (fp32 logits per sequence, the drafter's context features)."""
    q_lens = [len(s) for s in seqs]
    if positions is None:
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, q_lens)])
    table = torch.arange(cache.shape[1], dtype=torch.int32).view(len(seqs), -1)
    batch = ForwardBatch.build(torch.tensor([t for s in seqs for t in s]), positions, q_lens, prefix_lens, table,
                               cache.shape[2], tree_mask)
    with torch.no_grad():
        hidden, features = model(batch, cache, target_layer_ids)
        return model.logits(hidden).split(q_lens), features


def hf_forward(hf, ids: list[int]):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True)


# ---------------------------------------------------------------- (a) random tiny checkpoints

def make_tiny(path, tied: bool, llama3: bool):
    """A random tiny LlamaForCausalLM (GQA 4/2 heads, random norms) saved to ``path``; returns it."""
    torch.manual_seed(7 + tied)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256, initializer_range=0.1,
        tie_word_embeddings=tied, rope_parameters=LLAMA3_ROPE if llama3 else {"rope_type": "default",
                                                                               "rope_theta": 5000.0})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(params=[(False, False), (True, True)], ids=["untied-default-rope", "tied-llama3-rope"])
def tiny(request, tmp_path):
    tied, llama3 = request.param
    hf = make_tiny(tmp_path, tied, llama3)
    return hf, load_target(str(tmp_path)).model, tmp_path


def test_config_from_hf(tiny):
    hf, model, path = tiny
    cfg = load_model_config(path)
    assert isinstance(cfg, LlamaConfig) and cfg.architecture == "llama"
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.eos_token_ids) == (2, 16, (2,))
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (cfg.rope_scaling is not None) == (hf.config.rope_parameters["rope_type"] == "llama3")
    assert model.kv_row_shape == (2, 2, 16)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_prefill_matches_transformers(tiny):
    hf, model, _ = tiny
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (11, 7)]
    cache = new_cache(model, 12, seqs=2)
    logits, features = run(model, cache, prompts, [0, 0], target_layer_ids=(0, 1))
    features = features.split([11, 7])
    for ids, got, got_features in zip(prompts, logits, features):
        ref = hf_forward(hf, ids)
        assert rel_err(got, ref.logits[0]) < 1e-4
        # hidden_states[i + 1] is decoder layer i's output (before the final norm for all but the last layer)
        assert rel_err(got_features, torch.cat(ref.hidden_states[1:3], dim=-1)[0]) < 1e-4


def test_verify_chain_matches_full_recompute(tiny):
    hf, model, _ = tiny
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 9)]
    chains = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 3)]
    cache = new_cache(model, 16, seqs=2)
    run(model, cache, prefixes, [0, 0])
    logits, _ = run(model, cache, chains, [6, 9], tree_mask=causal_tree_mask([5, 3], torch.device("cpu")))
    for prefix, chain, got in zip(prefixes, chains, logits):
        ref = hf_forward(hf, prefix + chain).logits[0, len(prefix):]
        assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("q_lens", [[1], [5, 3], [31, 32], [33], [64, 2], [100]])
def test_causal_tree_mask_is_the_packed_lower_triangle(q_lens):
    """The device-made causal mask equals the lower triangle packed by pack_bits, word boundaries included."""
    q = max(q_lens)
    i = torch.arange(q)
    want = pack_bits(i[None, :] <= i[:, None]).expand(len(q_lens), q, (q + 31) // 32)
    got = causal_tree_mask(q_lens, torch.device("cpu"))
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_verify_tree_branches(tiny):
    """A root with two children: each child's logits equal the chain root -> child recomputed in full."""
    hf, model, _ = tiny
    prefix, (root, left, right) = [5, 17, 42, 8, 61], [3, 30, 77]
    cache = new_cache(model, 8)
    run(model, cache, [prefix], [0])
    bits = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # row i: tokens node i sees
    p = len(prefix)
    (logits,), _ = run(model, cache, [[root, left, right]], [p], tree_mask=pack_bits(bits)[None],
                       positions=torch.tensor([p, p + 1, p + 1]))
    assert rel_err(logits[1], hf_forward(hf, prefix + [root, left]).logits[0, -1]) < 1e-4
    assert rel_err(logits[2], hf_forward(hf, prefix + [root, right]).logits[0, -1]) < 1e-4


class ThreadGroup(Collectives):
    """One rank of an in-process tensor-parallel group of threads; collectives meet at a barrier."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier):
        self.rank, self.size, self._slots, self._barrier = rank, len(slots), slots, barrier

    @classmethod
    def make(cls, size: int) -> list["ThreadGroup"]:
        slots, barrier = [None] * size, threading.Barrier(size, timeout=60)
        return [cls(r, slots, barrier) for r in range(size)]

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank] = t
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(t)).sum(0)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=dim)


PROMPT, CHAIN = [9, 4, 71, 33, 2, 50, 18], [60, 1, 94]


def prefill_then_verify(model) -> torch.Tensor:
    """Logits ``[10, V]`` of PROMPT (a prefill pass) and CHAIN (one verify pass after it)."""
    cache = new_cache(model, 10)
    (pre,), _ = run(model, cache, [PROMPT], [0])
    (ver,), _ = run(model, cache, [CHAIN], [len(PROMPT)], tree_mask=causal_tree_mask([3], torch.device("cpu")))
    return torch.cat([pre, ver])


def sharded_logits(path, tp: int) -> list[torch.Tensor]:
    """``prefill_then_verify`` on every shard of ``path`` loaded into a ``tp``-wide thread group."""
    def shard(group):
        model = load_target(str(path), group=group).model
        assert model.kv_row_shape[1] == model.cfg.num_key_value_heads // tp
        return prefill_then_verify(model)

    with ThreadPoolExecutor(tp) as pool:
        return list(pool.map(shard, ThreadGroup.make(tp)))


def test_tensor_parallel_matches_transformers(tiny):
    hf, _, path = tiny
    ref = hf_forward(hf, PROMPT + CHAIN).logits[0]
    for got in sharded_logits(path, 2):
        assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "missing 'low_freq_factor'"),
])
def test_config_errors(change, message):
    raw = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2} | change
    with pytest.raises(ValueError, match=message):
        load_model_config(raw)


def test_tp_must_divide_kv_heads():
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by the tensor-parallel width 4"):
        LlamaModel(cfg, group=SingleGroup(rank=0, size=4))


# ---------------------------------------------------------------- GGUF written from a tiny checkpoint

def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's Q/K row order: the two halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


VOCAB = [chr(33 + i) for i in range(94)] + ["ab", "abc"]  # printable ASCII and two merges: 96 tokens


def write_gguf(path, hf) -> None:
    """``hf`` as a llama.cpp GGUF: embedding Q8_0, gate_proj Q4_1, v_proj F16, the rest F32, Q/K rows permuted.
    The quantized weights are written back into ``hf`` dequantized, so both models hold the same values."""
    import gguf
    from gguf.quants import dequantize, quantize

    from kdray.model.gguf import GLOBAL_NAMES, LAYER_NAMES

    c, Q = hf.config, gguf.GGMLQuantizationType
    qtypes = {"embed_tokens": Q.Q8_0, "gate_proj": Q.Q4_1, "v_proj": Q.F16}
    names = {f"{v}.weight": f"{k}.weight" for k, v in GLOBAL_NAMES.items()}
    names |= {f"model.layers.{i}.{v}.weight": f"blk.{i}.{k}.weight"
              for i in range(c.num_hidden_layers) for k, v in LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("head_count", c.num_attention_heads), ("head_count_kv", c.num_key_value_heads),
                       ("layer_norm_rms_eps", c.rms_norm_eps), ("rope_freq_base", c.rope_parameters["rope_theta"]),
                       ("rope_dimension_count", c.head_dim), ("vocab_size", c.vocab_size),
                       ("tokenizer_model", "gpt2"), ("tokenizer_pre", "gpt2"), ("eos_token_id", 2),
                       ("token_list", VOCAB), ("token_merges", ["a b", "ab c"])]:
        getattr(w, f"add_{add}")(value)
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            qtype = next((q for part, q in qtypes.items() if f".{part}." in name), Q.F32)
            data = quantize(t.numpy(), qtype)
            t.copy_(torch.from_numpy(dequantize(data, qtype)))
            if "q_proj" in name or "k_proj" in name:
                data = llama_cpp_permute(t, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
                data = data.numpy()
            w.add_tensor(names[name], data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_matches_transformers_tp1_and_tp2(tmp_path, tied):
    hf = make_tiny(tmp_path, tied, llama3=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    ref = hf_forward(hf, PROMPT + CHAIN).logits[0]
    target = load_target(str(path))
    assert target.config.tie_word_embeddings == tied and target.tokenizer.eos_token_ids == (2,)
    assert target.tokenizer.encode("abc!ab") == [95, 0, 94]
    assert rel_err(prefill_then_verify(target.model), ref) < 1e-4
    for got in sharded_logits(path, 2):
        assert rel_err(got, ref) < 1e-4


def test_gguf_file_reads_what_the_gguf_package_reads(tmp_path):
    """kdray's own GGUF reader against gguf's GGUFReader: every metadata value (type included) and every tensor's
    type, shape and bytes (Q8_0, Q4_1, F16 and F32 ones)."""
    from gguf import GGUFReader

    from kdray.model.gguf import GGUFFile

    write_gguf(tmp_path / "tiny.gguf", make_tiny(tmp_path, tied=False, llama3=True))
    ours, theirs = GGUFFile(tmp_path / "tiny.gguf"), GGUFReader(tmp_path / "tiny.gguf")
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert {k: type(v) for k, v in ours.fields.items()} == {k: type(v) for k, v in expected.items()}
    assert len({t.tensor_type for t in ours.tensors}) == 4
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(a.data.reshape(-1), np.asarray(b.data).view(np.uint8).reshape(-1)), a.name


def test_gguf_errors(tmp_path):
    from kdray.model.gguf import GGUFFile, GGUFTensors, gguf_config

    write_gguf(tmp_path / "tiny.gguf", make_tiny(tmp_path, tied=True, llama3=False))
    reader = GGUFFile(tmp_path / "tiny.gguf")
    tensors = GGUFTensors(reader, gguf_config(reader, "tiny.gguf"), "tiny.gguf")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' \(blk.0.attn_k.weight\) has "
                                         r"shape \[32, 64\], expected \[64, 64\]"):
        tensors.get("model.layers.0.self_attn.k_proj.weight", (64, 64))
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' is missing"):
        tensors.get("lm_head.weight", (96, 64))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="bad.gguf: cannot be read as GGUF \\(no GGUF magic"):
        load_target(str(tmp_path / "bad.gguf"))
    whole = (tmp_path / "tiny.gguf").read_bytes()
    for size, why in ((1000, "truncated or corrupt header"), (len(whole) - 100, "past the file's")):
        (tmp_path / "cut.gguf").write_bytes(whole[:size])
        with pytest.raises(ValueError, match=f"cut.gguf: cannot be read as GGUF \\(.*{why}"):
            load_target(str(tmp_path / "cut.gguf"))


# ---------------------------------------------------------------- (b) SmolLM2-135M-Instruct from its GGUF

@pytest.fixture(scope="module")
def smollm(smollm2):
    """kdray's SmolLM2 and transformers' own GGUF load of the same file (fp32 both). transformers parses the file
    with ``gguf.GGUFReader`` three times (config, weights, tokenizer; ~3.5 s each on two cores) and rebuilds gguf's
    tensor-name map per module: both are read-only, so each is made once here."""
    import gguf

    from kdray.model.gguf import smollm2_path

    path = smollm2_path()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("GGUFReader", "get_tensor_name_map"):  # transformers imports both from gguf on each call
            mp.setattr(gguf, name, functools.cache(getattr(gguf, name)))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return smollm2, hf.eval(), hf_tok


def kdray_greedy(model, ids: list[int], n: int) -> list[int]:
    """Prefill, then one-token verify passes (a 1-bit tree mask) choosing the argmax each time."""
    cache = new_cache(model, len(ids) + n, page_size=16)
    (logits,), _ = run(model, cache, [ids], [0])
    out, one = [int(logits[-1].argmax())], causal_tree_mask([1], torch.device("cpu"))
    while len(out) < n:
        (logits,), _ = run(model, cache, [[out[-1]]], [len(ids) + len(out) - 1], tree_mask=one)
        out.append(int(logits[-1].argmax()))
    return out


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens from transformers (``eos_token_id=None``: no early stop)."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.mark.slow
def test_smollm2_config(smollm):
    target, hf, _ = smollm
    cfg = target.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (576, 30, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.rms_norm_eps == hf.config.rms_norm_eps
    assert target.model.kv_row_shape == (2, 3, 64)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm):
    target, hf, _ = smollm
    tok = target.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(CHAT)), tok.encode("The quick brown fox jumps over the lazy dog")]
    cache = new_cache(target.model, max(map(len, prompts)), seqs=2, page_size=16)
    logits, _ = run(target.model, cache, prompts, [0, 0])
    for ids, got in zip(prompts, logits):
        assert rel_err(got, hf_forward(hf, ids).logits[0]) < 1e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm):
    target, hf, _ = smollm
    ids = target.tokenizer.encode(target.tokenizer.apply_chat_template(CHAT))
    got = kdray_greedy(target.model, ids, 64)
    assert got == hf_greedy(hf, ids, 64)
    assert "Paris" in target.tokenizer.decode(got)


TEXTS = ["Hello, world!", "  leading spaces,\ttabs and\n\nnewlines  ", "digits 12345 and 3.14159, x²",
         "café — naïve 日本語 🙂", "<|im_start|>user\nhi there<|im_end|>\n", "def f(x):\n    return x**2  # square"]


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm):
    target, _, hf_tok = smollm
    tok = target.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.encode("2024") == [tok.backend.token_to_id(d) for d in "2024"]  # digits one by one, as llama.cpp
    assert (tok.bos_token_id, tok.eos_token_ids) == (hf_tok.bos_token_id, (hf_tok.eos_token_id,))
    assert tok.apply_chat_template(CHAT) == hf_tok.apply_chat_template(CHAT, tokenize=False,
                                                                       add_generation_prompt=True)
