"""The Python API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(...)`.

    llm = ember.LLM("smollm2-135m-instruct")
    out = llm.chat([{"role": "user", "content": "Hi!"}], ember.SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text, out[0].finish_reason)

`generate()` and `chat()` run every prompt through the batching engine (continuous batching, paged KV cache,
prefix caching) that the server uses; `stream()` runs one request on the single-stream generator (static
cache, optionally compiled) and yields text deltas as they become final. Outputs carry `.text`, `.token_ids`, `.finish_reason`
("stop" or "length") and, with `SamplingParams(logprobs=k)`, per-position log-probabilities.

`LLM(..., quantize="int4-g32")` quantizes the weights; the quantized weights are cached on disk so later
starts skip it (`quant_cache=False` turns that off; see `ember.quant.cache`). Without a scheme, a GGUF file's
projections held in blocks Ember's CPU kernels take (Q4_0/Q4_1/Q4_K, Q8_0/Q5_0/Q6_K) stay as the file holds them in
float32 on a CPU (`ember.loading.checkpoint.keeps_codes`: the dequantized model's values); `quantize="none"`
dequantizes every weight.
"""

from __future__ import annotations

import numbers
import operator
import reprlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.engine.core import EngineConfig, EngineCore
from ember.engine.generate import Generator
from ember.engine.output import TextAssembler
from ember.engine.sampler import SamplingParams, make_generator
from ember.errors import EmberError, InvalidParameterError, check_count
from ember.loading.checkpoint import LoadedModel, load
from ember.loading.hub import DEFAULT_MODEL

Message = dict[str, str]
Prompt = str | list[int]

# The usual roles (named in errors); "developer" is OpenAI's newer name of "system".
ROLES = ("system", "developer", "user", "assistant", "tool")


def _params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidParameterError(
            f"params={reprlib.repr(params)} is invalid; expected an ember.SamplingParams"
        )
    return params


def _token_ids(prompt: object) -> list[int] | None:
    """`prompt` as a list of token ids, or None where it is not one: numpy and torch integers are taken,
    floats and bools are not."""
    if not isinstance(prompt, Iterable) or isinstance(prompt, bytes | Mapping):
        return None
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            return None
        try:
            ids.append(operator.index(t))
        except TypeError:
            return None
    return ids


