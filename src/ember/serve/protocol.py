"""OpenAI's request and response bodies as pydantic models, in OpenAI's field order.

Requests are strict: `extra="forbid"` turns a parameter we do not know into a 400 that names it, and the
parameters OpenAI has but Ember does not implement (tools, response_format, audio, ...) are listed in
`UNSUPPORTED` and refused by name unless they carry their no-op value (null, `[]`, `false`, ...), which some
clients always send; so are the message fields in `MESSAGE_UNSUPPORTED` (the SDK sends its assistant message
back with `"refusal": null, "tool_calls": null, ...`). An explicit null is the default, as in OpenAI's API,
also where the default is not null (`"n": null` is n=1). Ember's own sampling extensions (top_k, min_p,
repetition_penalty) sit in a fenced block at the end of each request model. Ranges follow OpenAI's
documentation; the engine checks them again.

Responses are dumped with every field, nulls included, because OpenAI's bodies carry their nulls
(`"logprobs": null`, `"finish_reason": null`) and some clients index them.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# Parameters OpenAI defines that Ember does not implement, with the values that change nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "function_call": (None, "none"),
    "functions": (None, []),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "parallel_tool_calls": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "tool_choice": (None, "none"),
    "tools": (None, []),
    "web_search_options": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    # /v1/completions
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}

# Fields of a chat message that Ember does not implement, with their no-op values.
MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "annotations": (None, []),
    "audio": (None,),
    "function_call": (None,),
    "refusal": (None,),
    "tool_calls": (None, []),
}


class UnsupportedParameterError(ValueError):
    """A known OpenAI parameter that Ember does not implement, with a value that would change the output."""

    def __init__(self, param: str) -> None:
        super().__init__(f"{param} is not supported by Ember; leave it unset")
        self.param = param


class _Strict(BaseModel):
    # strict: "5" is not an integer and 1 is not a boolean, as in OpenAI's API.
    model_config = ConfigDict(extra="forbid", strict=True)
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, noops in cls.unsupported.items():
                if name in data and not any(data[name] == v for v in noops):
                    raise UnsupportedParameterError(name)
            # A no-op value of an unsupported parameter is dropped, so extra="forbid" does not reject it, and
            # so is a null for an optional field whose type has no null: the field takes its default.
            data = {
                k: v
                for k, v in data.items()
                if k not in cls.unsupported and not (v is None and k in _null_is_default(cls))
            }
        return data


@lru_cache
def _null_is_default(cls: type[BaseModel]) -> frozenset[str]:
    """The optional fields of `cls` whose type does not take null (`n: int = 1`, not `seed: int | None`)."""
    return frozenset(
        name
        for name, f in cls.model_fields.items()
        if not f.is_required() and type(None) not in get_args(f.annotation)
    )


# The parameters both request models share, typed once; each model still lists its fields in OpenAI's order
# (not a shared base class), because pydantic validates in field order and the first error is the one reported.
AtLeastOne = Annotated[int, Field(ge=1)]  # n, max_tokens, max_completion_tokens
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Stop = str | list[str]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
# Ember's extensions
TopK = Annotated[int, Field(ge=-1)]  # 0 or -1: off
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]


class StreamOptions(_Strict):
    include_usage: bool = False


# ------------------------------------------------------------------------------------------------ requests


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    unsupported = MESSAGE_UNSUPPORTED

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_assistant_content(cls, data: Any) -> Any:
        # OpenAI lets an assistant message leave out its content or send null (it then holds only tool calls,
        # which Ember refuses anyway): it is an empty turn.
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("content") is None:
            data = {**data, "content": ""}
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Strict):
    unsupported = UNSUPPORTED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    logprobs: bool = False
    max_completion_tokens: AtLeastOne | None = None
    max_tokens: AtLeastOne | None = None  # deprecated by OpenAI for max_completion_tokens
    n: AtLeastOne = 1
    presence_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: TopP | None = None
    user: str | None = None
    # --- Ember extensions (vLLM's names; not in OpenAI's API) ---------------------------------------------
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False  # generate max_tokens even past EOS (benchmarks)
    # ------------------------------------------------------------------------------------------------------


class CompletionRequest(_Strict):
    unsupported = UNSUPPORTED

    model: str
    # A string, a batch of strings, one tokenized prompt, or a batch of tokenized prompts.
    prompt: str | Annotated[list[str], Field(min_length=1)] | list[int] | list[list[int]]
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: AtLeastOne | None = 16  # OpenAI's default for completions
    n: AtLeastOne = 1
    presence_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    # --- Ember extensions (vLLM's names; not in OpenAI's API) ---------------------------------------------
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False  # generate max_tokens even past EOS (benchmarks)
    # ------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    # OpenAI sends only the fields a delta changes: `{"content": "Hi"}`, and `{}` with the finish_reason.
    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole answer and, with stream=True, each chunk: OpenAI uses one shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
