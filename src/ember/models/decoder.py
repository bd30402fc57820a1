"""The one decoder-only transformer every supported family runs on.

Tensors in, tensors out: `forward(tokens, positions, cache) -> hidden`, then `compute_logits(hidden)`.
Families differ only through ModelConfig fields (norm placement and offset, q/k norm, biases, soft-capping,
sliding windows, multipliers, MoE) — see `ember.models.families` for each delta and its reason.

Parameter names are Hugging Face's, except that q/k/v and gate/up are stored fused (`qkv_proj`,
`gate_up_proj`) so a decode step runs two matmuls fewer per layer; the loader packs them (see `Family.packed`).

Shape legend: B batch, T tokens, S cache slots, H query heads, K kv heads, D head dim, E hidden, V vocab.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.errors import UnsupportedArchitectureError
from ember.ops import cuda_attention
from ember.ops.linear import Linear, project, silu_gate_up
from ember.ops.norm import RMSNorm
from ember.ops.rope import Rope
from ember.quant import cuda_int4
from ember.quant.kernels import NormedRow, SplitSum


class KVCache(Protocol):
    """What the model needs from a cache backend (static or paged): store this step's k/v, attend over all."""

    def begin(self, positions: torch.Tensor) -> None:
        """Called once per forward with the positions (B, T) of this step's tokens."""
        ...

    def sequence_lengths(self) -> torch.Tensor | None:
        """(B, T): the length of each token's sequence (prompt and tokens so far) where a forward packs several
        sequences in a row; None where each row is one sequence (its length: its last position + 1)."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor],
        window: int | None,
        scale: float,
        softcap: float | None,
        ahead: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D).

        q and k arrive before rope; `rope` is (cos, sin) (B, T, R) for their positions, applied by the cache
        so that a backend can fuse it with the cache write and attention. ahead: the weights the output
        projection reads next, which a backend may ask the GPU's L2 cache for while attention runs.
        """
        ...


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "swish": F.silu,  # transformers' other name for silu
}


# Pre-norm int8 layers fold their norms and residual adds into the CUDA C++ int8 GEMVs (`DecoderLayer.folds`):
# with the rope tables op, an int8 Llama-3-8B step took 2.08% less on an H100 (GPU tests of both variants
# passed there; BENCHMARKS.md, thirty-first session). False for A/B runs.
FOLD_NORMS = True


def on_gpu(x: torch.Tensor) -> bool:
    """Whether a pre-norm layer asks if its rows x may run its folded, carried or rounded forms (`DecoderLayer.
    folds`, `carries_norm`, `rounds`), all of them CUDA GEMVs': on a CPU their checks are ~0.8 ms of a 6.7 ms
    SmolLM2 int4 eager step, answered no. (The CPU tests of their plumbing say yes here.)"""
    return x.is_cuda


def streamed_weight(linear: nn.Module) -> torch.Tensor | None:
    """The largest tensor a projection reads for one row: a quantized one's codes, else its weight."""
    if hasattr(linear, "streamed_weight"):
        return linear.streamed_weight()
    return linear.weight if isinstance(linear, nn.Linear) else None


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"activation {name!r} is not supported; expected one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(
        self,
        x: torch.Tensor,
        split: bool = False,
        norm: RMSNorm | None = None,
        rounded: torch.Tensor | None = None,
        normed: NormedRow | None = None,
        next_norm: RMSNorm | None = None,
    ) -> torch.Tensor | SplitSum | tuple[torch.Tensor, NormedRow]:
        """split: the down projection may return its partial sums (`project`) for the next norm to add. norm: x
        is the residual stream, and the result is x + MLP(norm(x)), the norm and the add folded into the GEMVs
        (SwiGLU, projections that `fold`: `DecoderLayer.folds`). rounded: x rounded to int8 by the norm before,
        for a gate/up projection that reads it so (SwiGLU: `DecoderLayer.rounds`). normed: the row x normed as
        the projection before carried it (`NormedRow`; SwiGLU: `DecoderLayer.carries_norm`); with next_norm, x
        is the residual stream and the result (h, next_norm(h) as a `NormedRow`), h = x + MLP."""
        if normed is not None:
            act = self.gate_up_proj.normed_forward(normed, x.shape, glu=True)
            if next_norm is not None:
                return self.down_proj.linear_add_norm(act, x, next_norm)
            return project(self.down_proj, act, split)
        if rounded is not None:
            return project(
                self.down_proj, self.gate_up_proj.rounded_forward(rounded, x.shape, glu=True), split
            )
        if norm is not None:
            return self.down_proj.linear_add(self.gate_up_proj.norm_linear(x, norm, glu=True), x)
        if self.act is F.silu:  # SwiGLU: one kernel for the projection and the activation where it can
            return project(self.down_proj, silu_gate_up(self.gate_up_proj, x), split)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return project(self.down_proj, self.act(gate) * up, split)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs here: bf16 on CUDA (sm80+), any dtype eagerly on CPU (its fallback),
    only bf16 when traced by torch.compile or export (its fake kernel takes nothing else); 16-byte aligned rows."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu" or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return False
    return all(
        w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights
    )


