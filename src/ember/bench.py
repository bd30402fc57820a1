"""Measures single-stream prefill and decode: tokens/s, time to first token, achieved weight bandwidth, memory.

Decoding one stream reads every weight once per step, so the figure that says how close a run is to the
hardware is the achieved bandwidth: bytes of weights read per step x decode steps / decode time, against the
device's measured copy bandwidth (bytes read + written by a large device copy). The weights read per step are
every parameter and quantized buffer except the embedding table, of which a step reads one row (unless the
table is tied to the output projection, which reads all of it). The prefill's figure is the same bytes read
once for the whole prompt over the prefill time: it shows how far a compute-bound prefill is from that limit.

`random_model` builds a real architecture's shape with random weights (`RANDOM_SHAPES`), so GPU benchmarks
need no download. Everything here is plain functions; `ember bench` (cli/bench.py) prints what they return.
"""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import asdict, dataclass, field

import torch

from ember.config import ModelConfig
from ember.engine.generate import Generator, check_fits
from ember.engine.sampler import SamplingParams
from ember.errors import EmberError, InvalidParameterError
from ember.models.decoder import Decoder

# Hugging Face config.json fields of real models, for random-weight benchmarks.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
RANDOM_SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # For tests: a few layers, a few seconds on one core.
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def random_config(shape: str) -> ModelConfig:
    """The config of a key of RANDOM_SHAPES; an EmberError naming the shapes for any other."""
    from ember.models import config_from_hf

    if shape not in RANDOM_SHAPES:
        raise EmberError(
            f"random-weight shape {shape!r} is unknown; expected one of {', '.join(RANDOM_SHAPES)}"
        )
    return config_from_hf(RANDOM_SHAPES[shape])


@torch.no_grad()
def random_model(
    shape: str, *, device: torch.device | str, dtype: torch.dtype, seed: int = 0, quantize: str | None = None
) -> Decoder:
    """A Decoder of a real model's shape (a key of RANDOM_SHAPES) with N(0, 0.02) weights and unit norms.

    With `quantize` (a scheme, as `ember.quant.quantize_model` takes it) the model is quantized, each projection
    as soon as its weights are drawn, so the float model never exists whole (Llama-3-8B, bfloat16, int4 on CPU:
    a peak of 11.5 GB, against 16.6 quantized after drawing); the same model as `quantize_model` of the float
    one."""
    from ember.loading.weights import check_memory

    cfg = random_config(shape)
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)  # sizes only: nothing is allocated yet, and never in float32 first
    spec, targets, need = None, set(), None
    if quantize:
        from ember.quant import QuantSpec, check_fits

        spec = QuantSpec.parse(quantize)
        targets = set(check_fits(model, spec))  # a group size that does not fit is refused before drawing
        sizes = [model.get_submodule(n).weight.numel() for n in targets]
        # int4: the canonical codes and float32 scale + min, and the kernel's copy of both (`prepare`)
        per_weight = 1.0 if spec.scheme != "int4" else 1.0 + 12 / spec.group_size
        rest = sum(p.numel() for p in model.parameters()) - sum(sizes)
        need = int(rest * dtype.itemsize + sum(sizes) * per_weight + max(sizes) * dtype.itemsize)
    check_memory(
        model,
        dtype,
        device,
        f"random-weight {shape}" + (f" ({quantize})" if quantize else ""),
        "--dtype bfloat16, --device cuda, or a smaller shape",
        need,
    )
    for name, module in model.named_modules():
        if name not in targets:
            module.to_empty(device=device, recurse=False)
    model.tie_weights()  # to_empty gives every module a tensor of its own, a tied head included
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(p: torch.Tensor) -> torch.Tensor:  # in the order of named_parameters, swapped or not
        out = torch.empty(p.shape, device=device, dtype=p.dtype) if p.is_meta else p
        return out.normal_(0.0, 0.02, generator=gen)

    for name, p in list(model.named_parameters()):
        module, _, leaf = name.rpartition(".")
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif module not in targets:
            draw(p.data)
        elif leaf == "weight":  # a projection's bias, if any, is next in this order: drawn with it
            bias = model.get_submodule(module).bias
            weight = draw(p)  # drawn before its bias, as named_parameters lists them
            quantized = spec.quantize(weight, None if bias is None else draw(bias))
            parent, _, child = module.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)
    model.init_buffers(device)
    model.eval().requires_grad_(False)
    if quantize:  # the output projection; the projections drawn quantized are kept
        from ember.quant import quantize_model

        quantize_model(model, quantize)
    if torch.device(device).type == "cpu":  # as a loaded model's (`ember.loading.checkpoint.load`)
        from ember import huge_pages

        huge_pages.into(model)
    return model


