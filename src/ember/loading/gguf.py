"""GGUF checkpoints: open, read metadata, build an HF-style config, and dequantize to HF-named tensors.

Parsing and dequantization are gguf-py's (`gguf.GGUFReader` over an mmap, with a faster pass over array
fields, and `gguf.quants.dequantize` in numpy); this module only translates. The target is exactly what `transformers` holds after loading the same
file, so the rest of Ember sees one checkpoint format:

- names: one table per family maps llama.cpp tensor names (`blk.{i}.attn_q.weight`) to Hugging Face names
  (`model.layers.{i}.self_attn.q_proj.weight`) together with the expected shape, in config symbols;
- values: llama.cpp's conversion tweaks are undone as named per-family deltas (the q/k row permutation of
  llama-arch attention, Gemma's norm weight stored as `1 + w`, stacked MoE experts split per expert);
- config: `gguf_to_hf_config` writes the keys a `config.json` of that architecture has, so the config
  builder treats a GGUF file and a safetensors directory alike.

Tensor shapes in the tables use config symbols: V vocab, E hidden size, D head dim, Q = heads * D,
KV = kv_heads * D, I intermediate size, MI MoE expert intermediate size, X number of experts.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from ember.errors import CheckpointError, UnsupportedArchitectureError

_GGUF_MAGIC = b"GGUF"

# A table entry: GGUF name template -> (HF name template, expected HF shape in config symbols), or None for a
# tensor that is not a parameter (consumed by the config, or recomputed by the model).
_Entry = tuple[str, tuple[str, ...]] | None


# --------------------------------------------------------------------------------------------- reading


class _Reader(gguf.GGUFReader):
    """gguf-py's reader with array fields read in one pass.

    gguf-py makes two numpy views of the memory map per element of an array field; a 49k-token vocabulary
    and its 49k merges made that ~3.5 s of SmolLM2's ~6 s load. Here a numeric array is one view and a
    string array is walked over a memoryview, each string a slice of it (a fifth of a numpy view's cost), in
    the layout (`parts`, `data`) that `ReaderField.contents()` reads. Empty, nested and byte-swapped arrays
    take gguf-py's own path.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if n == 0 or (nptype is None and itype != gguf.GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        types = [gguf.GGUFValueType.ARRAY, itype]
        if nptype is not None:
            values = self._get(offs, nptype, n)
            return offs + values.nbytes - orig_offs, [raw_itype, alen, values], [2], types
        buf = memoryview(self.data)
        parts: list[np.ndarray | memoryview] = [raw_itype, alen]
        for _ in range(n):
            length = int.from_bytes(buf[offs : offs + 8], "little")
            if offs + 8 + length > len(buf):
                raise ValueError(f"a string at byte {offs} runs past the end of the file ({len(buf)} bytes)")
            parts.append(buf[offs + 8 : offs + 8 + length])  # a view; `contents()` takes its .tobytes()
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, 2 + n)), types

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        # gguf-py views each tensor's bytes as it goes: one that runs past the end of a cut file fails as a
        # numpy reshape. Every extent is checked first, so the error names the tensor.
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            try:
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                continue  # an unknown type: gguf-py's own error names it
            end = start_offs + int(offset[0]) + math.prod(int(d) for d in dims) * size // block
            if end > len(self.data):
                raise _PastTheEnd(f"tensor {bytes(name).decode(errors='replace')!r} ends at byte {end}")
        super()._build_tensors(start_offs, fields)


class _PastTheEnd(ValueError):
    """A tensor's data runs past the end of the file."""


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped) and check that it is whole.

    Raises `CheckpointError` for a missing file, a file that is not GGUF, or a truncated/corrupt one; the
    message is one line naming the path.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a GGUF file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise CheckpointError(f"{path}: expected a GGUF file (magic 'GGUF'), found {magic!r}")
    size = path.stat().st_size
    try:
        return _Reader(path, "r")
    except _PastTheEnd as e:
        raise CheckpointError(f"{path}: truncated GGUF file: {e} but the file has {size}") from e
    except (ValueError, IndexError, OverflowError, EOFError) as e:
        # gguf-py reads the header with numpy views of the mmap: a file cut short surfaces as a failed
        # reshape/view or an out-of-bounds index rather than as a clear error, so translate it here.
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {e}") from e


