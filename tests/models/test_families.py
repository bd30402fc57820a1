"""Every family against transformers: logits for a prompt longer than the sliding window, for every cached
decode step, and the greedy continuation, on tiny random checkpoints saved as real safetensors (fp32, eager).

Each case turns on its family's quirks: head_dim != hidden / heads, tied and untied embeddings, biases, q/k
norms, soft-capping, sliding windows shorter than the prompt, local/global rope bases, rope scaling, MoE with
dense layers in between, Granite's multipliers, OLMo 2's post-norms. Hand-edited config.json files (spellings
transformers' own saves never write) are reloaded by both sides and compared the same way.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from ember.engine.kv_cache import StaticKVCache
from ember.errors import UnsupportedArchitectureError
from ember.models import get_family, supported_architectures
from tests.conftest import load_hf_dir, run_cached

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT, MAX_SEQ = 20, 64
# Phi-3 LongRoPE switches to the long factors past this length; prompts and splits stay beyond it.
PHI3_ORIGINAL_CTX = 8


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[1.5 + 0.5 * i for i in range(half)],
    )


# case -> (transformers architecture, config overrides, prefill length of the cached run)
CASES: dict[str, tuple[str, dict, int]] = {
    "qwen2-bias-tied-window": (
        "Qwen2",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=7, max_window_layers=1),
        5,
    ),
    "qwen3-head_dim-yarn": (
        "Qwen3",
        dict(
            head_dim=24,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
            ),
        ),
        5,
    ),
    "qwen3-moe": (
        "Qwen3Moe",
        dict(
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        5,
    ),
    "qwen3-window": (
        "Qwen3",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=2),
        4,
    ),
    # Qwen3-MoE windows every layer, whatever max_window_layers says (Qwen2 / Qwen3 start there).
    "qwen3-moe-normalized-sparse-step-window": (
        "Qwen3Moe",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
        ),
        5,
    ),
    "gemma2-bias": (
        "Gemma2",
        dict(
            head_dim=32,
            attention_bias=True,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        4,
    ),
    "gemma3-linear-rope-bias": (
        "Gemma3Text",
        dict(
            head_dim=32,
            attention_bias=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
            tie_word_embeddings=False,
        ),
        4,
    ),
    "phi3-longrope-partial": (
        "Phi3",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=PHI3_ORIGINAL_CTX,
            rope_parameters=dict(rope_theta=10000.0, **_longrope(8)),
            sliding_window=None,
        ),
        PHI3_ORIGINAL_CTX + 2,
    ),
    "phi3-window-tied": (
        "Phi3",
        dict(sliding_window=7, tie_word_embeddings=True),
        5,
    ),
    "granite": (
        "Granite",
        dict(
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.05,
            logits_scaling=8.0,
            attention_bias=True,
        ),
        5,
    ),
    "mixtral-window": (
        "Mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7, intermediate_size=64),
        5,
    ),
    "olmo2": ("Olmo2", dict(), 5),
}


def _reference(arch: str, config: dict) -> transformers.PreTrainedModel:
    config_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch.removesuffix('Text')}ForCausalLM")
    model = model_cls(config_cls(**config, attn_implementation="eager")).eval()
    # Random init leaves norms at their identity and biases at zero; perturb them so a misplaced or missing one
    # shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def case_reference(case: str) -> transformers.PreTrainedModel:
    """The transformers model of one of `CASES`, norms and biases perturbed (`_reference`)."""
    arch, extra, _ = CASES[case]
    return _reference(arch, {**BASE, **extra})


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = case_reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    model = load_hf_dir(path)
    return request.param, ref, model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = StaticKVCache(model.config, batch_size=1, max_seq_len=MAX_SEQ, device="cpu", dtype=torch.float32)
    tokens, out = torch.tensor([prompt]), []
    pos = torch.arange(len(prompt))[None]
    for _ in range(n):
        nxt = model.compute_logits(model(tokens, pos, cache))[0, -1].argmax()
        out.append(int(nxt))
        tokens, pos = nxt.view(1, 1), pos[:, -1:] + 1
    return out


@torch.no_grad()
def test_logits_match_transformers(pair):
    case, ref, model = pair
    ids = torch.randint(3, BASE["vocab_size"], (2, PROMPT))
    expected = ref(ids).logits
    # The prefill over all slots behind a mask, and over the prompt's own slots (causal, or masked where a
    # sliding window hides part of the prompt).
    for from_start in (False, True):
        got = run_cached(model, ids, split=PROMPT, max_seq_len=MAX_SEQ, prompts_from_start=from_start)
        assert (got - expected).abs().max() <= 1e-4
        # A short prefill, then decode steps that run past the sliding window: every cached step matches.
        got = run_cached(model, ids, split=CASES[case][2], max_seq_len=MAX_SEQ, prompts_from_start=from_start)
        assert (got - expected).abs().max() <= 1e-4


@torch.no_grad()
def test_greedy_continuation_matches_transformers(pair):
    case, ref, model = pair
    prompt = torch.randint(3, BASE["vocab_size"], (1, max(CASES[case][2], 9)))
    n = 16
    expected = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    assert greedy(model, prompt[0].tolist(), n) == expected[0, prompt.shape[1] :].tolist()


# What a config.json must say; everything else may be left out (older transformers drop keys equal to the base
# class's defaults, e.g. tie_word_embeddings=True, and hand-written configs drop more).
STRUCTURAL = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "head_dim", "num_local_experts", "num_experts_per_tok",
}  # fmt: skip


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("Gemma2", dict(head_dim=32)),  # ties embeddings, soft-caps at 50 / 30, scales queries by 256 ** -0.5
        ("Gemma3Text", dict(head_dim=32)),  # ties embeddings, global rope base 1e6
        ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # eps 1e-5, rope base 1e6
        ("Phi3", dict(pad_token_id=0)),  # eps 1e-5
        ("Olmo2", dict()),  # eps 1e-5
        ("Qwen3", dict(head_dim=32)),
    ],
)
@torch.no_grad()
def test_keys_a_config_leaves_out_take_the_transformers_class_defaults(arch, extra, tmp_path):
    torch.manual_seed(0)
    ref = _reference(arch, {**{k: BASE[k] for k in STRUCTURAL & BASE.keys()}, **extra})
    ref.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k in STRUCTURAL}))
    model = load_hf_dir(tmp_path)
    ids = torch.randint(3, BASE["vocab_size"], (1, PROMPT))
    assert (run_cached(model, ids, split=PROMPT, max_seq_len=MAX_SEQ) - ref(ids).logits).abs().max() <= 1e-4


def _without(*keys: str):
    return lambda d: {k: v for k, v in d.items() if k not in keys}


_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_GEMMA3_ROPE = dict(
    full_attention=dict(rope_type="default", rope_theta=5e5),
    sliding_attention=dict(rope_type="default", rope_theta=1e4),
)
# case -> (transformers architecture, config overrides, edit of the saved config.json)
JSON_EDITS = {
    # transformers reads rope_scaling over rope_parameters (Gemma 3: into its full-attention entry)...
    "llama-rope_scaling-beside-rope_parameters": (
        "Llama",
        dict(),
        lambda d: {**d, "rope_scaling": dict(rope_type="linear", factor=4.0)},
    ),
    "gemma3-rope_scaling-beside-rope_parameters": (
        "Gemma3Text",
        dict(head_dim=32, sliding_window=6, sliding_window_pattern=2, rope_parameters=_GEMMA3_ROPE),
        lambda d: {**d, "rope_scaling": dict(rope_type="linear", factor=4.0)},
    ),
    # ... and a top-level original_max_position_embeddings over (or into) llama3 settings, in either spelling.
    "llama3-top-level-original-length": (
        "Llama",
        dict(rope_parameters=dict(_LLAMA3_ROPE, rope_theta=1e4)),
        lambda d: {**d, "original_max_position_embeddings": 16},
    ),
    "llama3-rope_scaling-top-level-original-length": (
        "Llama",
        dict(),
        lambda d: {
            **_without("rope_parameters")(d),
            "rope_theta": 1e4,
            "rope_scaling": _LLAMA3_ROPE,
            "original_max_position_embeddings": 16,
        },
    ),
    # Qwen2 / Qwen3 slide from layer 28 on (transformers' default) where max_window_layers is left out.
    "qwen2-window-without-max_window_layers": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=6),
        _without("max_window_layers", "layer_types"),
    ),
}


@pytest.mark.parametrize("case", sorted(JSON_EDITS))
@torch.no_grad()
def test_edited_config_json_is_read_as_transformers_reads_it(case, tmp_path):
    arch, extra, edit = JSON_EDITS[case]
    torch.manual_seed(0)
    _reference(arch, {**BASE, **extra}).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    model = load_hf_dir(tmp_path)
    ids = torch.randint(3, BASE["vocab_size"], (1, PROMPT))
    expected = ref(ids).logits
    for split in (PROMPT, 5):
        assert (run_cached(model, ids, split=split, max_seq_len=MAX_SEQ) - expected).abs().max() <= 1e-4


def test_config_keys_that_change_outputs_are_read_as_transformers_reads_them(tmp_path):
    from ember.errors import CheckpointError
    from ember.models import config_from_hf

    base = {**BASE, "architectures": ["LlamaForCausalLM"]}
    # Only Phi-3 rotates part of each head; transformers' Llama ignores the key.
    assert config_from_hf({**base, "partial_rotary_factor": 0.5}).rope.rotary_dim == 16
    phi3 = {**base, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5}
    assert config_from_hf(phi3).rope.rotary_dim == 8
    # Phi-3: the top-level original length wins over the rope settings' own (4096 when absent).
    longrope = _longrope(8)
    for top, want in ((8, 8), (None, 4096)):
        cfg = {**phi3, "rope_scaling": {**longrope, "original_max_position_embeddings": 64}}
        cfg = {**cfg, "original_max_position_embeddings": top} if top else cfg
        assert config_from_hf(cfg).rope.params["original_max_position_embeddings"] == want
    # Phi-3's early configs name LongRoPE "su" or "yarn"; any other scaling is refused, as transformers does.
    for key, name in (("type", "su"), ("rope_type", "yarn")):
        factors = {k: v for k, v in longrope.items() if k != "rope_type"}
        rope = config_from_hf({**phi3, "rope_scaling": {**factors, key: name}}).rope
        assert (rope.rope_type, rope.params["long_factor"]) == ("longrope", longrope["long_factor"])
    with pytest.raises(CheckpointError, match="Phi-3's rope_parameters has rope type 'linear'"):
        config_from_hf({**phi3, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    # Gemma 3's modelling does not soft-cap attention scores whatever the config says; Gemma 2 does.
    gemma = {**base, "head_dim": 32, "attn_logit_softcapping": 5.0}
    assert config_from_hf({**gemma, "architectures": ["Gemma3ForCausalLM"]}).attn_logit_softcap is None
    assert config_from_hf({**gemma, "architectures": ["Gemma2ForCausalLM"]}).attn_logit_softcap == 5.0
    # Qwen: a window of 4096 where use_sliding_window leaves it out; Qwen3-MoE windows every layer regardless of
    # max_window_layers and layer_types.
    qwen = {**base, "head_dim": 32, "use_sliding_window": True, "max_window_layers": 1}
    assert config_from_hf({**qwen, "architectures": ["Qwen3ForCausalLM"]}).layer_windows == (None, 4096, 4096)
    moe = {**qwen, "architectures": ["Qwen3MoeForCausalLM"], "layer_types": ["full_attention"] * 3}
    moe.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert config_from_hf(moe).layer_windows == (4096,) * 3
    # What Ember cannot run is one line naming the key, not a silent change of outputs or a ValueError.
    with pytest.raises(CheckpointError, match="rope_scaling of rope type 'linear' lacks 'factor'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(CheckpointError, match="rope_parameters of rope type 'llama3' lacks 'factor'"):
        config_from_hf({**base, "rope_parameters": {k: v for k, v in _LLAMA3_ROPE.items() if k != "factor"}})
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention"):
        config_from_hf({**gemma, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'proportional'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "proportional"}})
    with pytest.raises(CheckpointError, match="lacks 'hidden_size'"):
        config_from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_family("FalconForCausalLM")
    msg = str(err.value)
    assert "\n" not in msg and "'FalconForCausalLM'" in msg
    for arch in ("Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM"):
        assert arch in msg
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "GraniteForCausalLM",
        "MixtralForCausalLM",
        "Olmo2ForCausalLM",
    }