def weight_bytes_per_step(model: Decoder) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer the kernels read, once.

    The embedding table counts only when it is also the output projection (one row is read otherwise);
    a quantized module counts the buffers its kernel reads (`QuantLinear.bytes_read`), not its saved form.
    """
    from ember.quant.linear import QuantLinear, outer_quantized

    embed = model.model.embed_tokens
    head_is_embedding = model.config.tie_word_embeddings and not isinstance(model.lm_head, QuantLinear)
    total, seen = sum(m.bytes_read() for m in outer_quantized(model)), set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        if module is embed and not head_is_embedding:
            continue
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t.data_ptr() in seen:  # a tied output projection is the embedding tensor: read once
                continue
            seen.add(t.data_ptr())
            if t.dtype.is_floating_point and t.dim() >= 1 and t.numel() > 1:
                total += t.numel() * t.element_size()
    return total


def copy_bandwidth(device: torch.device, *, nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes per second (read + written) of a large device-to-device copy: the ceiling a decode step sees."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.randn(nbytes // 4, device=device)  # random data: zeros can copy faster than real weights
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / _median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


def _median_run(runs: list[dict], rate: str) -> dict:
    """The run whose `rate` is the median; of an even count, the slower of the two middle runs (a figure
    never flatters)."""
    return sorted(runs, key=lambda r: r[rate])[(len(runs) - 1) // 2]


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    quantize: str | None  # the resolved scheme ("int4-g128" for "int4")
    compile: bool  # whether the decode step ran compiled (see decode_step)
    compile_prefill: bool
    threads: int
    prompt_tokens: int
    new_tokens: int
    repeats: int
    weight_bytes_per_step: int
    prefill_tokens_per_s: float
    time_to_first_token_s: float
    # None when no decode step ran: with new_tokens=1 the only token comes from the prefill.
    decode_tokens_per_s: float | None
    total_tokens_per_s: float  # new tokens over the whole call (prefill included), as peers often report
    decode_bandwidth_gb_s: float | None
    device_bandwidth_gb_s: float | None
    decode_bandwidth_pct: float | None
    peak_memory_mb: float
    # The prefill reads the weights once for the whole prompt: far below the limit where it is compute-bound.
    prefill_bandwidth_gb_s: float = 0.0
    prefill_bandwidth_pct: float | None = None
    runs: list[dict] = field(default_factory=list)
    decode_step: str = "eager"  # "aoti", "torch.compile" or "eager" (`Generator.decode_step`)

    def to_dict(self) -> dict:
        return asdict(self)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the process's peak resident set, weights and activations included.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(
    model: Decoder,
    *,
    name: str,
    device: torch.device,
    prompt_tokens: int = 128,
    new_tokens: int = 256,
    repeats: int = 3,
    warmup: int = 1,
    compile: bool | None = False,
    compile_prefill: bool = False,
    quantize: str | None = None,
    measure_device: bool = True,
    seed: int = 0,
    max_seq_len: int | None = None,
) -> BenchResult:
    """Generates `new_tokens` greedily after a random `prompt_tokens` prompt, `warmup` + `repeats` times.

    Reports, for each phase, the timed run with the median time (see `_median_run`). EOS is ignored so every
    run generates exactly `new_tokens`; the first comes from the prefill, so new_tokens=1 times no decode step
    and reports None for decode. The prompt and the new tokens must fit in the model's context (capped by
    `max_seq_len`). `quantize` names the scheme the model was quantized with (reported resolved: "int4"
    as "int4-g128").
    """
    if min(prompt_tokens, new_tokens, repeats) < 1 or warmup < 0:
        raise InvalidParameterError(
            f"prompt_tokens={prompt_tokens}, new_tokens={new_tokens}, repeats={repeats}, warmup={warmup}: "
            "expected at least 1 of each (warmup at least 0)"
        )
    if quantize is not None:
        from ember.quant import QuantSpec

        quantize = QuantSpec.parse(quantize).name
    check_fits(prompt_tokens, new_tokens, bench_context(model.config, max_seq_len))
    context = prompt_tokens + new_tokens
    gen = Generator(model, device=device, context=context, compile=compile, compile_prefill=compile_prefill)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in gen.generate(prompt, params, (), None):
            pass
        _sync(device)
        total = time.perf_counter() - start
        t = gen.timings
        if i >= warmup:
            runs.append(
                dict(
                    prefill_tokens_per_s=t.prefill_tokens_per_s,
                    time_to_first_token_s=t.first_token_s,
                    decode_tokens_per_s=t.decode_tokens_per_s if t.decode_steps else None,
                    total_tokens_per_s=new_tokens / total,
                )
            )
    # Every figure of a phase comes from one run, the phase's median: a median taken per figure would pair,
    # with an even count of runs, one run's time to first token with another's prefill rate.
    prefill = _median_run(runs, "prefill_tokens_per_s")
    decode = _median_run(runs, "decode_tokens_per_s")["decode_tokens_per_s"] if new_tokens > 1 else None
    total = _median_run(runs, "total_tokens_per_s")["total_tokens_per_s"]
    wbytes = weight_bytes_per_step(model)
    achieved = wbytes * decode / 1e9 if decode is not None else None
    prefill_achieved = wbytes * prefill["prefill_tokens_per_s"] / prompt_tokens / 1e9  # one pass per prompt
    limit = copy_bandwidth(device) / 1e9 if measure_device else None
    peak = peak_memory_mb(device)
    step = gen.decode_step
    del gen
    gc.collect()
    return BenchResult(
        model=name,
        device=str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        dtype=str(_activation_dtype(model)).removeprefix("torch."),
        quantize=quantize,
        compile=step != "eager",
        compile_prefill=compile_prefill,
        threads=torch.get_num_threads(),
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        weight_bytes_per_step=wbytes,
        prefill_tokens_per_s=round(prefill["prefill_tokens_per_s"], 2),
        time_to_first_token_s=round(prefill["time_to_first_token_s"], 5),
        decode_tokens_per_s=round(decode, 2) if decode is not None else None,
        total_tokens_per_s=round(total, 2),
        decode_bandwidth_gb_s=round(achieved, 2) if achieved is not None else None,
        device_bandwidth_gb_s=round(limit, 1) if limit else None,
        decode_bandwidth_pct=round(100 * achieved / limit, 1) if limit and achieved is not None else None,
        peak_memory_mb=round(peak, 1),
        prefill_bandwidth_gb_s=round(prefill_achieved, 2),
        prefill_bandwidth_pct=round(100 * prefill_achieved / limit, 1) if limit else None,
        runs=runs,
        decode_step=step,
    )


def bench_context(config: ModelConfig, max_seq_len: int | None = None) -> int:
    """The most tokens (prompt and new) a bench run may use: the model's context, capped by max_seq_len."""
    limit = config.max_position_embeddings
    return min(limit, max_seq_len) if max_seq_len is not None else limit


def _activation_dtype(model: Decoder) -> torch.dtype:
    return model.model.norm.weight.dtype