def _field_value(f: gguf.ReaderField) -> object:
    """One KV field as a plain Python value; float32 scalars keep their shortest decimal form."""
    value = f.contents()
    # A float32 like 1e-5 widened to float64 reads 9.999999747378752e-06; config.json said 1e-05.
    if f.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every KV field of the file as plain Python values (strings decoded, arrays as lists).

    The reader's synthetic `GGUF.*` header fields (version, counts) are left out.
    """
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _config_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    """The metadata a config needs: everything except the (large) tokenizer vocabulary arrays."""
    return {
        name: _field_value(f)
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
        and not (name.startswith("tokenizer.") and f.types[0] == gguf.GGUFValueType.ARRAY)
    }


# ------------------------------------------------------------------------------------------ name tables

_EMBED: dict[str, _Entry] = {
    "token_embd.weight": ("model.embed_tokens.weight", ("V", "E")),
    "output_norm.weight": ("model.norm.weight", ("E",)),
    "output.weight": ("lm_head.weight", ("V", "E")),
}
_ATTN: dict[str, _Entry] = {
    "blk.{i}.attn_q.weight": ("model.layers.{i}.self_attn.q_proj.weight", ("Q", "E")),
    "blk.{i}.attn_k.weight": ("model.layers.{i}.self_attn.k_proj.weight", ("KV", "E")),
    "blk.{i}.attn_v.weight": ("model.layers.{i}.self_attn.v_proj.weight", ("KV", "E")),
    "blk.{i}.attn_output.weight": ("model.layers.{i}.self_attn.o_proj.weight", ("E", "Q")),
}
_QK_NORM: dict[str, _Entry] = {
    "blk.{i}.attn_q_norm.weight": ("model.layers.{i}.self_attn.q_norm.weight", ("D",)),
    "blk.{i}.attn_k_norm.weight": ("model.layers.{i}.self_attn.k_norm.weight", ("D",)),
}
_QKV_BIAS: dict[str, _Entry] = {
    "blk.{i}.attn_q.bias": ("model.layers.{i}.self_attn.q_proj.bias", ("Q",)),
    "blk.{i}.attn_k.bias": ("model.layers.{i}.self_attn.k_proj.bias", ("KV",)),
    "blk.{i}.attn_v.bias": ("model.layers.{i}.self_attn.v_proj.bias", ("KV",)),
}
_MLP: dict[str, _Entry] = {
    "blk.{i}.ffn_gate.weight": ("model.layers.{i}.mlp.gate_proj.weight", ("I", "E")),
    "blk.{i}.ffn_up.weight": ("model.layers.{i}.mlp.up_proj.weight", ("I", "E")),
    "blk.{i}.ffn_down.weight": ("model.layers.{i}.mlp.down_proj.weight", ("E", "I")),
}
# Pre-norm decoder layer (llama, qwen, phi3, granite).
_NORMS: dict[str, _Entry] = {
    "blk.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", ("E",)),
    "blk.{i}.ffn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", ("E",)),
}
# Gemma 2/3: a norm before and after both attention and MLP. llama.cpp's ffn_norm is HF's pre-FFN norm.
_SANDWICH_NORMS: dict[str, _Entry] = {
    "blk.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", ("E",)),
    "blk.{i}.post_attention_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", ("E",)),
    "blk.{i}.ffn_norm.weight": ("model.layers.{i}.pre_feedforward_layernorm.weight", ("E",)),
    "blk.{i}.post_ffw_norm.weight": ("model.layers.{i}.post_feedforward_layernorm.weight", ("E",)),
}
# Qwen3-MoE: llama.cpp stacks the experts into one (X, out, in) tensor; HF checkpoints name each expert.
_MOE: dict[str, _Entry] = {
    "blk.{i}.ffn_gate_inp.weight": ("model.layers.{i}.mlp.gate.weight", ("X", "E")),
    "blk.{i}.ffn_gate_exps.weight": ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ("MI", "E")),
    "blk.{i}.ffn_up_exps.weight": ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("MI", "E")),
    "blk.{i}.ffn_down_exps.weight": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", ("E", "MI")),
}
# Mixtral: llama.cpp writes it as a llama-arch file with stacked experts; the targets are the hub names
# (block_sparse_moe, w1 = gate, w3 = up, w2 = down) that Mixtral checkpoints use.
_MIXTRAL_MOE: dict[str, _Entry] = {
    "blk.{i}.ffn_gate_inp.weight": ("model.layers.{i}.block_sparse_moe.gate.weight", ("X", "E")),
    "blk.{i}.ffn_gate_exps.weight": ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", ("I", "E")),
    "blk.{i}.ffn_up_exps.weight": ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", ("I", "E")),
    "blk.{i}.ffn_down_exps.weight": ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", ("E", "I")),
}
# Phi-3 keeps HF's fused projections (llama.cpp calls the fused gate/up tensor ffn_up).
_PHI3: dict[str, _Entry] = {
    "blk.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", ("E",)),
    "blk.{i}.attn_qkv.weight": ("model.layers.{i}.self_attn.qkv_proj.weight", ("QKV", "E")),
    "blk.{i}.attn_output.weight": ("model.layers.{i}.self_attn.o_proj.weight", ("E", "Q")),
    "blk.{i}.ffn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", ("E",)),
    "blk.{i}.ffn_up.weight": ("model.layers.{i}.mlp.gate_up_proj.weight", ("I2", "E")),
    "blk.{i}.ffn_down.weight": ("model.layers.{i}.mlp.down_proj.weight", ("E", "I")),
    # LongRoPE factors become config.rope_scaling (see _phi3_config).
    "rope_factors_long.weight": None,
    "rope_factors_short.weight": None,
}
# llama.cpp precomputes Llama-3 rope frequency factors into a tensor; HF recomputes them from rope_scaling.
_ROPE_FREQS: dict[str, _Entry] = {"rope_freqs.weight": None}


# ----------------------------------------------------------------------------------------- config deltas


def _query_pre_attn_scalar(meta: dict[str, object], arch: str, cfg: dict) -> float:
    # Gemma 2/3 27B scale queries by hidden/heads, the smaller ones by head_dim. GGUF does not store the
    # value; llama.cpp decides by the model size, i.e. the layer count (46 for Gemma 2, 62 for Gemma 3).
    big = {"gemma2": 46, "gemma3": 62}[arch]
    if cfg["num_hidden_layers"] == big:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["head_dim"]


def _gemma2_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = _query_pre_attn_scalar(meta, arch, cfg)
    cfg["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    cfg["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping")
    cfg["final_logit_softcapping"] = meta.get(f"{arch}.final_logit_softcapping")
    # Gemma 2 alternates local and global layers, local first.
    cfg["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])
    ]


def _gemma3_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = _query_pre_attn_scalar(meta, arch, cfg)
    cfg["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    cfg["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping")
    cfg["final_logit_softcapping"] = meta.get(f"{arch}.final_logit_softcapping")
    # Local (sliding) layers use their own rope base; llama.cpp hard-codes 10k and GGUF rarely stores it.
    cfg["rope_local_base_freq"] = meta.get(f"{arch}.rope.freq_base_swa", 10000.0)
    # Five local layers then one global, unless the file lists the pattern per layer.
    n = cfg["num_hidden_layers"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        swa = [bool(x) for x in pattern]
    else:
        period = int(pattern) if pattern else 6
        swa = [(i + 1) % period != 0 for i in range(n)]
        cfg["sliding_window_pattern"] = period
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in swa]


def _qwen3moe_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["num_experts"] = meta[f"{arch}.expert_count"]
    cfg["num_experts_per_tok"] = meta[f"{arch}.expert_used_count"]
    cfg["moe_intermediate_size"] = meta[f"{arch}.expert_feed_forward_length"]
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = []
    # llama.cpp renormalizes the top-k router weights for qwen3moe; HF's default is False.
    cfg["norm_topk_prob"] = True


def _mixtral_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["num_local_experts"] = meta[f"{arch}.expert_count"]
    cfg["num_experts_per_tok"] = meta[f"{arch}.expert_used_count"]
    cfg["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")


def _phi3_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        cfg["original_max_position_embeddings"] = orig
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and rot != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rot / cfg["head_dim"]


def _granite_config(meta: dict[str, object], arch: str, cfg: dict) -> None:
    cfg["attention_multiplier"] = meta.get(f"{arch}.attention.scale", 1.0)
    cfg["embedding_multiplier"] = meta.get(f"{arch}.embedding_scale", 1.0)
    cfg["residual_multiplier"] = meta.get(f"{arch}.residual_scale", 1.0)
    cfg["logits_scaling"] = meta.get(f"{arch}.logit_scale", 1.0)


@dataclass(frozen=True)
class _Family:
    """How one `general.architecture` maps onto its Hugging Face model."""

    hf_architecture: str
    model_type: str
    tensors: dict[str, _Entry]
    hidden_act: str = "silu"
    # llama.cpp permutes the rows of q/k for llama-arch models (interleaved rope); undo it.
    permute_qk: bool = False
    # Gemma: RMSNorm computes x * (1 + w) and llama.cpp stores 1 + w; HF stores w.
    norm_offset: float = 0.0
    extra_config: Callable[[dict[str, object], str, dict], None] | None = None
    config_defaults: dict[str, object] = field(default_factory=dict)


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(
        "LlamaForCausalLM",
        "llama",
        {**_EMBED, **_NORMS, **_ATTN, **_MLP, **_ROPE_FREQS},
        permute_qk=True,
        config_defaults={"attention_bias": False, "mlp_bias": False},
    ),
    "granite": _Family(
        "GraniteForCausalLM",
        "granite",
        {**_EMBED, **_NORMS, **_ATTN, **_MLP},
        permute_qk=True,
        extra_config=_granite_config,
    ),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2", {**_EMBED, **_NORMS, **_ATTN, **_QKV_BIAS, **_MLP}),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3", {**_EMBED, **_NORMS, **_ATTN, **_QK_NORM, **_MLP}),
    "qwen3moe": _Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {**_EMBED, **_NORMS, **_ATTN, **_QK_NORM, **_MOE},
        extra_config=_qwen3moe_config,
    ),
    "gemma2": _Family(
        "Gemma2ForCausalLM",
        "gemma2",
        {**_EMBED, **_SANDWICH_NORMS, **_ATTN, **_MLP},
        hidden_act="gelu_pytorch_tanh",
        norm_offset=1.0,
        extra_config=_gemma2_config,
    ),
    "gemma3": _Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**_EMBED, **_SANDWICH_NORMS, **_ATTN, **_QK_NORM, **_MLP},
        hidden_act="gelu_pytorch_tanh",
        norm_offset=1.0,
        extra_config=_gemma3_config,
    ),
    "phi3": _Family("Phi3ForCausalLM", "phi3", {**_EMBED, **_PHI3}, extra_config=_phi3_config),
}


_MIXTRAL = _Family(
    "MixtralForCausalLM",
    "mixtral",
    {**_EMBED, **_NORMS, **_ATTN, **_MIXTRAL_MOE, **_ROPE_FREQS},
    permute_qk=True,
    extra_config=_mixtral_config,
)


def _family(reader: gguf.GGUFReader) -> tuple[str, _Family]:
    field_ = reader.fields.get("general.architecture")
    if field_ is None:
        raise CheckpointError("GGUF file has no general.architecture key")
    arch = str(field_.contents())
    expert_count = reader.fields.get(f"{arch}.expert_count")
    if arch == "llama" and expert_count is not None and int(expert_count.contents()) > 0:
        # Mixtral is a llama-arch file with experts; the architecture key stays "llama" for the metadata.
        return arch, _MIXTRAL
    if arch not in _FAMILIES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return arch, _FAMILIES[arch]


# ------------------------------------------------------------------------------------------------ config

# GGUF rope.scaling.* suffix -> HF rope_scaling key.
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _rope_scaling(meta: dict[str, object], arch: str, reader: gguf.GGUFReader) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        # Phi-3 LongRoPE: per-dimension factors are stored as tensors, not keys.
        def factors(name: str) -> list[float]:
            return [float(x) for x in gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)]

        return {
            "rope_type": "longrope",
            "long_factor": factors("rope_factors_long.weight"),
            "short_factor": factors("rope_factors_short.weight"),
        }
    if kind is None or kind == "none":
        return None
    scaling: dict[str, object] = {"rope_type": kind}
    for suffix, hf_key in _ROPE_SCALING_KEYS.items():
        value = meta.get(f"{arch}.rope.scaling.{suffix}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def gguf_to_hf_config(reader: gguf.GGUFReader) -> dict:
    """The `config.json` that Hugging Face would have for this checkpoint, built from GGUF metadata.

    Keys follow `transformers`' config class for the architecture (`rope_theta`/`rope_scaling` in the
    classic form, which every transformers version accepts).
    Raises `UnsupportedArchitectureError` for an architecture not in the family table.
    """
    arch, fam = _family(reader)
    meta = _config_metadata(reader)
    tensor_names = {t.name: t for t in reader.tensors}

    def key(suffix: str, default: object = None) -> object:
        return meta.get(f"{arch}.{suffix}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    n_layers = key("block_count")
    if hidden is None or heads is None or n_layers is None:
        raise CheckpointError(f"GGUF metadata lacks {arch}.embedding_length/attention.head_count/block_count")
    # Some files store per-layer head counts; HF configs hold one value.
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        kv_heads = max(kv_heads)
    vocab = key("vocab_size")
    if vocab is None and "token_embd.weight" in tensor_names:
        vocab = int(tensor_names["token_embd.weight"].shape[-1])

    cfg: dict[str, object] = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": key("attention.key_length", hidden // heads),
        "hidden_act": fam.hidden_act,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, reader),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            cfg[hf_key] = meta[gguf_key]
    cfg.update(fam.config_defaults)
    if fam.extra_config is not None:
        fam.extra_config(meta, arch, cfg)
    return cfg


# ----------------------------------------------------------------------------------------------- tensors

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _dims(cfg: dict) -> dict[str, int]:
    """Values of the shape symbols used in the name tables."""
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    inter = cfg.get("intermediate_size") or 0
    return {
        "V": cfg["vocab_size"],
        "E": cfg["hidden_size"],
        "D": d,
        "Q": q,
        "KV": kv,
        "QKV": q + 2 * kv,
        "I": inter,
        "I2": 2 * inter,
        "MI": cfg.get("moe_intermediate_size") or 0,
        "X": cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
    }


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half layout -> GGML interleaved layout).

    Per head the HF rows are [first half | second half] of the rotary pairs; llama.cpp interleaves them.
    """
    rows = w.shape[0]
    w = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])  # (heads, D/2, 2, ...)
    return w.swapaxes(1, 2).reshape(rows, *w.shape[3:])  # (heads * D, ...)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if not a.flags.writeable:
        # F32 tensors come back as read-only views of the mmap; copy so the result does not pin the file.
        a = np.array(a, copy=True)
    return torch.from_numpy(a).to(dtype)


