"""Building blocks shared by the targets and the drafter: norms, tensor-parallel linears, RoPE, MLP.

Tensor parallelism is written into the layers: a linear's ``tp_dim`` says which weight dimension is
split across the group (0: column-parallel, outputs split; 1: row-parallel, inputs split, each rank
returning its partial sum) and ``load`` reads only this rank's slice from the checkpoint. A decoder
layer's attention and MLP end in a row-parallel product that adds the residual stream into rank 0's partial sum
(``Linear(x, add=stream)``, in place: a GEMM's beta = 1); the norm after them reduces the partial sums over the
group and normalises the stream in one collective (``RMSNorm(x, group)``), reading one tensor and writing one.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kdray.config import Llama3Scaling, YarnScaling
from kdray.kernels.rmsnorm import rmsnorm
from kdray.kernels.rope import rope_reference
from kdray.kernels.silu_mul import silu_mul
from kdray.kernels.skinny_linear import skinny_linear
from kdray.model.batch import ForwardBatch
from kdray.model.checkpoint import CheckpointReader
from kdray.model.parallel import SINGLE, shard_range, vocab_range


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, normalised in fp32 and cast back before the weight, as HF computes it.

    ``norm(x)`` returns the normalised ``x``; ``norm(x, group)`` takes ``x`` as this rank's partial sum, reduces it
    over the tensor-parallel group first and returns ``(norm(sum), sum)``, in one collective. ``out_k``: a buffer
    the norm also writes in the INT4 experts' k order (``rmsnorm``'s)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, group=None, out_k: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if group is None:
            return rmsnorm(x, self.weight, self.eps, out_k)
        return group.all_reduce_rmsnorm(x, self.weight, self.eps, out_k)

    def load(self, reader: CheckpointReader, name: str):
        self.weight.copy_(reader.get(name, tuple(self.weight.shape)))


class Linear(nn.Module):
    """``y = x W^T``, ``W [out, in]``; ``tp_dim`` None (replicated), 0 (column-parallel) or 1 (row-parallel:
    ``y`` is this rank's partial sum, which the caller reduces over the group)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp_dim: int | None = None,
                 group=SINGLE):
        super().__init__()
        self.full_shape = (out_features, in_features)
        self.tp_dim, self.group = tp_dim, group
        shape = list(self.full_shape)
        if tp_dim is not None:
            start, end = shard_range(shape[tp_dim], group, ("out_features", "in_features")[tp_dim])
            shape[tp_dim] = end - start
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)  # [out(/tp), in(/tp)]

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` (F.linear, or the weight-streaming kernel at a few tokens); with ``add`` ``[..., out]``,
        ``add + x W^T`` written over ``add`` (the fp32 sums rounded once; the caller gives up add's values), out of
        place where autograd must see the add."""
        if add is None:
            return skinny_linear(x, self.weight)
        if torch.is_grad_enabled() and (add.requires_grad or x.requires_grad or self.weight.requires_grad):
            return add + skinny_linear(x, self.weight)
        return skinny_linear(x, self.weight, out=add, accumulate=True)

    def load(self, reader: CheckpointReader, names: str | list[str], rows: list[int] | None = None):
        """Load one checkpoint tensor, or several stacked along the output dim (e.g. gate and up; ``rows`` each,
        equal parts by default), each split across the group on its own."""
        names = [names] if isinstance(names, str) else names
        rows = rows or [self.full_shape[0] // len(names)] * len(names)
        parts = []
        for name, part_out in zip(names, rows, strict=True):
            full = (part_out, self.full_shape[1])
            shard = None
            if self.tp_dim is not None:
                start, end = shard_range(full[self.tp_dim], self.group, name)
                shard = (self.tp_dim, start, end)
            parts.append(reader.get(name, full, shard))
        self.weight.copy_(torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])


def load_vocab_rows(weight: torch.Tensor, reader: CheckpointReader, name: str, vocab: int, start: int):
    """Fill ``weight`` (this rank's rows of a padded vocabulary, from ``start``) from the checkpoint tensor
    ``name`` of ``vocab`` rows; the padding rows are zeros."""
    stop = min(start + weight.shape[0], vocab)
    weight.zero_()
    if stop > start:
        weight[:stop - start].copy_(reader.get(name, (vocab, weight.shape[1]), (0, start, stop)))


class VocabEmbedding(nn.Module):
    """Token embedding split by vocabulary rows across the group (the vocabulary padded to a multiple of its
    width); lookups all-reduce the partial rows."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        self.vocab, self.group = vocab, group
        self.start, self.end = vocab_range(vocab, group)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start).clamp(0, self.end - self.start - 1), self.weight)
        return self.group.all_reduce(out * local.unsqueeze(-1).to(out.dtype))

    def load(self, reader: CheckpointReader, name: str):
        load_vocab_rows(self.weight, reader, name, self.vocab, self.start)


class LMHead(nn.Module):
    """Vocabulary-parallel output projection: each rank computes its slice of the padded vocabulary, gathered
    to full logits (the padding cut off)."""

    def __init__(self, dim: int, vocab: int, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        self.vocab = vocab
        self.start, end = vocab_range(vocab, group)
        self.proj = Linear(dim, (end - self.start) * group.size, dtype, tp_dim=0, group=group)  # padded vocab

    @property
    def weight(self) -> nn.Parameter:
        return self.proj.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, dim]`` -> ``[T, vocab]`` fp32 logits. On a GPU, 16-bit operands accumulate into an fp32 output
        (never rounded to 16 bits), so near-equal logits keep their order instead of tying."""
        w = self.proj.weight
        if h.is_cuda and h.dtype != torch.float32:
            logits = torch.mm(h.reshape(-1, h.shape[-1]), w.t(), out_dtype=torch.float32).view(*h.shape[:-1], -1)
        else:
            logits = F.linear(h, w).float()
        logits = self.proj.group.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab else logits[..., :self.vocab].contiguous()

    def load(self, reader: CheckpointReader, name: str):
        load_vocab_rows(self.proj.weight, reader, name, self.vocab, self.start)


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate x) * up x)``: gate/up column-parallel (stacked), down row-parallel (the output is
    this rank's partial sum, plus ``residual`` where given, added in the down GEMM over residual's storage)."""

    def __init__(self, dim: int, inner: int, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        self.gate_up = Linear(dim, 2 * inner, dtype, tp_dim=0, group=group)  # [2*inner/tp, dim]
        self.down = Linear(inner, dim, dtype, tp_dim=1, group=group)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(x)), add=residual)

    def load(self, reader: CheckpointReader, prefix: str):
        self.gate_up.load(reader, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        self.down.load(reader, f"{prefix}.down_proj.weight")


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Llama 3.1 scaling of ``[dim/2]`` inverse frequencies: wavelengths beyond the original context /
    ``low_freq_factor`` divided by ``factor``, those under context / ``high_freq_factor`` kept, a ramp between."""
    ctx = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    ramped = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > ctx / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= ctx / s.high_freq_factor) & (wavelen <= ctx / s.low_freq_factor)
    return torch.where(medium, ramped, scaled)


def rope_inv_freq(dim: int, theta: float, scaling: YarnScaling | Llama3Scaling | None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` and the cos/sin multiplier (YaRN's attention factor, else 1)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    if isinstance(scaling, Llama3Scaling):
        return llama3_inv_freq(1.0 / pos_freqs, scaling), 1.0
    yarn = scaling

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if yarn.mscale and yarn.mscale_all_dim:
        attn_factor = mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attn_factor = mscale(yarn.factor)
    return inv, attn_factor


class Rotary(nn.Module):
    """RoPE. ``interleaved`` rotates adjacent pairs (DeepSeek) and returns them de-interleaved (as HF does,
    which is harmless: queries and keys share the layout); otherwise the two halves are rotated (NeoX / Llama)."""

    def __init__(self, dim: int, theta: float, scaling: YarnScaling | Llama3Scaling | None = None,
                 interleaved: bool = False):
        super().__init__()
        inv, self.attn_factor = rope_inv_freq(dim, theta, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)  # [dim/2]
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` positions -> cos, sin ``[T, dim/2]`` (angle per pair, times the attention factor)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.attn_factor).to(dtype), (freqs.sin() * self.attn_factor).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, dim]`` -> rotated ``[T, heads, dim]`` (the fused kernels' references)."""
        return rope_reference(x, cos, sin, self.interleaved)


class DecoderLayer(nn.Module):
    """Pre-norm residual block ``h += attn(norm(h)); h += mlp(norm(h))`` under the HF parameter names."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, dim: int, eps: float, dtype: torch.dtype,
                 group=SINGLE):
        super().__init__()
        self.group = group
        self.input_layernorm = RMSNorm(dim, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(dim, eps, dtype)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, reduced: bool, rotary, cos, sin, batch: ForwardBatch, cache: torch.Tensor
                ) -> torch.Tensor:
        """The residual stream ``h [T, dim]`` (``reduced``), or this rank's partial sum of it (a layer's output) ->
        this rank's partial sum of the stream after this layer. The stream rides in rank 0's partial sum: the
        attention's and the MLP's last GEMMs add their input stream into their output there (in place), so each
        norm reduces and normalises one tensor and no pass is spent on the residual add."""
        g = self.group
        x, h = (self.input_layernorm(h), h) if reduced else self.input_layernorm(h, g)
        h = self.self_attn(x, rotary, cos, sin, batch, cache, residual=self._carried(h))
        x_k = self._mlp_input_k_order(h)
        x, h = self.post_attention_layernorm(h, g, out_k=x_k)
        if x_k is None:
            return self.mlp(x, residual=self._carried(h))
        return self.mlp(x, residual=self._carried(h), x_k=x_k)

    def _mlp_input_k_order(self, h: torch.Tensor) -> torch.Tensor | None:
        """A buffer for the MLP's input again in the order its INT4 expert kernels read (an MoE asks for one when
        they do at h's rows), which the norm fills beside the input: the MoE then makes no pass of its own over
        x to permute it. Else None."""
        ask = getattr(self.mlp, "input_k_order", None)
        return None if ask is None else ask(h)

    def _carried(self, h: torch.Tensor) -> torch.Tensor | None:
        """The stream where this rank's partial sum carries it (rank 0), else None."""
        return h if self.group.rank == 0 else None

    def load(self, reader: CheckpointReader, prefix: str):
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(self, name).load(reader, f"{prefix}.{name}.weight")
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.mlp")


def residual_stream(h: torch.Tensor, reduced: bool, group=SINGLE) -> torch.Tensor:
    """The stream ``h`` stands for: itself (``reduced``), or a layer's partial sums reduced over ``group``."""
    return h if reduced else group.all_reduce(h)


def final_norm(norm: RMSNorm, h: torch.Tensor, reduced: bool, group=SINGLE) -> torch.Tensor:
    """``norm`` of the stream ``h`` stands for (:func:`residual_stream`), the reduction fused into it."""
    return norm(h) if reduced else norm(h, group)[0]


class TargetHead(nn.Module):
    """A target's token embedding and LM head (vocabulary-parallel): all that the drafter borrows from the
    target, and the base of every target model. A tied head shares the embedding's weight."""

    def __init__(self, cfg, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, group)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, dtype, group)
        if cfg.tie_word_embeddings:
            self.lm_head.proj.weight = self.embed_tokens.weight  # both [vocab/tp, hidden], same rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, vocab]`` fp32."""
        return self.lm_head(hidden)

    def load(self, reader: CheckpointReader):
        """Load HF-named ``model.embed_tokens.weight`` and (untied) ``lm_head.weight``."""
        self.embed_tokens.load(reader, "model.embed_tokens.weight")
        if not self.cfg.tie_word_embeddings:
            self.lm_head.load(reader, "lm_head.weight")


class DecoderLM(TargetHead):
    """The decoder loop every target shares: the head, ``layers`` (each called as
    ``layer(h, reduced, rotary, cos, sin, batch, layer_cache)``), a final norm and the rotary embedding."""

    def __init__(self, cfg, dtype: torch.dtype, group, layers: list[nn.Module], rotary: Rotary):
        super().__init__(cfg, dtype, group)
        self.group = group
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = rotary

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, target_layer_ids: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv_cache ``[layers, P, S, *kv_row_shape]`` -> (hidden ``[T, H]`` after the final norm, the drafter's
        context features: outputs of the decoder layers ``target_layer_ids`` concatenated in layer order
        ``[T, len(ids) * H]``, or None)."""
        h, reduced = self.embed_tokens(batch.input_ids), True
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        picked = sorted({i for i in target_layer_ids if 0 <= i < len(self.layers)})
        H = h.shape[-1]
        features = h.new_empty(h.shape[0], len(picked) * H) if picked else None  # [T, len(ids) * H]
        for i, layer in enumerate(self.layers):
            h, reduced = layer(h, reduced, self.rotary, cos, sin, batch, kv_cache[i]), False
            if i in picked:  # the stream itself, copied out: the next layer adds into h in place
                h, reduced = residual_stream(h, reduced, self.group), True
                j = picked.index(i)
                features[:, j * H:(j + 1) * H] = h
        return final_norm(self.norm, h, reduced, self.group), features

    def load(self, reader: CheckpointReader):
        """Load HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ...)."""
        super().load(reader)
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}")
        self.norm.load(reader, "model.norm.weight")
