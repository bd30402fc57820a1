"""`ember bench --json` on the default model (SmolLM2 GGUF) and on random weights."""

from __future__ import annotations

import json

import pytest

from ember.cli.main import main


@pytest.mark.slow
def test_bench_json_default_model(capsys):
    code = main(
        ["bench", "--json", "--prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1", "--warmup", "0"]
    )
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "smollm2-135m-instruct" and r["new_tokens"] == 4
    assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["time_to_first_token_s"] > 0
    # SmolLM2-135M on a CPU: its Q4_1 projections as the file's codes (4 bits and a float16 scale and min a
    # group of 32: ~67 MB), the output projection as the tied embedding's Q8_0 blocks (8.5 bits: ~30 MB), the
    # norms: the file's own bytes.
    assert 90e6 < r["weight_bytes_per_step"] < 105e6
    assert r["decode_bandwidth_gb_s"] > 0 and r["peak_memory_mb"] > 0
    # The prefill reads the weights once for its 16 tokens (reported to 0.01 GB/s: ~0.4 here, so abs too).
    once = r["weight_bytes_per_step"] * r["prefill_tokens_per_s"] / 16 / 1e9
    assert r["prefill_bandwidth_gb_s"] == pytest.approx(once, rel=1e-2, abs=5e-3)
    assert r["prefill_bandwidth_pct"] == pytest.approx(100 * once / r["device_bandwidth_gb_s"], rel=2e-2)