def _hf_names(t: gguf.ReaderTensor, arch: str, fam: _Family, cfg: dict) -> tuple[str, str, list[str]]:
    """One GGUF tensor -> (its key in the family table, its HF name with `{e}` for an expert index, the HF
    names it becomes); no names for tensors that HF checkpoints do not carry. Raises CheckpointError for a
    tensor the family does not know."""
    m = _BLOCK_RE.fullmatch(t.name)
    key, layer = (f"blk.{{i}}.{m[2]}", m[1]) if m else (t.name, None)
    if key not in fam.tensors:
        raise CheckpointError(f"GGUF tensor {t.name!r} has no Hugging Face name for architecture {arch!r}")
    entry = fam.tensors[key]
    if entry is None:
        return key, "", []
    name = entry[0].replace("{i}", layer) if layer is not None else entry[0]
    if "{e}" in name:  # stacked experts: one HF tensor per expert
        return key, name, [name.replace("{e}", str(e)) for e in range(_dims(cfg)["X"])]
    return key, name, [name]


def _convert_tensor(
    t: gguf.ReaderTensor, arch: str, fam: _Family, cfg: dict, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """One GGUF tensor -> its HF-named tensor(s) in the HF layout (several for stacked MoE experts)."""
    key, name, names = _hf_names(t, arch, fam, cfg)
    if not names:
        return []
    symbols = fam.tensors[key][1]
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"GGUF tensor {t.name!r}: quantization {t.tensor_type.name} unsupported") from e
    if fam.permute_qk and key == "blk.{i}.attn_q.weight":
        w = _unpermute_rows(w, cfg["num_attention_heads"])
    elif fam.permute_qk and key == "blk.{i}.attn_k.weight":
        w = _unpermute_rows(w, cfg["num_key_value_heads"])
    if fam.norm_offset and key.endswith("norm.weight"):
        w = w.astype(np.float32) - np.float32(fam.norm_offset)
    dims = _dims(cfg)
    expected = tuple(dims[s] for s in symbols)
    if "{e}" in name:  # (X, out, in) -> X tensors of (out, in)
        expected = (dims["X"], *expected)
    if tuple(w.shape) != expected:
        shown = name.replace("{e}", "*")
        raise CheckpointError(
            f"GGUF tensor {t.name!r} ({shown!r}) has shape {tuple(w.shape)} but the config implies {expected}"
        )
    if len(names) == 1:
        return [(names[0], _to_torch(w, dtype))]
    return [(n, _to_torch(w[e], dtype)) for e, n in enumerate(names)]