def _numbered(e: EmberError, what: str, i: int, count: int) -> EmberError:
    """`e` with the index of its prompt (or conversation) in front, where the call had several."""
    return e if count == 1 else type(e)(f"{what} {i}: {e}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    # One dict per generated position: token id -> log-probability (the chosen token and the top-k).
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass
class StreamChunk:
    text: str  # the new text made final by this step ("" when held back)
    token_ids: list[int]  # the tokens generated in this step
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


class LLM:
    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_seq_len: int | None = None,
        compile: bool | None = False,
        compile_prefill: bool = False,
        quantize: str | None = None,
        quant_cache: bool = True,
        allow_pickle: bool = False,
        progress: bool = False,
        engine_config: EngineConfig | None = None,
    ) -> None:
        check_count("max_seq_len", max_seq_len, optional=True)
        self.loaded: LoadedModel = load(
            model,
            device=device,
            dtype=dtype,
            allow_pickle=allow_pickle,
            progress=progress,
            quantize=quantize,
            quant_cache=quant_cache,
        )
        cfg = self.loaded.config
        self.context = min(cfg.max_position_embeddings, max_seq_len or cfg.max_position_embeddings)
        self.tokenizer = self.loaded.tokenizer
        self.engine_config = engine_config or EngineConfig()
        self._engine: EngineCore | None = None
        self._run_lock = threading.Lock()
        self.generator = Generator(
            self.loaded.model,
            device=self.loaded.device,
            context=self.context,
            compile=compile,
            compile_prefill=compile_prefill,
        )

    # -- prompts -------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A string, tokenized (with BOS where the model's tokenizer adds it), or a list of token ids as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = _token_ids(prompt)
        if ids is None:
            raise InvalidParameterError(
                f"prompt={reprlib.repr(prompt)} is invalid; expected a string or a list of token ids (integers)"
            )
        return ids

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """One conversation, a list of {"role", "content"} dicts, rendered by the chat template and tokenized.
        Content is a string or a list of {"type": "text", "text"} parts (joined by newlines), and may be None
        for an assistant message (one that only calls tools: an empty turn, as the server renders it);
        "developer" is rendered as "system"; other keys (tool_calls, name, ...) and roles (tool, ...) go to
        the template as they are."""
        if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence):
            raise InvalidParameterError(
                f"messages={reprlib.repr(messages)} is invalid; expected a list of {{'role', 'content'}} dicts"
            )
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise InvalidParameterError(
                    f"messages[{i}]={reprlib.repr(m)} is invalid; expected a {{'role', 'content'}} dict"
                )
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role:
                raise InvalidParameterError(
                    f"messages[{i}]['role']={reprlib.repr(role)} is invalid; expected a role such as "
                    f"{', '.join(ROLES)}"
                )
            if content is None and role == "assistant":  # as the server: a turn that only called tools
                content = ""
            elif isinstance(content, list) and all(
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content
            ):
                content = "\n".join(part["text"] for part in content)
            if not isinstance(content, str):
                raise InvalidParameterError(
                    f"messages[{i}]['content']={reprlib.repr(content)} is invalid; expected a string "
                    "(or a list of {'type': 'text', 'text'} parts)"
                )
            turns.append({**m, "role": "system" if role == "developer" else role, "content": content})
        return self.tokenizer.encode_chat(turns, add_generation_prompt=add_generation_prompt)

    # -- generation ----------------------------------------------------------------------------------------

    def stream_ids(
        self, prompt_ids: list[int], params: SamplingParams | None = None
    ) -> Iterator[StreamChunk]:
        """Streams one completion of already-tokenized `prompt_ids`."""
        params = _params(params)
        if params.n != 1:
            raise InvalidParameterError(
                f"n={params.n} is invalid for a stream, which yields one completion; use generate() for n > 1"
            )
        assembler = TextAssembler(self.tokenizer.stream_decoder(prompt_ids=prompt_ids), params.stop)
        gen = make_generator(params.seed, self.loaded.device)
        for step in self.generator.generate(prompt_ids, params, self.loaded.eos_token_ids, gen):
            finish = step.finish_reason
            # A stop token (EOS or one of stop_token_ids) ends the text; its own text is not shown.
            text = "" if step.finish_reason == "stop" else assembler.push(step.token_id)
            if assembler.stopped:
                finish = "stop"
            if finish:
                text += assembler.finish()
                if assembler.stopped:  # the end's flush completed a stop string
                    finish = "stop"
            logprobs = None
            if params.logprobs is not None:
                entry = dict(step.top_logprobs or [])
                entry[step.token_id] = step.logprob
                logprobs = [entry]
            yield StreamChunk(text=text, token_ids=[step.token_id], finish_reason=finish, logprobs=logprobs)
            if finish:
                return

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        return self.stream_ids(self.encode_prompt(prompt), params)

    def stream_chat(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> Iterator[StreamChunk]:
        return self.stream_ids(self.encode_chat(messages), params)

    def engine(self) -> EngineCore:
        """The batching engine (paged KV cache), created on first use."""
        if self._engine is None:
            self._engine = EngineCore(self.loaded, self.engine_config, context=self.context)
        return self._engine

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[RequestOutput]:
        """Runs every prompt (n samples each) through the batching engine; outputs in prompt order. Calls from
        several threads take turns: they share the engine, its step loop and its request ids."""
        with self._run_lock:
            return self._run_batch(prompts, params)

    def _run_batch(
        self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[RequestOutput]:
        core = self.engine()
        for i, (_, ids) in enumerate(prompts):  # every prompt is checked before any runs
            try:
                core.validate(ids, params)
            except EmberError as e:
                raise _numbered(e, "prompt", i, len(prompts)) from None
        try:
            for i, (_, ids) in enumerate(prompts):
                for j in range(params.n):
                    # With a seed, sample j uses seed + j: n different samples, each reproducible.
                    sub = params if params.seed is None else replace(params, seed=params.seed + j)
                    core.add_request(f"llm-{i}-{j}", ids, sub)
            updates = core.run_to_completion()
        except BaseException:
            # Ctrl-C, or an error inside a step: requests left in the engine would run in the next call and
            # mix their updates into its outputs under the same request ids.
            core.fail_all("interrupted", finish_reason="abort")
            raise
        failed = next((u for steps in updates.values() for u in steps if u.finish_reason == "error"), None)
        if failed is not None:
            raise EmberError(failed.error or "internal error in the engine")
        results = []
        for i, (prompt, ids) in enumerate(prompts):
            out = RequestOutput(prompt=prompt, prompt_token_ids=ids)
            for j in range(params.n):
                steps = updates[f"llm-{i}-{j}"]
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [entry for u in steps for entry in (u.logprobs or [])]
                out.outputs.append(
                    CompletionOutput(
                        index=j,
                        text="".join(u.text for u in steps),
                        token_ids=[t for u in steps for t in u.token_ids],
                        finish_reason=steps[-1].finish_reason or "length",
                        logprobs=logprobs,
                    )
                )
            results.append(out)
        return results

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Completes raw prompts (strings, or token id lists); one RequestOutput per prompt, in order."""
        params = _params(params)
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence):
            raise InvalidParameterError(
                f"prompts={reprlib.repr(prompts)} is invalid; expected a string, a list of token ids, "
                "or a list of those"
            )
        encoded = []
        for i, p in enumerate(prompts):
            try:
                encoded.append((p if isinstance(p, str) else None, self.encode_prompt(p)))  # type: ignore[arg-type]
            except EmberError as e:
                raise _numbered(e, "prompt", i, len(prompts)) from None
        return self._run(encoded, params)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of {"role", "content"} dicts) or several, with the chat template."""
        params = _params(params)
        if not messages:
            raise InvalidParameterError(
                "messages is empty; expected at least one {'role', 'content'} message"
            )
        # Several conversations: a list of lists. Anything else is one, and encode_chat says what is wrong.
        first = messages[0] if isinstance(messages, Sequence) and not isinstance(messages, str) else None
        several = isinstance(first, Sequence) and not isinstance(first, str)
        conversations = messages if several else [messages]
        encoded = []
        for i, c in enumerate(conversations):
            try:
                encoded.append((None, self.encode_chat(c, add_generation_prompt=add_generation_prompt)))  # type: ignore[arg-type]
            except EmberError as e:
                raise _numbered(e, "conversation", i, len(conversations)) from None
        return self._run(encoded, params)