def expert_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    grouped: bool,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (P, in) rows sorted by expert, w (X, out, in), offsets (X,) int32 group ends -> (P, out).

    Row p is multiplied by the weight of the expert whose group holds it: one grouped GEMM where torch has it;
    else, given `experts` (P,) (each row's expert: for a traced step, which may not sync with the host), each
    row against its expert's weight as one reduction that inductor fuses with the gather, so no copy of the
    weights is made; else one matmul per expert over its rows (a loop over experts, never over tokens; it
    reads the group sizes on the host, which an eager step can afford).
    """
    if grouped:
        return F.grouped_mm(x, w.transpose(1, 2), offs=offsets)
    if experts is not None:
        return (x[:, None, :] * w[experts]).sum(-1)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e].T
        start = end
    return out


class MoE(nn.Module):
    """Top-k routed experts: the (token, expert) pairs are sorted by expert and each expert's projection runs
    once over its group of rows, as a grouped matmul.

    Expert weights are stacked: `experts.gate_up_proj` (X, 2I, E) and `experts.down_proj` (X, E, I) for X
    experts. Work and memory follow the N * k routed pairs (no per-token copies of expert weights), and with
    torch's grouped GEMM the step has no host sync, so decode stays cheap and compilable.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        X, E, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size  # noqa: E741
        self.num_experts = X
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(E, X, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(X, 2 * I, E))
        self.experts.down_proj = nn.Parameter(torch.empty(X, E, I))
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, split: bool = False) -> torch.Tensor:
        """split: ignored (the routed pairs' outputs are added here)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, E)
        k = self.top_k
        router = torch.softmax(self.gate(x).float(), dim=-1)  # (N, X)
        weights, chosen = router.topk(k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)  # (N*k,) expert of each routed pair
        order = flat.argsort(stable=True)  # pairs grouped by expert
        token = order // k  # (N*k,) token of each sorted pair
        offsets = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)  # (X,)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        grouped = grouped_mm_supported(x, gate_up, down)
        # traced without the grouped GEMM: each sorted pair's expert, in place of the loop's host sync
        experts = flat[order] if not grouped and torch.compiler.is_compiling() else None
        h = expert_matmul(x[token], gate_up, offsets, grouped, experts)  # (N*k, 2I)
        gate, up = h.chunk(2, dim=-1)
        h = expert_matmul(self.act(gate) * up, down, offsets, grouped, experts)  # (N*k, E)
        h = h * weights.reshape(-1)[order, None].to(h.dtype)
        out = torch.zeros_like(x).index_add_(0, token, h)  # (N, E): sum over each token's k experts
        return out.reshape(shape)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.H, self.K, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.H + 2 * self.K) * self.D, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.H * self.D, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.D, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.D, cfg.norm_eps, cfg.norm_offset)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.H * self.D, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.K * self.D, cfg.norm_eps, cfg.norm_offset)
        self.window = cfg.window(layer)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.D**-0.5
        self.softcap = cfg.attn_logit_softcap

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        split: bool = False,
        norm: RMSNorm | None = None,
        rounded: torch.Tensor | None = None,
        normed: NormedRow | None = None,
        resid: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> torch.Tensor | SplitSum | tuple[torch.Tensor, NormedRow]:
        """split: the output projection may return its partial sums (`project`) for the next norm to add. norm:
        x is the residual stream, and the result is x + attention(norm(x)), the norm and the add folded into
        the qkv and output GEMVs (projections that `fold`: `DecoderLayer.folds`). rounded: x rounded to int8 by
        the norm before, for a qkv projection that reads it so (`DecoderLayer.rounds`). normed: the row normed
        as the projection before carried it (x then only gives the shape). resid, next_norm: the result is (h,
        next_norm(h) as a `NormedRow`), h = resid + attention, from the output projection's GEMV
        (`DecoderLayer.carries_norm`)."""
        B, T, _ = x.shape
        H, K, D = self.H, self.K, self.D
        if normed is not None:
            qkv = self.qkv_proj.normed_forward(normed, x.shape)
        elif rounded is not None:
            qkv = self.qkv_proj.rounded_forward(rounded, x.shape)
        else:
            qkv = self.qkv_proj(x) if norm is None else self.qkv_proj.norm_linear(x, norm)
        q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, H, D)  # (B, T, H, D)
        k = k.view(B, T, K, D)  # (B, T, K, D)
        v = v.view(B, T, K, D)  # (B, T, K, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        out = cache.attend(
            self.layer, q, k, v, rope=(cos, sin), window=self.window, scale=self.scale, softcap=self.softcap,
            ahead=streamed_weight(self.o_proj) if cuda_attention.AHEAD_BYTES and T == 1 and x.is_cuda else None,
        )  # fmt: skip
        if norm is not None:
            return self.o_proj.linear_add(out.reshape(B, T, H * D), x)
        if resid is not None:
            return self.o_proj.linear_add_norm(out.reshape(B, T, H * D), resid, next_norm)
        return project(self.o_proj, out.reshape(B, T, H * D), split)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        E, eps, off = cfg.hidden_size, cfg.norm_eps, cfg.norm_offset
        self.placement = cfg.norm_placement
        self.residual_multiplier = cfg.residual_multiplier
        self.self_attn = Attention(cfg, layer)
        self.mlp = (
            MoE(cfg)
            if cfg.is_moe_layer(layer)
            else MLP(E, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        )
        self.uses_local_rope = cfg.local_rope is not None and cfg.window(layer) is not None
        # Hugging Face names the norms by position; "post_attention_layernorm" is the pre-MLP norm in
        # pre-norm families and the norm on the attention output in sandwich/post-norm families.
        if self.placement in ("pre", "sandwich"):
            self.input_layernorm = RMSNorm(E, eps, off)
        self.post_attention_layernorm = RMSNorm(E, eps, off)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(E, eps, off)
        if self.placement in ("sandwich", "post"):
            self.post_feedforward_layernorm = RMSNorm(E, eps, off)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache
    ) -> torch.Tensor:
        cos, sin = rope
        if self.placement == "pre":
            h, delta = self.forward_pre(x, None, rope, cache)
            return h + delta
        if self.placement == "sandwich":
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))

    def forward_pre(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | SplitSum | NormedRow | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        split: bool = False,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | SplitSum | NormedRow | None]:
        """A pre-norm layer on the residual stream x + delta (delta: the previous layer's MLP output, not yet
        added; None at the first layer) -> (stream after attention, this layer's MLP output). Each add is done
        by the norm after it (`RMSNorm.add_forward`: one kernel when decoding on CUDA). With `split`, the
        attention and MLP outputs may stay a split GEMV's partial sums (`SplitSum`), which those norms add; the
        MLP output returned then may be one too. Where the layer carries its norms (`carries_norm`), delta may
        be the previous layer's `NormedRow` of x (x then whole), and with next_norm (the next layer's input
        norm, where that layer carries its norms too) the result is (the whole stream, next_norm's row)."""
        cos, sin = rope
        m = self.residual_multiplier
        gpu = on_gpu(x)  # the folded, carried and rounded forms are CUDA rows' (a CPU step asks none of them)
        if gpu and self.folds(x):  # each add and norm inside a GEMV: the stream comes out whole
            if delta is not None:
                x = x + (delta.total(x.dtype) if isinstance(delta, SplitSum) else delta)
            h = self.self_attn(x, cos, sin, cache, norm=self.input_layernorm)
            return self.mlp(h, norm=self.post_attention_layernorm), None
        split = split and m == 1.0  # a scaled branch is summed first
        # each norm carried across the GEMVs either side of it (the first: a kernel)
        if gpu and self.carries_norm(x):
            if isinstance(delta, NormedRow):
                h, n, row = x, x, delta
            else:
                h, n = (
                    (x, self.input_layernorm(x))
                    if delta is None
                    else self.input_layernorm.add_forward(x, delta)
                )
                row = None
            post = self.post_attention_layernorm
            h, normed = self.self_attn(n, cos, sin, cache, normed=row, resid=h, next_norm=post)
            if next_norm is None:  # the stream's last add is the norm's after this layer
                return h, self.mlp(h, split, normed=normed)
            return self.mlp(h, normed=normed, next_norm=next_norm)
        if gpu and self.rounds(x):  # the norms hand qkv and gate/up their rows rounded to int8 as well
            h, n, r = self.input_layernorm.add_forward(
                x, torch.zeros_like(x) if delta is None else delta, True
            )
            a = self.self_attn(n, cos, sin, cache, split, rounded=r)
            h, n, r = self.post_attention_layernorm.add_forward(h, a * m if m != 1.0 else a, True)
            f = self.mlp(n, split, rounded=r)
            return h, f * m if m != 1.0 else f
        if delta is None:
            h, n = x, self.input_layernorm(x)
        else:
            h, n = self.input_layernorm.add_forward(x, delta)
        a = self.self_attn(n, cos, sin, cache, split)
        h, n = self.post_attention_layernorm.add_forward(h, a * m if m != 1.0 else a)
        f = self.mlp(n, split)
        return h, f * m if m != 1.0 else f

    def rounds(self, x: torch.Tensor) -> bool:
        """Whether this pre-norm layer's norms hand its qkv and gate/up projections their decode row x rounded to
        int8 as well (`ember.ops.norm.add_rms_norm_rounded`), for GEMVs on the integer tensor cores
        (`Int4WeightOnlyLinear.takes_rounded`; `ember.quant.cuda_int4.ROUNDED_ROWS`). The MLP SwiGLU, the width a
        multiple of 64, the norms' weights in the activations' dtype."""
        if type(self.mlp) is not MLP or self.mlp.act is not F.silu or x.shape[-1] % 64:
            return False
        projections = (self.self_attn.qkv_proj, self.mlp.gate_up_proj)  # first: off, the flag answers
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return all(hasattr(p, "takes_rounded") and p.takes_rounded(x) for p in projections) and all(
            n.weight.dtype == x.dtype for n in norms
        )

    def carries_norm(self, x: torch.Tensor) -> bool:
        """Whether this pre-norm layer runs its decode row x with its norms carried across the GEMVs either side
        of them: the GEMV before a norm adds the residual and hands on the row with the norm's weight applied
        and its sums of squares, the GEMV after it applies the norm's factor to its sums
        (`Int4WeightOnlyLinear.carries_norm`; `ember.quant.cuda_int4.FOLD_NORMS`), so that between layers
        that both carry them no norm kernel runs. The MLP SwiGLU, the branches unscaled, the norms' weights in
        the activations' dtype, the width at most `cuda_int4.FOLD_MAX_K`."""
        if self.residual_multiplier != 1.0 or type(self.mlp) is not MLP or self.mlp.act is not F.silu:
            return False
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)  # first: off, at once
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return (
            all(hasattr(p, "carries_norm") and p.carries_norm(x) for p in projections)
            and x.shape[-1] <= cuda_int4.FOLD_MAX_K
            and all(n.weight.dtype == x.dtype for n in norms)
        )

    def folds(self, x: torch.Tensor) -> bool:
        """Whether this pre-norm layer runs its decode row x with both norms and residual adds inside its int8
        GEMVs (`FOLD_NORMS`; `Int8WeightOnlyLinear.folds`): no norm kernels between the projections, each
        norm's factor applied to the next projection's sums, each add done as the projection before it
        stores. The norms' weights must be in the activations' dtype, the MLP SwiGLU, the branches unscaled."""
        if (
            not FOLD_NORMS
            or self.residual_multiplier != 1.0
            or type(self.mlp) is not MLP
            or self.mlp.act is not F.silu
        ):
            return False
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return all(n.weight.dtype == x.dtype for n in norms) and all(
            hasattr(p, "folds") and p.folds(x) for p in projections
        )


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Weights always come from a checkpoint (or an explicit init), so nn.Embedding's random init is skipped:
        # on the meta device, where models are built, normal_ imports torch._dynamo (~2 s of a CLI start).
        V, E = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nn.Embedding(V, E, _weight=torch.empty(V, E))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset)