# 4-bit GGUF block types whose values are codes on a grid of 32 weights along a row, w = code * scale + min:
# exactly Ember's int4 groups of 32 (`ember.quant.linear.Int4WeightOnlyLinear`), so a loader can take the
# codes as they are instead of dequantizing and quantizing again. Bytes per block (ggml's layouts):
# Q4_0 f16 d, 16 bytes of codes (w = d (q - 8)); Q4_1 f16 d, f16 m, 16 bytes (w = d q + m); Q4_K, per 256
# weights: f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes (w = d sc q - dmin mn).
_INT4_BLOCK_BYTES = {
    gguf.GGMLQuantizationType.Q4_0: 18,
    gguf.GGMLQuantizationType.Q4_1: 20,
    gguf.GGMLQuantizationType.Q4_K: 144,
}


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) little-endian bytes -> (...) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, size: int | None) -> np.ndarray | None:
    """Rows of GGUF blocks (N, bytes per row) -> (N, blocks, size) bytes; None for a type without a size."""
    return None if size is None else data.reshape(data.shape[0], -1, size)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes (..., 12) -> their eight 6-bit scales and mins (..., 8) as float32."""
    lo, mlo, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # Sub-blocks 0-3: 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7: 4 bits in bytes 8-11 (low nibble scale,
    # high nibble min) and their top 2 bits in the top bits of bytes 0-3 and 4-7.
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1).astype(np.float32)
    mn = np.concatenate([mlo & 63, (hi >> 4) | ((mlo >> 6) << 4)], axis=-1).astype(np.float32)
    return sc, mn


def int4_blocks(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of Q4_0, Q4_1 or Q4_K blocks (N, bytes per row) -> codes uint8 (N, K) in [0, 15], scales and mins
    float32 (N, K/32), with code * scale + min equal to ggml's dequantized weight; None for other types."""
    if (b := _blocks(data, _INT4_BLOCK_BYTES.get(qtype))) is None:
        return None
    N = data.shape[0]
    d = _f16(b[..., 0:2])
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        sc, mn = _k_scales_mins(b[..., 4:16])
        scales = d[..., None] * sc  # exact: an f16 times a 6-bit integer
        mins = -(_f16(b[..., 2:4])[..., None] * mn)
        q = b[..., 16:].reshape(N, -1, 4, 32)  # 64 weights per 32 bytes: low nibbles then high nibbles
        codes = np.stack([q & 15, q >> 4], axis=3)  # (N, blocks, 4, 2, 32)
    else:
        if qtype == gguf.GGMLQuantizationType.Q4_1:
            scales, mins, q = d, _f16(b[..., 2:4]), b[..., 4:]
        else:
            scales, mins, q = d, -8.0 * d, b[..., 2:]
        codes = np.stack([q & 15, q >> 4], axis=2)  # (N, blocks, 2, 16): weights 0-15 low, 16-31 high
    return codes.reshape(N, -1), scales.reshape(N, -1), mins.reshape(N, -1)


