"""Single-stream generation on a static KV cache: prefill the prompt, then one-token decode steps.

`Generator.generate` yields one `TokenStep` per generated token and knows nothing of text; stop strings and
detokenization live in `ember.engine.output`.

Speed notes (single-stream decode is bound by reading every weight once per step):
- The decode step has static shapes (B=1, T=1, a fixed cache), so `compile=True` compiles it once per cache
  length (caches grow in steps of CACHE_ROUNDING) and keeps the compiled callable on this object, over a code
  object of its own (`_compile_steps` says why). On CUDA the compiled step is captured in a CUDA graph of
  Ember's own (`DecodeGraph`), which also advances the position and, for plain greedy decoding, writes the
  argmax back as the next step's input: a step is one replay.
  On CPU it is an AOTInductor package (`ember.engine.aoti`: C++ from end to end, no guards, compiled once
  per model shape and cached on disk); if that cannot be built, torch.compile's step, with a log line
  saying why. EMBER_AOTI=0 chooses torch.compile. With `compile=None` (the CLI's default) a CPU generator
  decodes with that package where an earlier run built one for this model's shape (loaded in milliseconds;
  2.6x the eager step's tokens/s for SmolLM2 int4-g32), and eagerly where none was: it never starts the
  minutes of compiling unasked. `compile_prefill=True` compiles the prefill with dynamic
  shapes, so prompts of new lengths do not recompile. On CUDA that prefill also runs as a CUDA graph, one per
  `prefill_length` (the prompt padded at its end: causal attention keeps the padding out of the prompt's
  positions, and the slots it writes lie past the prompt, each written again by its own decode step before
  any query reads it); a prefill of a few hundred kernels was half launch cost (Llama-3-8B int8, 128 tokens,
  H200: time to first token 22.1 -> 10.7 ms).
- The next step is queued before the host waits for this step's token: the token is copied to pinned memory
  behind an event, so the GPU never idles while Python streams a token. The one sync per token is that event.
- Greedy requests without penalties take the argmax of the logits; nothing else runs per step.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ember.engine.cpu_step import EagerCpuStep
from ember.engine.inductor_compat import cheap_fallback_messages
from ember.engine.kv_cache import StaticKVCache
from ember.engine.sampler import SamplingParams, SamplingTensors, apply_penalties, make_generator, sample
from ember.errors import (
    ContextLengthError,
    EmberError,
    InvalidParameterError,
    NonFiniteLogitsError,
    non_finite_logits_message,
)
from ember.models.decoder import Decoder
from ember.ops.argmax import argmax

log = logging.getLogger(__name__)

CACHE_ROUNDING = 256  # cache lengths are rounded up so that similar requests reuse one cache (and one graph)

StepFn = Callable[[torch.Tensor, torch.Tensor, StaticKVCache], torch.Tensor]

# Whether compiled CUDA decoding replays Ember's own graph (`DecodeGraph`) rather than torch.compile's
# "reduce-overhead" one: same tokens; GPU time a step 0.0-0.7% less for Llama-3-8B, host time a step 3-4 us
# against 300-480 (BENCHMARKS.md, twenty-seventh session).
OWN_GRAPH = True


def prefill_length(tokens: int, slots: int) -> int:
    """The length a padded prefill of `tokens` runs at: a multiple of 16, or above 128 tokens of an eighth of
    the next power of two (4 lengths an octave, under 25% padding); never past the cache's `slots`."""
    step = max(16, 1 << max(tokens - 1, 1).bit_length() >> 3)
    return max(tokens, min(slots, -(-tokens // step) * step))


@dataclass
class TokenStep:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (EOS or stop token) or "length"; None while generating


@dataclass
class Timings:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first sampled token
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_steps(self) -> int:
        # The first token comes from the prefill; each later one costs one decode step.
        return max(self.generated_tokens - 1, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0


def check_fits(prompt_tokens: int, max_tokens: int | None, context: int, *, name: str = "max_tokens=") -> int:
    """Returns how many tokens may be generated; raises ContextLengthError naming the counts when none fit
    (InvalidParameterError for an empty prompt). `name` spells max_tokens as the caller's user knows it."""
    if prompt_tokens == 0:
        raise InvalidParameterError("the prompt is empty; at least one token is needed")
    if prompt_tokens >= context:
        raise ContextLengthError(f"prompt has {prompt_tokens} tokens but the context holds {context}")
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise ContextLengthError(
            f"prompt has {prompt_tokens} tokens and {name}{max_tokens}, "
            f"but the context holds {context} ({context - prompt_tokens} tokens left)"
        )
    return max_tokens


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """Raises InvalidParameterError naming the first prompt token id outside [0, vocab_size): a tokenizer with
    more tokens than the model's embedding, or ids given as they are."""
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameterError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def _own_code(method: Callable) -> Callable:
    """A bound method over a copy of its function's code object: torch.compile's cache (its graphs, and the
    recompiles counted against its limit) lives on the code object, so this one starts empty and goes with it."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(g, method.__self__)


def _built_aoti(model, dtype: torch.dtype) -> bool:
    """Whether an AOTInductor decode step for `model`'s shape over `dtype` caches lies built on disk."""
    from ember.engine.aoti import package_path

    try:
        return package_path(model, dtype).is_file()
    except Exception as e:  # a model the package key cannot describe decodes eagerly, as it would have
        log.debug("no compiled decode step looked up: %s", e)
        return False


def _plain(params: SamplingParams) -> bool:
    """True when no penalty or bias changes the logits, so apply_penalties can be skipped."""
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
    )


class _TokenReader:
    """Reads a device token on the host without draining the queue: copy to pinned memory, wait on an event."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self.event = torch.cuda.Event()

    def start(self, token: torch.Tensor) -> None:
        if self.cuda:
            self.host.copy_(token.view(1), non_blocking=True)
            self.event.record()
        else:
            self.token = token

    def read(self) -> int:
        if self.cuda:
            self.event.synchronize()
            return int(self.host[0])
        return int(self.token)


class CaptureError(RuntimeError):
    """The decode step could not be captured in a CUDA graph (it syncs with the host, say)."""


class DecodeGraph:
    """The compiled decode step of one cache as CUDA graphs of Ember's own, over inputs at fixed addresses.

    torch.compile's "reduce-overhead" replays a CUDA graph too, but its host path a step (guards over every
    weight, the graph tree's checks of its inputs' addresses) took 0.3-0.75 ms of host time for Llama-3-8B
    (H100, H200), over a third of an int4 step's GPU time, and around each replay the GPU ran four small
    kernels outside the graph (the token copied in, the argmax, the position advanced). Here a step is one
    replay, 3-4 us of host time: the graph reads `token` and `positions`, advances `positions`, and, for plain
    greedy decoding, writes the argmax into `token`, so the next replay takes it from there.

    Two graphs at most, made on first use and sharing one memory pool (they never run at once): `logits`
    (the step's logits, for a sampler on the host side) and `greedy` (the next token).
    """

    def __init__(self, step: StepFn, cache: StaticKVCache, device: torch.device) -> None:
        self.step = step
        self.cache = cache
        self.token = torch.zeros(1, dtype=torch.int64, device=device)  # (B,)
        self.positions = torch.zeros(1, 1, dtype=torch.int64, device=device)  # (B, T)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run(self, greedy: bool) -> torch.Tensor:
        """One step at `positions` (then advanced) from `token`: greedy, the next token (`token` itself, (B,));
        else the logits (B, V), valid until the next replay."""
        if greedy not in self.graphs:
            self.graphs[greedy] = self._capture(greedy)
        graph, out = self.graphs[greedy]
        graph.replay()
        return out

    def _logits(self) -> torch.Tensor:
        return self.step(self.token.view(1, 1), self.positions, self.cache)

    def _capture(self, greedy: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs first, outside the capture: the first call compiles, and Ember's kernels time their block
        # shapes on it. Each runs this very step (the inputs are the replay's), so the keys and values it writes
        # are the ones the replay writes again; it neither advances the position nor changes the token.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                argmax(self._logits())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a server's other threads may use CUDA while the engine thread captures.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._logits()
                self.positions.add_(1)  # recorded, not run: a failed capture leaves the position as it was
                if greedy:
                    self.token.copy_(argmax(out))
                    out = self.token
        except Exception as e:  # whatever the step does that a graph cannot hold (a host sync, a CPU op)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CaptureError(f"{type(e).__name__}: {first}") from e
        return graph, out


class Generator:
    def __init__(
        self,
        model: Decoder,
        *,
        device: torch.device,
        context: int,
        compile: bool | None = False,
        compile_prefill: bool = False,
    ) -> None:
        """compile: True compiles the decode step; False decodes eagerly; None (CPU) decodes with the step an
        earlier run compiled for this model's shape where there is one, else eagerly."""
        self.model = model
        self.device = device
        self.context = context
        table = getattr(model.model.embed_tokens, "weight", None)  # none: looked up in kept codes
        self.dtype = table.dtype if table is not None else model.model.embed_tokens.dtype
        if not self.dtype.is_floating_point:  # a quantized embedding: activations follow the norms
            self.dtype = model.model.norm.weight.dtype
        self.cache: StaticKVCache | None = None
        self._owner: object | None = None  # the generation that holds the cache (see `generate`)
        self.compiled = bool(compile)
        self.compiled_prefill = compile_prefill
        self._prefill_graphs = compile_prefill and device.type == "cuda"  # one CUDA graph per padded length
        # Prefill at `prefill_length`s (see the module note); settable, so tests can check padding on a CPU.
        # Not where the rope reads the sequence's length from its positions (longrope, dynamic): the padding's
        # positions would count.
        rope_types = {model.config.rope.rope_type} | {getattr(model.config.local_rope, "rope_type", None)}
        self.pad_prefill = self._prefill_graphs and not rope_types & {"longrope", "dynamic"}
        # CPU decode tries the AOTInductor step when the first cache is made (see _cache_for).
        self._try_aoti = (
            device.type == "cpu"
            and os.environ.get("EMBER_AOTI", "1") != "0"
            and (compile or (compile is None and _built_aoti(model, self.dtype)))
        )
        self._decode: StepFn = self._forward
        self._prefill: Callable[..., torch.Tensor] = self._forward_at
        self._aoti = False  # whether `_decode` is the AOTInductor step
        # CUDA decode replays a graph of Ember's own (made per cache in `_cache_for`).
        self._own_graph = compile and device.type == "cuda" and OWN_GRAPH
        self._graph: DecodeGraph | None = None
        if compile or compile_prefill:
            cheap_fallback_messages()  # older inductors format a message that can take minutes
        self.timings = Timings()

    def _compile_steps(self) -> None:
        """torch.compile's steps for the cache just made, each over a code object of its own (`_own_code`).

        torch.compile keeps its graphs, and counts recompiles against a limit (8; past it, with fullgraph, an
        error), per code object. A static cache length is part of the decode graph, so steps shared by every
        generator of the process would fail at the ninth cache length or the ninth model; compiled afresh for
        each cache, a step holds the graphs of one, and drops them with it.
        """
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        if self.compiled and not self._aoti:
            self._compile_decode()
        if self.compiled_prefill:
            # Only the token dimension varies (marked dynamic per call); head counts stay static ints. On CUDA
            # a CUDA graph per padded length.
            self._prefill = torch.compile(
                _own_code(self._forward_at), mode=mode, fullgraph=True, dynamic=None
            )

    def _compile_decode(self) -> None:
        # CUDA graphs remove the launch overhead of a few hundred small kernels per step (Ember's own
        # `DecodeGraph`, or torch.compile's "reduce-overhead"); on CPU inductor's C++ kernels fuse the
        # elementwise work between the matmuls.
        mode = "reduce-overhead" if self.device.type == "cuda" and not self._own_graph else None
        self._decode = torch.compile(_own_code(self._forward), mode=mode, fullgraph=True, dynamic=False)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens and positions (B, T) -> float32 logits of the last position (B, V)."""
        hidden = self.model(tokens, positions, cache)
        return self.model.compute_logits(hidden[:, -1])  # (B, V)

    def _forward_at(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, last: torch.Tensor
    ) -> torch.Tensor:
        """`_forward`, with the logits of position `last` (1,) (a padded prefill's last prompt token)."""
        hidden = self.model(tokens, positions, cache)
        return self.model.compute_logits(hidden.index_select(1, last)[:, 0])  # (B, V)

    def _cache_for(self, length: int) -> StaticKVCache:
        size = min(self.context, -(-length // CACHE_ROUNDING) * CACHE_ROUNDING)
        if self.cache is None or self.cache.max_seq_len < size:
            self.cache = StaticKVCache(
                self.model.config,
                batch_size=1,
                max_seq_len=size,
                device=self.device,
                dtype=self.dtype,
                prompts_from_start=True,  # `_run_prefill` runs whole prompts from position 0
            )
            if (self.compiled and self.device.type == "cuda") or self._prefill_graphs:
                # Static addresses let torch.compile's CUDA graphs write the cache in place instead of copying it.
                for t in self.cache.k + self.cache.v:
                    torch._dynamo.mark_static_address(t)
            if self._try_aoti:
                self._try_aoti = False  # one package serves every cache length: build or load it once
                self._use_aoti(self.cache)
            self._graph = None  # the old cache's graphs go with it
            self._compile_steps()
            if self.device.type == "cpu" and not self.compiled and not self._aoti:
                # the eager step as a flat run of kernel calls, where the model is one it runs
                self._decode = EagerCpuStep.build(self.model, self.cache) or self._forward
            if self._own_graph:
                self._graph = DecodeGraph(self._decode, self.cache, self.device)
        return self.cache

    def _use_aoti(self, cache: StaticKVCache) -> None:
        """Decodes with the AOTInductor step if it builds here; keeps torch.compile's step (and says why) if not."""
        from ember.engine.aoti import load_decode_step

        try:
            # Built only when asked to compile; without the flag, a package an earlier run built, if it loads.
            self._decode = load_decode_step(self.model, cache, build=self.compiled)
            self._aoti = True
        except Exception as e:  # export, inductor and the C++ compiler fail in many ways; each is logged
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            how = "torch.compile" if self.compiled else "the eager step"
            log.warning("AOTInductor decode step unavailable (%s); decoding with %s", reason, how)

    @property
    def decode_step(self) -> str:
        """How this generator decodes: "aoti" (the AOTInductor package), "torch.compile" or "eager"."""
        return "aoti" if self._aoti else "torch.compile" if self.compiled else "eager"

    def _run_prefill(self, prompt: list[int], cache: StaticKVCache) -> torch.Tensor:
        """The logits (1, V) after the prompt, its K/V in the cache."""
        T = len(prompt)
        length = prefill_length(T, cache.max_seq_len) if self.pad_prefill else T
        tokens = torch.tensor([prompt + [0] * (length - T)], device=self.device)  # (1, length)
        positions = torch.arange(length, device=self.device)[None]  # (1, length)
        if self.compiled_prefill and length > 1:  # size-1 dims are specialised
            torch._dynamo.mark_dynamic(tokens, 1)
            torch._dynamo.mark_dynamic(positions, 1)
        if self._prefill_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are consumed
        return self._prefill(tokens, positions, cache, torch.tensor([T - 1], device=self.device))

    def _run_decode(self, token: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        if self.compiled and self.device.type == "cuda":  # torch.compile's graph (OWN_GRAPH off)
            # Each replay reuses the graph's output memory; we are done with the previous logits by now.
            torch.compiler.cudagraph_mark_step_begin()
        return self._decode(token.view(1, 1), positions, cache)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        eos_ids: tuple[int, ...],
        generator: torch.Generator | None,
    ) -> Iterator[TokenStep]:
        budget = check_fits(len(prompt), params.max_tokens, self.context)
        V = self.model.config.vocab_size
        check_prompt_ids(prompt, V)
        cache = self._cache_for(len(prompt) + budget)
        st = SamplingTensors.build([params], V, self.device)
        gen = generator if generator is not None else make_generator(params.seed, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        plain = _plain(params)
        # Plain greedy decoding without log-probabilities: the decode graph picks the token itself.
        in_graph = plain and params.greedy and params.logprobs is None
        seen = counts = None
        if not plain:
            seen = torch.zeros(1, V, dtype=torch.bool, device=self.device)
            seen[0, torch.tensor(prompt, device=self.device).clamp(0, V - 1)] = True
            counts = torch.zeros(1, V, dtype=torch.int32, device=self.device)
        timings = self.timings = Timings(prompt_tokens=len(prompt))
        reader = _TokenReader(self.device)
        # Every generation writes the one cache: a generation started while this one is suspended at a yield
        # (two LLM.stream iterators advanced in turn) overwrites its keys and values, so this one stops.
        owner = self._owner = object()

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
            """logits (1, V) -> token (1,) on the device, and (log-probs, top-k) when asked for; no sync."""
            processed = logits if plain else apply_penalties(logits, st, seen, counts)
            token = argmax(processed) if params.greedy else sample(processed, st, [gen])
            if params.logprobs is None:
                return token, None
            logp = torch.log_softmax(logits[0], dim=-1)
            return token, (logp, logp.topk(params.logprobs) if params.logprobs else None)

        start = time.perf_counter()
        logits = self._run_prefill(prompt, cache)
        finite = torch.isfinite(logits).all()  # read with the first token (no sync of its own)
        token, extra = pick(logits)
        if self._graph is not None:
            step_pos = self._graph.positions.fill_(len(prompt))  # (1, 1), advanced by each replay
        else:
            step_pos = torch.tensor([[len(prompt)]], device=self.device)  # (1, 1), advanced in place
        decode_start = start
        # On CUDA the next step is queued before waiting for this token; on CPU there is nothing to overlap,
        # so the token is read first and the time to first token holds no decode step.
        overlap = self.device.type == "cuda"
        for i in range(budget):
            reader.start(token)
            more = i < budget - 1
            if overlap and more:  # if token i ends the request, the queued step is wasted
                next_token, next_extra = self._step(pick, token, step_pos, cache, seen, counts, in_graph)
            token_id = reader.read()  # the one host sync per step: the caller needs the token to stream it
            now = time.perf_counter()
            if i == 0:
                if not bool(finite):
                    raise NonFiniteLogitsError(non_finite_logits_message(self.dtype))
                timings.prefill_s = timings.first_token_s = now - start
                decode_start = now
            step = TokenStep(token_id)
            if extra is not None:
                logp, top = extra
                step.logprob = float(logp[token_id])
                if top is not None:
                    step.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            timings.generated_tokens = i + 1
            if token_id in stops:
                step.finish_reason = "stop"
            elif not more:
                step.finish_reason = "length"
            timings.decode_s = now - decode_start
            yield step
            if step.finish_reason:
                return
            if self._owner is not owner:
                raise EmberError(
                    "another generation started on this model before this one finished; they share one KV "
                    "cache, so finish (or close) one stream before starting the next"
                )
            if not overlap:
                next_token, next_extra = self._step(pick, token, step_pos, cache, seen, counts, in_graph)
            token, extra = next_token, next_extra

    def _step(
        self,
        pick: Callable[[torch.Tensor], tuple],
        token: torch.Tensor,
        step_pos: torch.Tensor,
        cache: StaticKVCache,
        seen: torch.Tensor | None,
        counts: torch.Tensor | None,
        in_graph: bool,
    ) -> tuple:
        """Records `token` as seen, runs one decode step at `step_pos` and picks the next token (in the decode
        graph where `in_graph` and there is one); no sync."""
        if seen is not None and counts is not None:
            seen[0].index_fill_(0, token, True)
            counts[0].index_add_(0, token, torch.ones_like(token, dtype=torch.int32))
        graph = self._graph
        if graph is not None:
            if token is not graph.token:  # the prefill's token, or one picked outside the graph
                graph.token.copy_(token)
            try:
                return (graph.run(greedy=True), None) if in_graph else pick(graph.run(greedy=False))
            except CaptureError as e:  # torch.compile's graphs run what they can and the rest eagerly
                log.warning("decode step not captured in a CUDA graph (%s); using torch.compile's graphs", e)
                self._graph, self._own_graph = None, False
                self._compile_decode()
        out = pick(self._run_decode(token, step_pos, cache))
        step_pos += 1
        return out