class Decoder(nn.Module):
    """A causal LM: `model.*` is the body (Hugging Face's nesting), `lm_head` the output projection."""

    # Pre-norm layers let a split GEMV's partial sums ride into the next norm (`DecoderLayer.forward_pre`);
    # False has each projection add its own (for measuring what that is worth: benchmarks, A/B runs).
    fold_split_sums: bool = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        # Always a module, so that quantization can swap it like any other projection.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = Rope(cfg.rope)
        self.local_rope = Rope(cfg.local_rope) if cfg.local_rope is not None else None

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str) -> None:
        """Fills the non-persistent buffers (rope tables) once the weights are materialised."""
        self.rope.init_buffers(device)
        if self.local_rope is not None:
            self.local_rope.init_buffers(device)

    def tie_weights(self) -> None:
        """Tied models: the output projection is the embedding matrix (one tensor under two names).

        Loaders fill only `model.embed_tokens.weight` and call this again after assigning it.
        """
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens (B, T) and their positions (B, T) -> final hidden states (B, T, E), after the final norm."""
        cfg = self.config
        h = self.model.embed_tokens(tokens)  # (B, T, E)
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds sqrt(E) to the activation dtype before scaling; do the same to match it.
            h = h * torch.tensor(cfg.embedding_multiplier, dtype=h.dtype)
        cache.begin(positions)
        lengths = cache.sequence_lengths()
        rope = self.rope(positions, lengths)
        local = self.local_rope(positions, lengths) if self.local_rope is not None else rope
        if cfg.norm_placement == "pre":  # the residual adds ride in the next norm (`forward_pre`)
            delta = None
            layers = self.model.layers
            # a layer that carries its norms hands the next one its input norm's row, where that one does
            carries = (
                [layer.carries_norm(h) for layer in layers] + [False]
                if cuda_int4.FOLD_NORMS and on_gpu(h)
                else None
            )
            for i, layer in enumerate(layers):
                carried = carries is not None and carries[i] and carries[i + 1]
                h, delta = layer.forward_pre(
                    h,
                    delta,
                    local if layer.uses_local_rope else rope,
                    cache,
                    split=self.fold_split_sums,
                    next_norm=layers[i + 1].input_layernorm if carried else None,
                )
            return self.model.norm.add_forward(h, delta)[1] if delta is not None else self.model.norm(h)
        for layer in self.model.layers:
            h = layer(h, local if layer.uses_local_rope else rope, cache)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, E) -> float32 logits (B, T, V)."""
        cfg = self.config
        logits = self.lm_head(hidden).float()
        if cfg.logit_multiplier != 1.0:
            logits = logits * cfg.logit_multiplier
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