# GGUF block types whose values are small integer codes times one scale per 32 (or 16) weights along a row,
# plus for some a min: w = code * scale (+ min), Ember's int8 blocks (`ember.quant.linear.Int8BlockLinear`).
# Bytes per block (ggml's layouts): Q8_0 f16 d, 32 int8 codes (w = d q); Q5_0 f16 d, 4 bytes of the codes'
# fifth bits, 16 bytes of their low nibbles (w = d (q - 16)); Q5_1 the same after an f16 m (w = d q + m);
# per 256 weights: Q6_K 128 bytes of the codes' low nibbles, 64 of their top two bits, sixteen int8 scales of
# 16 weights each, f16 d (w = d sc (q - 32)); Q5_K f16 d, f16 dmin, Q4_K's 12 bytes of eight 6-bit scales and
# mins, 32 bytes of fifth bits, 128 of low nibbles (w = d sc q - dmin mn); Q3_K 32 bytes of third bits, 64 of
# 2-bit codes, sixteen 6-bit scales in 12 bytes, f16 d (w = d (sc - 32) q, q in -4..3); Q2_K sixteen bytes
# of a 4-bit scale and min, 64 of 2-bit codes, f16 d, f16 dmin (w = d sc q - dmin mn). The 4-bit types
# (`int4_blocks`) are int8 blocks too, for a projection whose parts mix them with these.
_INT8_BLOCK_BYTES = {
    gguf.GGMLQuantizationType.Q8_0: 34,
    gguf.GGMLQuantizationType.Q5_0: 22,
    gguf.GGMLQuantizationType.Q5_1: 24,
    gguf.GGMLQuantizationType.Q6_K: 210,
    gguf.GGMLQuantizationType.Q5_K: 176,
    gguf.GGMLQuantizationType.Q3_K: 110,
    gguf.GGMLQuantizationType.Q2_K: 84,
}


