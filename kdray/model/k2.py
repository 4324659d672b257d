"""Kimi K2 / DeepSeek-V3 target: MLA attention over a paged latent cache and sigmoid-routed MoE.

Prefill runs MLA in its plain form (keys and values expanded per head by kv_b, ``mla_prefill_attention``: our
tensor-core kernel on Hopper, which reads the per-head and the shared rope key parts where they lie; elsewhere cuDNN
or one variable-length FlashAttention call over the batch's prompts), and so do long prompt chunks after cached
tokens (``PLAIN_CHUNK_TOKENS``), over the cached positions too; verify steps and shorter chunks run the absorbed
form over the latent cache (576 values per token and layer for K2), through the tree-verify kernel.
Routed experts are stacked per layer, dense or INT4 (compressed-tensors pack-quantized, kept packed).
On a GPU the fused ops of ``kdray.kernels`` run the glue: one kernel writes the normalised latent and the
roped key into the cache, ropes the queries and (at few tokens) absorbs them into the latent space, W_UV's product
runs per head on ``skinny_bmm`` at a token or two (merging the attention's key-split partials as it loads them), the
absorbed projections are otherwise batched GEMMs over ``[heads, T, *]`` views (no copies), routing is one kernel
after a bf16 router GEMM with fp32 output (for INT4 experts at few tokens, part of the MoE's first kernel), and at
prefill sizes the norm before the MoE also writes its input in the order of k the INT4 expert GEMMs read
(``MoE.input_k_order``), which spares the MoE a pass over x.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdray.config import K2Config
from kdray.kernels.mla_rope_cache import mla_rope_cache
from kdray.kernels.moe_route import moe_route
from kdray.kernels.prefill_attention import mla_prefill_attention
from kdray.kernels.silu_mul import silu_mul
from kdray.kernels.skinny_linear import bmm_merges_partials, skinny_bmm, skinny_linear
from kdray.kernels.tree_verify_attention import mla_tree_attention
from kdray.kernels.w4a16_moe import is_tiled, reads_expert_k_order, repack_int4_experts, routed_w4a16_moe
from kdray.model.batch import ForwardBatch
from kdray.model.checkpoint import CheckpointReader
from kdray.model.layers import DecoderLayer, DecoderLM, GatedMLP, Linear, RMSNorm, Rotary
from kdray.model.parallel import SINGLE, shard_range

# HF builds q_a_layernorm / kv_a_layernorm with its default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Prompt chunks after cached tokens of at least this many new tokens each run attention in the plain form over the
# cached and new positions (their latent rows expanded by kv_b), fewer in the absorbed form. H200, K2 TP8 shard, the
# 61-layer pass from a CUDA graph, plain (mla_prefill_mma) against absorbed: 16,384 cached + 1024 new 67.1 against
# 86.4 ms (59.5 with the keys in runs); + 512 new 56.3 against 54.9 (42.9-43.3 in runs); 2048 cached + 512 new 36.3
# against 37.8 (35.0-35.1 in runs); + 256 new 34.4 against 34.1. Shorter chunks stay absorbed even so: the engine runs
# these passes eagerly (a lone chunk of up to 2048 tokens replays from a graph, absorbed, below PLAIN_CHUNK_PAIRS),
# where the shard's launches bound them (85-145 ms a pass either way), and the plain form's expansion grows with every
# cached key.
PLAIN_CHUNK_TOKENS = 1024
# A lone chunk of PLAIN_CHUNK_TOKENS or more whose new x cached tokens (its query-key pairs over the cache) reach this
# runs in an eager pass of its own (the engine's layout, ``plain_chunks``), not from a prompt graph or inside a verify
# pass: both hold the absorbed form, whose attention over the cache costs ~2.5x the plain form's a pair. H200, K2 TP8
# shard, 1024 new tokens: 65,536 cached 202.0 ms graphed absorbed against 107 eager plain (105.2 graphed: GPU-bound);
# 32,768 cached 125.6 against 138.3 eager plain (75.1 graphed: the host's launches bound the eager pass at ~85-150 ms).
# From the two, absorbed gains ~2.4 ms and eager plain's GPU time ~0.9 ms per 1024 cached tokens: past ~43k cached eager
# plain wins even at the slowest host measured. 2048 new after 16,384 cached: 157.5 absorbed, 92.1 plain graphed.
PLAIN_CHUNK_PAIRS = 1024 * 49152


class MLAttention(nn.Module):
    """Multi-head latent attention; heads split across the tensor-parallel group."""

    def __init__(self, cfg: K2Config, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        self.cfg, self.group = cfg, group
        H, D = cfg.num_attention_heads, cfg.qk_head_dim
        start, end = shard_range(H, group, "num_attention_heads")
        self.heads = end - start
        # The projections of x that every rank computes whole, as one weight [q_lora + kv_lora + rope, hidden]:
        # q_a_proj's rows (with a q_lora_rank), then kv_a_proj_with_mqa's (one stream of the weights, one launch).
        self.a_parts = ([cfg.q_lora_rank] if cfg.q_lora_rank is not None else []) + [cfg.kv_cache_dim]
        self.a_proj = Linear(cfg.hidden_size, sum(self.a_parts), dtype)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, H * D, dtype, tp_dim=0, group=group)
        else:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * D, dtype, tp_dim=0, group=group)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype, tp_dim=0,
                                group=group)
        self.o_proj = Linear(H * cfg.v_head_dim, cfg.hidden_size, dtype, tp_dim=1, group=group)

    def _queries_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]`` -> (queries ``[T, Hl, nope + rope]``, ``kv_a [T, kv_lora + rope]``: a view of the
        joint projection's rows)."""
        *q_a, kv_a = self.a_proj(x).split(self.a_parts, dim=-1)
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_a[0]))
        return q.view(x.shape[0], self.heads, self.cfg.qk_head_dim), kv_a

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [Hl, nope, kv_lora]`` and ``W_UV [Hl, v, kv_lora]``: views of ``kv_b_proj``'s weight."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, cache: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, hidden]``, cache ``[P, S, kv_lora + rope]`` (this layer) -> ``[T, hidden]`` (+ ``residual``, added
        by o_proj over its storage).

        ``cos``/``sin`` ``[T, rope/2]`` come from ``rotary`` (DeepSeek's interleaved rope, applied here by
        ``mla_rope_cache``)."""
        c, T = self.cfg, x.shape[0]
        nope, L = c.qk_nope_head_dim, c.kv_lora_rank
        q, kv_a = self._queries_and_latent(x)  # [T, Hl, nope + rope], [T, kv_lora + rope]
        rows = cache.view(-1, c.kv_cache_dim)  # [P * S, kv_lora + rope]
        ctx = batch.context  # prompt chunks after cached tokens
        if batch.is_prefill or (ctx is not None and min(batch.q_lens) >= PLAIN_CHUNK_TOKENS):
            q_pe = q[..., nope:]
            # The keys' rows as cached: the prompts' own, written beside the cache by the launch, or after a cached
            # prefix gathered back from the cache (the prefix's rows, then the chunk's)
            own = torch.empty(T, c.kv_cache_dim, dtype=rows.dtype, device=rows.device) if ctx is None else None
            mla_rope_cache(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin, q_pe, q_pe, rows,
                           batch.slot_mapping, rows_out=own)  # own: [T, kv_lora + rope]
            latent, k_pe = (own if ctx is None else rows[ctx.slots]).split([L, c.qk_rope_head_dim], dim=-1)
            out = self._plain(q, latent, k_pe, batch)
        else:
            q_attn = torch.empty(T, self.heads, c.kv_cache_dim, dtype=q.dtype, device=q.device)  # [T, Hl, L + rope]
            w_uk, w_uv = self._absorbed_weights()
            # The cache rows, the roped queries and the absorbed ones ([Hl, T, nope] x [Hl, nope, kv_lora] into
            # q_attn's latent part) in one launch just ahead of the attention, whose copies of the prefix overlap it
            # (early_prefix: only the tree's rows are written in a pass)
            mla_rope_cache(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin, q[..., nope:],
                           q_attn[..., L:], rows, batch.slot_mapping, q_nope=q[..., :nope], w_uk=w_uk,
                           q_latent=q_attn[..., :L])
            o_latent = mla_tree_attention(q_attn, cache, batch.block_table, batch.prefix_lens, batch.cu_q,
                                          batch.tree_mask, c.softmax_scale, L, early_prefix=True,
                                          longest=max(batch.q_lens), unmerged=bmm_merges_partials(T))
            # o_latent: [T, Hl, kv_lora], or its key splits' partials, which the W_UV product merges as it loads them
            out = torch.empty(T, self.heads, c.v_head_dim, dtype=q.dtype, device=q.device)  # [T, Hl, v]
            skinny_bmm(o_latent, w_uv, out)  # per head: 1-2 tokens on skinny_linear's kernel, else torch.bmm
        return self.o_proj(out.reshape(T, self.heads * c.v_head_dim), add=residual)

    def _plain(self, q, latent, k_pe, batch: ForwardBatch) -> torch.Tensor:
        """Causal attention per prompt with keys and values expanded per head: queries ``[T, Hl, nope + rope]`` (their
        rope part already roped in place), the keys' latent and roped rows ``[Tk, *]`` (the prompts' own, or with a
        ``batch.context`` their cached ones first) -> ``[T, Hl, v]``."""
        c, ctx = self.cfg, batch.context
        kv = self.kv_b_proj(latent).view(-1, self.heads, c.qk_nope_head_dim + c.v_head_dim)  # [Tk, Hl, nope + v]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        keys = () if ctx is None else (ctx.cu, ctx.lens)
        return mla_prefill_attention(q, k_nope, k_pe, v, batch.cu_q, batch.q_lens, c.softmax_scale, *keys)

    def load(self, reader: CheckpointReader, prefix: str):
        lora = self.cfg.q_lora_rank is not None
        self.a_proj.load(reader, [f"{prefix}.{n}.weight" for n in ["q_a_proj"] * lora + ["kv_a_proj_with_mqa"]],
                         self.a_parts)
        names = ["q_a_layernorm", "q_b_proj"] if lora else ["q_proj"]
        for name in names + ["kv_a_layernorm", "kv_b_proj", "o_proj"]:
            getattr(self, name).load(reader, f"{prefix}.{name}.weight")


def dense_experts(x, w13, w2, ids, weights) -> torch.Tensor:
    """Routed experts with unquantised stacked weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; ids -1 are skipped.

    On the CPU only the experts in use run. On a GPU every expert runs on every token and the routing
    weights select (no host sync, so the pass can be captured in a CUDA graph); fine for the small
    unquantised models, while INT4 checkpoints go through the grouped ``w4a16_moe`` kernel.
    """
    if x.is_cuda:
        select = torch.zeros(x.shape[0], w13.shape[0] + 1, dtype=torch.float32, device=x.device)  # [T, E+1]
        select.scatter_add_(1, torch.where(ids < 0, w13.shape[0], ids), weights.float())
        gate, up = torch.einsum("th,eoh->eto", x, w13).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w2)  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), select[:, :-1]).to(x.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
# Up to this many tokens an MoE layer forks its shared experts before the router, past it after: forked first, they
# start during the router and the routing, and leave the SMs sooner to the routed experts' gate/up kernel (at one
# token 16-warp blocks that take a whole SM's registers). H100, graphed 61-layer K2 TP8 shard, alternated: one token
# 5.09 -> 4.87 ms, two 6.63 -> 6.49; three the same (6.71); four +1.6%, six +0.9%, 8 +0.7%, 17 +2.5%, 1024 +2.3%.
SHARED_FIRST_TOKENS = 2


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream (one per GPU) on which an MoE layer runs its shared experts beside its routed ones."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


class MoE(nn.Module):
    """Sigmoid-routed experts plus shared experts. Experts split by width (TP) or by id (EP)."""

    def __init__(self, cfg: K2Config, dtype: torch.dtype, group=SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.cfg, self.ep = cfg, expert_parallel
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if expert_parallel:
            self.e0, e1 = shard_range(E, group, "n_routed_experts")
            self.experts, self.inner, self.i0 = e1 - self.e0, I, 0
        else:
            self.i0, i1 = shard_range(I, group, "moe_intermediate_size")
            self.e0, self.experts, self.inner = 0, E, i1 - self.i0
        self.gate = nn.Parameter(torch.empty(E, H, dtype=dtype), requires_grad=False)  # router [E, H]
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        El, Il = self.experts, self.inner
        q = cfg.quantization
        if q is None:
            self.w13 = nn.Parameter(torch.empty(El, 2 * Il, H, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(El, H, Il, dtype=dtype), requires_grad=False)
        else:
            g = q.group_size
            if Il % g:
                raise ValueError(f"expert width per shard {Il} is not a multiple of the INT4 group size {g}; "
                                 "use a smaller tp or expert parallelism")
            self.register_buffer("w13_packed", torch.empty(El, 2 * Il, H // 8, dtype=torch.int32))
            self.register_buffer("w13_scale", torch.empty(El, 2 * Il, H // g, dtype=torch.bfloat16))
            self.register_buffer("w2_packed", torch.empty(El, H, Il // 8, dtype=torch.int32))
            self.register_buffer("w2_scale", torch.empty(El, H, Il // g, dtype=torch.bfloat16))
        self.shared = (GatedMLP(H, I * cfg.n_shared_experts, dtype, group) if cfg.n_shared_experts else None)

    def input_k_order(self, h: torch.Tensor) -> torch.Tensor | None:
        """An empty ``[T, H]`` for the norm before this layer to write its input into in the INT4 experts' k order
        (``expert_k_order``) when the CUDA experts at h's T tokens read that order; else None."""
        T, H = h.shape
        if not (h.is_cuda and self.cfg.quantization is not None
                and reads_expert_k_order(T, self.cfg.num_experts_per_tok, self.w13_packed, H)):
            return None
        return torch.empty(T, H, dtype=h.dtype, device=h.device)  # [T, H]

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.gate, out_dtype=torch.float32)  # [T, E]: 16-bit operands, fp32 sums

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, x_k: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x ``[T, H]`` -> routed experts plus shared experts ``[T, H]``: this rank's partial sum (its expert width or
        its experts), which the norm after the layer reduces over the group; plus ``residual`` where given (the
        stream, on rank 0), whose storage the shared experts' down GEMM adds into. ``x_k``: x in the experts' k
        order, where :meth:`input_k_order` asked the norm for it."""
        cfg = self.cfg
        logits = None if x.shape[0] <= SHARED_FIRST_TOKENS else self._router_logits(x)  # else after the fork
        add, side = residual, None  # what the routed experts' sum adds: the stream, then the shared experts
        if self.shared is not None:  # this rank's partial sum: reduced together with the routed experts'
            if x.is_cuda and cfg.quantization is not None:  # beside the routing and the routed experts
                # Into the stream or a block allocated on this stream, which reads it once the MoE's finalize has
                # waited for the side stream: a block two streams use (record_stream) is not reused until a CUDA
                # graph's capture ends, so a captured 64k-token pass held each layer's 0.9 GB and ran out of memory.
                add = torch.empty_like(x) if residual is None else residual  # [T, H]
                side = _side_stream(x.device)  # forked before or after the router (SHARED_FIRST_TOKENS)
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):  # (beside: past 32 tokens on cuBLAS, see kernels/skinny_linear.py)
                    gate_up = skinny_linear(x, self.shared.gate_up.weight, beside=True)  # [T, 2 I / tp]
                    skinny_linear(silu_mul(gate_up), self.shared.down.weight, out=add,
                                  accumulate=residual is not None, beside=True)
            else:
                add = self.shared(x, residual)
        if logits is None:
            logits = self._router_logits(x)
        routing = (logits, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                   cfg.norm_topk_prob, cfg.routed_scaling_factor, (self.e0, self.experts) if self.ep else None)
        if self.cfg.quantization is None:
            out = dense_experts(x, self.w13, self.w2, *moe_route(*routing))  # ids, weights [T, k]
            return out if add is None else out + add
        # few tokens: routed inside the MoE's first launch
        out, _, _ = routed_w4a16_moe(x, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale, *routing,
                                     add=add, add_stream=side, x_k=x_k)
        return out

    def load(self, reader: CheckpointReader, prefix: str):
        cfg, H, I = self.cfg, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        E = cfg.n_routed_experts
        self.gate.copy_(reader.get(f"{prefix}.gate.weight", (E, H)))
        self.e_score_correction_bias.copy_(reader.get(f"{prefix}.gate.e_score_correction_bias", (E,)))
        i0, i1 = self.i0, self.i0 + self.inner
        for local in range(self.experts):
            ep = f"{prefix}.experts.{self.e0 + local}"
            if cfg.quantization is None:
                gate = reader.get(f"{ep}.gate_proj.weight", (I, H), (0, i0, i1))
                up = reader.get(f"{ep}.up_proj.weight", (I, H), (0, i0, i1))
                self.w13[local].copy_(torch.cat([gate, up]))
                self.w2[local].copy_(reader.get(f"{ep}.down_proj.weight", (H, I), (1, i0, i1)))
                continue
            g = cfg.quantization.group_size
            for proj, rows in (("gate_proj", slice(0, self.inner)), ("up_proj", slice(self.inner, 2 * self.inner))):
                _check_int4_shape(reader, f"{ep}.{proj}", (I, H))
                self.w13_packed[local, rows] = reader.get(f"{ep}.{proj}.weight_packed", (I, H // 8), (0, i0, i1))
                self.w13_scale[local, rows] = reader.get(f"{ep}.{proj}.weight_scale", (I, H // g), (0, i0, i1))
            _check_int4_shape(reader, f"{ep}.down_proj", (H, I))
            self.w2_packed[local] = reader.get(f"{ep}.down_proj.weight_packed", (H, I // 8), (1, i0 // 8, i1 // 8))
            self.w2_scale[local] = reader.get(f"{ep}.down_proj.weight_scale", (H, I // g), (1, i0 // g, i1 // g))
        if self.shared is not None:
            self.shared.load(reader, f"{prefix}.shared_experts")
        self.lay_out_experts()

    def lay_out_experts(self):
        """Put the loaded experts in their device's layout: INT4 experts on a GPU tiled (:meth:`tile_experts`),
        elsewhere as read. Loading ends with it, from a checkpoint or with random weights."""
        if self.cfg.quantization is not None and self.w13_packed.is_cuda:
            self.tile_experts()

    @torch.no_grad()
    def tile_experts(self) -> bool:
        """Replace the compressed-tensors INT4 experts with repack_int4_experts' tiled layout (the same bytes, no
        second copy): every CUDA MoE kernel reads it, and the Hopper wgmma kernels (prefill, large verifies) need it.
        Done once after loading on a GPU; returns whether it repacked (INT4, group 32, widths multiples of 64)."""
        if (self.cfg.quantization is None or is_tiled(self.w13_packed) or self.cfg.quantization.group_size != 32
                or self.cfg.hidden_size % 64 or self.inner % 64):
            return False
        for name, t in zip(("w13_packed", "w13_scale", "w2_packed", "w2_scale"),
                           repack_int4_experts(self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)):
            setattr(self, name, t)  # a registered buffer: replaced in place in _buffers
        return True


def _check_int4_shape(reader: CheckpointReader, prefix: str, shape: tuple[int, int]):
    found = tuple(reader.get(f"{prefix}.weight_shape", (2,)).tolist())
    if found != shape:
        raise ValueError(f"{reader.path}: tensor '{prefix}.weight_shape' says {list(found)}, expected {list(shape)}")


class K2Model(DecoderLM):
    """The whole target: ``forward`` returns final hidden states and the drafter's context features."""

    def __init__(self, cfg: K2Config, dtype: torch.dtype = torch.float32, group=SINGLE, expert_parallel=False):
        layers = [DecoderLayer(MLAttention(cfg, dtype, group),
                               GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, group)
                               if i < cfg.first_k_dense_replace else MoE(cfg, dtype, group, expert_parallel),
                               cfg.hidden_size, cfg.rms_norm_eps, dtype, group)
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, dtype, group, layers,
                         Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=True))

    @property
    def kv_row_shape(self) -> tuple[int, ...]:
        """Values cached per token and layer (the MLA latent and the roped key)."""
        return (self.cfg.kv_cache_dim,)