def test_bench_random_weights_quantized(capsys):
    args = ["bench", "--random-weights", "tiny", "--quantize", "int4-g32", "--device", "cpu"]
    assert main([*args, "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "random:tiny" and r["quantize"] == "int4-g32"
    assert r["decode_bandwidth_pct"] is not None and r["prefill_bandwidth_pct"] is not None


@pytest.mark.parametrize(
    "scheme, message",
    [
        ("gguf", "quantization 'gguf' keeps a GGUF file's own quantization; random weights have none"),
    ],
)
def test_bench_random_weights_refuses_a_scheme_before_building(scheme, message, capsys):
    # llama-3-8b: a model this machine could not build in float32 (~32 GB); the scheme is refused first.
    assert main(["bench", "--random-weights", "llama-3-8b", "--quantize", scheme, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_random_weights_refuses_a_model_larger_than_memory(monkeypatch, capsys):
    import ember.loading.weights

    # The query of what the device can hold, not the model, is what this replaces: 1 KB free.
    monkeypatch.setattr(ember.loading.weights, "free_memory", lambda device: 1 << 10)
    assert main(["bench", "--random-weights", "tiny", "--device", "cpu", "--dtype", "bfloat16"]) == 1
    err = capsys.readouterr().err
    assert "random-weight tiny needs" in err and "bfloat16 weights but cpu has 0.0 GB available" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_random_model_of_a_tied_shape_shares_the_embedding():
    import torch

    from ember.bench import random_model

    model = random_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M's own count


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_random_model_quantized_as_drawn_equals_quantized_after(scheme):
    import torch

    from ember.bench import random_model
    from ember.quant import quantize_model
    from ember.quant.linear import QuantLinear

    drawn = random_model("tiny", device="cpu", dtype=torch.bfloat16, quantize=scheme)
    layer = drawn.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(drawn.lm_head, QuantLinear)
    assert drawn.quantization["scheme"] == scheme
    after = quantize_model(random_model("tiny", device="cpu", dtype=torch.bfloat16), scheme).state_dict()
    drawn = drawn.state_dict()
    assert drawn.keys() == after.keys()
    assert all(torch.equal(drawn[k], after[k]) for k in after)


def test_bench_random_weights_quantized_counts_the_quantized_size(monkeypatch, capsys):
    import torch

    import ember.loading.weights
    from ember.bench import random_model

    # 90% of tiny's bfloat16 weights: too little for the floats, enough for int8 projections
    floats = sum(p.numel() for p in random_model("tiny", device="cpu", dtype=torch.bfloat16).parameters()) * 2
    monkeypatch.setattr(ember.loading.weights, "free_memory", lambda device: int(floats * 0.9))
    args = ["bench", "--random-weights", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--json"]
    assert (
        main([*args, "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1", "--quantize", "int8"])
        == 0
    )
    capsys.readouterr()
    assert main(args) == 1
    assert "random-weight tiny needs" in capsys.readouterr().err
    monkeypatch.setattr(ember.loading.weights, "free_memory", lambda device: 1 << 10)
    assert main([*args, "--quantize", "int8"]) == 1
    err = capsys.readouterr().err
    assert "random-weight tiny (int8) needs" in err and "Traceback" not in err


def test_bench_one_new_token_reports_no_decode(capsys):
    # The one new token comes from the prefill: no decode step is timed, so there is no decode rate.
    args = ["bench", "--random-weights", "tiny", "--device", "cpu", "--new-tokens", "1"]
    args += ["--prompt-tokens", "2", "--repeats", "1", "--warmup", "0"]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["decode_tokens_per_s"] is None and r["runs"][0]["decode_tokens_per_s"] is None
    assert r["decode_bandwidth_gb_s"] is None and r["decode_bandwidth_pct"] is None
    assert r["prefill_tokens_per_s"] > 0 and r["total_tokens_per_s"] > 0
    assert main(args) == 0
    (decode,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode")]
    assert "n/a" in decode and "tok/s" not in decode


def test_bench_reports_each_phase_from_one_run(monkeypatch, capsys):
    import ember.bench
    from ember.engine.generate import Generator

    prefill_s = iter([1.0, 2.0])  # the two timed runs prefill 4 tokens in 1 s and in 2 s

    class ScriptedPrefill(Generator):
        def generate(self, *args, **kwargs):
            yield from super().generate(*args, **kwargs)
            self.timings.prefill_s = self.timings.first_token_s = next(prefill_s)

    monkeypatch.setattr(ember.bench, "Generator", ScriptedPrefill)
    args = ["bench", "--random-weights", "tiny", "--device", "cpu", "--prompt-tokens", "4"]
    assert main([*args, "--new-tokens", "2", "--repeats", "2", "--warmup", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # One run's figures (of two, the slower): 4 tokens in 2 s, not one run's rate and the other's time.
    assert r["time_to_first_token_s"] == 2.0 and r["prefill_tokens_per_s"] == 2.0
    assert r["runs"][1]["prefill_tokens_per_s"] == 2.0
    assert r["prefill_bandwidth_gb_s"] == round(r["weight_bytes_per_step"] * 2.0 / 4 / 1e9, 2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["MODEL"],
            "--random-weights tiny benchmarks random weights, not a checkpoint; drop the model 'MODEL'",
        ),
        (
            ["--model", "M"],
            "--random-weights tiny benchmarks random weights, not a checkpoint; drop the model 'M'",
        ),
    ],
)
def test_bench_random_weights_refuses_a_model(extra, message, capsys):
    assert main(["bench", "--random-weights", "tiny", "--device", "cpu", "--repeats", "1", *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["bench", "generate", "serve"])
@pytest.mark.parametrize("scheme", ["", "int3"])
def test_a_scheme_that_is_none_of_them_is_a_usage_error_before_any_loading(command, scheme, tmp_path, capsys):
    # An empty scheme ran unquantized before, recording "quantize": "". The directory is no checkpoint:
    # loading it would fail with another message; llama-3-8b random weights would take minutes to build.
    args = {
        "bench": ["bench", "--random-weights", "llama-3-8b"],
        "generate": ["generate", "hi", "--model", str(tmp_path)],
        "serve": ["serve", "--model", str(tmp_path)],
    }[command]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--quantize", scheme])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --quantize: {scheme!r} is not a scheme; expected one of int8, int4" in err


def test_bench_reports_compile_prefill_and_the_resolved_scheme(monkeypatch, capsys):
    import ember.bench
    from ember.engine.generate import Generator

    class Eager(Generator):  # what is reported is under test, not torch.compile (minutes on a CPU)
        def __init__(self, model, **kwargs):
            super().__init__(model, **{**kwargs, "compile": False, "compile_prefill": False})

    monkeypatch.setattr(ember.bench, "Generator", Eager)
    args = ["bench", "--random-weights", "tiny", "--device", "cpu", "--quantize", "int4", "--compile-prefill"]
    assert main([*args, "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["compile_prefill"] is True and r["compile"] is False
    assert r["quantize"] == "int4-g128"


@pytest.mark.parametrize(
    "shape, extra, message",
    [
        (
            "llama-3.2-1b",
            ["--prompt-tokens", "131000", "--new-tokens", "100"],
            "--prompt-tokens 131000 + --new-tokens 100 = 131100 tokens do not fit the context of 131072 "
            "(the model's maximum)",
        ),
        (
            "tiny",
            ["--prompt-tokens", "8", "--new-tokens", "16", "--max-seq-len", "16"],
            "= 24 tokens do not fit the context of 16 (set by --max-seq-len)",
        ),
    ],
)
def test_bench_random_weights_checks_the_context_before_building(monkeypatch, shape, extra, message, capsys):
    import ember.bench
    from ember.errors import EmberError

    def built(*args, **kwargs):
        raise EmberError("the model was built")

    monkeypatch.setattr(ember.bench, "random_model", built)
    assert main(["bench", "--random-weights", shape, "--device", "cpu", *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_says_how_it_decoded_and_reuses_a_compiled_step_unasked(tmp_path, monkeypatch, capsys):
    # On CPU, without --compile, a run decodes eagerly until a --compile run has built the AOTInductor step
    # for the model's shape; then it decodes with that one. --no-compile stays eager.
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    args = ["bench", "--random-weights", "tiny", "--device", "cpu"]
    args += ["--prompt-tokens", "4", "--new-tokens", "3", "--repeats", "1", "--warmup", "0"]

    def bench(*extra: str) -> dict:
        assert main([*args, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode step eager" in out and "hint      --compile builds" in out
    assert main([*args, "--no-compile"]) == 0
    assert "decode step eager" in (out := capsys.readouterr().out) and "hint" not in out
    assert bench()["decode_step"] == "eager" and not list(tmp_path.glob("aoti/*.pt2"))
    compiled = bench("--compile")
    assert compiled["decode_step"] == "aoti" and compiled["compile"] is True
    unasked = bench()
    assert unasked["decode_step"] == "aoti" and unasked["compile"] is True
    assert bench("--no-compile")["decode_step"] == "eager"