def _low_and_fifth_bits(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: a block's 16 bytes of low nibbles (..., 16) and 4 bytes of fifth bits -> codes (..., 32) in
    [0, 31]: weight j < 16 the low nibble of byte j, j >= 16 the high nibble of byte j - 16; bit j of qh."""
    high = (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16) | (high.astype(np.int16) << 4)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q3_K / Q2_K: 64 bytes of 2-bit codes (..., 64) -> 256 codes in [0, 3]: weight 128 h + 32 s + l is bits
    2 s of byte 32 h + l."""
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def int8_blocks(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Rows of the blocks of one of `_INT8_BLOCK_BYTES`' types or a 4-bit type (N, bytes per row) -> codes int8
    (N, K), scales float32 (N, K/b) and mins float32 (N, K/b) or None (a type without them), blocks b of 32
    (Q6_K, Q3_K and Q2_K: 16), with code * scale (+ min) equal to ggml's dequantized weight; None for other
    types."""
    if (four := int4_blocks(data, qtype)) is not None:
        codes, scales, mins = four
        return codes.astype(np.int8), scales, mins
    if (b := _blocks(data, _INT8_BLOCK_BYTES.get(qtype))) is None:
        return None
    N, T = data.shape[0], gguf.GGMLQuantizationType
    mins = None
    if qtype == T.Q6_K:
        ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8).astype(np.float32)
        scales = _f16(b[..., 208:210])[..., None] * sc  # exact: an f16 times an int8
        # Each half of 128 weights: ql's 64 bytes, qh's 32; weight 32 j + l of the half (j < 4, l < 32) has
        # the low (j < 2) or high nibble of ql byte 32 (j % 2) + l and bits 2 j of qh byte l.
        ql, qh = ql.reshape(N, -1, 2, 2, 32), qh.reshape(N, -1, 2, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # (N, blocks, half, j, l)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3
        codes = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    elif qtype == T.Q5_K:
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scales_mins(b[..., 4:16])
        scales, mins = d * sc, -(dmin * mn)  # exact: f16s times 6-bit integers
        # Sub-block i (of 32): the low (i even) or high nibbles of qs bytes 32 (i // 2) + l, bit i of qh byte l.
        q = b[..., 48:].reshape(N, -1, 4, 1, 32)
        low = np.concatenate([q & 15, q >> 4], axis=3).reshape(N, -1, 8, 32)
        high = (b[..., 16:48].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        codes = low.astype(np.int16) | (high.astype(np.int16) << 4)
    elif qtype == T.Q3_K:
        # Scale j: the low (j < 8) or high nibble of byte j % 8, and bits 2 (j // 4) of byte 8 + j % 4 above them.
        packed = b[..., 96:108]
        low = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-1)
        top = (packed[..., 8:12].reshape(N, -1, 1, 4) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
        sc = (low | (top.reshape(N, -1, 16) << 4)).astype(np.float32) - 32
        scales = _f16(b[..., 108:110])[..., None] * sc  # exact: an f16 times a 6-bit integer
        # Weight 32 i + l (i < 8) has the third bit i of hmask byte l; a clear bit takes 4 off its code.
        third = (b[..., :32].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        codes = _crumbs(b[..., 32:96]).astype(np.int16) - 4 * (1 - third.reshape(N, -1, 256).astype(np.int16))
    elif qtype == T.Q2_K:
        d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
        # exact: f16s times 4-bit integers
        scales, mins = d * (b[..., :16] & 15), -(dmin * (b[..., :16] >> 4))
        codes = _crumbs(b[..., 16:80])
    else:
        d = _f16(b[..., 0:2])
        if qtype == T.Q8_0:
            scales, codes = d, np.ascontiguousarray(b[..., 2:]).view(np.int8)
        elif qtype == T.Q5_0:
            scales, codes = d, _low_and_fifth_bits(b[..., 6:], b[..., 2:6]) - 16
        else:  # Q5_1
            scales, mins, codes = d, _f16(b[..., 2:4]), _low_and_fifth_bits(b[..., 8:], b[..., 4:8])
    if mins is not None:
        mins = mins.astype(np.float32).reshape(N, -1)
    return codes.astype(np.int8).reshape(N, -1), scales.astype(np.float32).reshape(N, -1), mins


def _convert_blocks(
    t: gguf.ReaderTensor, arch: str, fam: _Family, cfg: dict, decode=None
) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """One GGUF tensor -> its HF name and the blocks `decode` takes from it (`int4_blocks` by default, or
    `int8_blocks`: codes, scales, mins) in the HF layout; None where `decode` does not take the tensor's type or
    it is not one HF matrix (stacked experts)."""
    key, name, names = _hf_names(t, arch, fam, cfg)
    if len(names) != 1 or len(t.data.shape) != 2:
        return None
    blocks = (decode or int4_blocks)(t.data, t.tensor_type)
    if blocks is None:
        return None
    if fam.permute_qk and key in ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight"):
        heads = cfg["num_attention_heads" if key.endswith("q.weight") else "num_key_value_heads"]
        # rows move whole, with their groups
        blocks = tuple(a if a is None else _unpermute_rows(a, heads) for a in blocks)
    dims = _dims(cfg)
    expected = tuple(dims[s] for s in fam.tensors[key][1])
    if blocks[0].shape != expected:
        raise CheckpointError(
            f"GGUF tensor {t.name!r} ({name!r}) has shape {blocks[0].shape} but the config implies {expected}"
        )
    return name, tuple(a if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in blocks)


def load_gguf_state_dict(
    reader: gguf.GGUFReader, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Dequantize every parameter into a Hugging Face-named state dict in the HF layout.

    The result equals `transformers`' state dict after loading the same GGUF, except that tied embeddings
    appear once (`lm_head.weight` only when the file has `output.weight`) and MoE experts carry the
    per-expert names of HF checkpoints. Raises `CheckpointError` on an unknown tensor or a shape that
    disagrees with the config.
    """
    arch, fam = _family(reader)
    cfg = gguf_to_hf_config(reader)
    out: dict[str, torch.Tensor] = {}
    # gguf-py dequantizes in numpy, which releases the GIL in its array kernels: threads give ~1.4x on 2 cores.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for pairs in pool.map(lambda t: _convert_tensor(t, arch, fam, cfg, dtype), reader.tensors):
            out.update(pairs)
    return out


class GGUFSource:
    """The HF-named tensors of a GGUF file (a `WeightSource`), each GGUF tensor dequantized only when one of
    its names is asked for: with a loader that quantizes as it reads, the float model never exists whole.
    (`load_gguf_state_dict` converts everything at once, on several threads, for float loads.)"""

    def __init__(self, reader: gguf.GGUFReader, dtype: torch.dtype = torch.float32) -> None:
        self._arch, self._fam = _family(reader)
        self._cfg = gguf_to_hf_config(reader)
        self._dtype = dtype
        self._owner = {
            n: t for t in reader.tensors for n in _hf_names(t, self._arch, self._fam, self._cfg)[2]
        }
        self._last: tuple[gguf.ReaderTensor | None, dict[str, torch.Tensor]] = (None, {})

    def names(self) -> set[str]:
        return set(self._owner)

    def get_int4(self, name: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The file's own 4-bit codes of `name` as Ember's int4 groups (codes uint8 (N, K), scales and mins
        float32 (N, K/g)), without dequantizing; None unless the tensor is Q4_0, Q4_1 or Q4_K and g = 32."""
        if group_size != 32:
            return None
        converted = _convert_blocks(self._owner[name], self._arch, self._fam, self._cfg)
        return converted[1] if converted is not None else None

    def get_int8(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The file's own codes of `name` as int8 blocks (codes int8 (N, K), scales float32 (N, K/b), mins
        float32 (N, K/b) or None; `int8_blocks`), without dequantizing; None unless the tensor is one of
        their types."""
        converted = _convert_blocks(self._owner[name], self._arch, self._fam, self._cfg, int8_blocks)
        return converted[1] if converted is not None else None

    def get(self, name: str) -> torch.Tensor:
        t = self._owner[name]
        if self._last[0] is not t:  # experts of one GGUF tensor are asked for one after the other
            self._last = (t, dict(_convert_tensor(t, self._arch, self._fam, self._cfg, self._dtype)))
        return self._last[1][name]
