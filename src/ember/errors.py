"""User-facing errors.

Everything a user can cause (a bad path, a foreign file, an unknown architecture, a prompt that does not fit)
raises an `EmberError` subclass whose message is one line naming the value and what was expected. The CLI
prints that line and exits non-zero; the server maps it to an OpenAI-style 4xx. Internal invariants use
`assert` and are bugs, not user errors.
"""

import numbers


class EmberError(Exception):
    """Base class for errors caused by user input; the message is shown as is."""


class CheckpointError(EmberError):
    """A checkpoint file or directory is missing, truncated, foreign or incomplete."""


class ModelNotFoundError(EmberError):
    """A model name resolves to nothing: not an alias, a local path, a cached repo id or a .gguf file."""


class UnsupportedArchitectureError(EmberError):
    """The checkpoint's architecture has no Ember implementation."""


class ContextLengthError(EmberError):
    """A prompt (plus the tokens asked for) does not fit in the model's context window."""


class NonFiniteLogitsError(EmberError):
    """A model's logits are NaN or inf (activations overflowing float16, or broken weights)."""


def non_finite_logits_message(dtype: object) -> str:
    """What NonFiniteLogitsError says for a model run in `dtype` (a torch.dtype)."""
    dtype = str(dtype).removeprefix("torch.")
    if dtype == "float16":
        return (
            "the logits are not finite (NaN or inf): this model's activations overflow "
            "float16; run it in bfloat16 or float32 (--dtype)"
        )
    return (
        f"the logits are not finite (NaN or inf) in {dtype}: the checkpoint's weights hold "
        "NaN or inf, or overflow this dtype"
    )


class TokenizerError(EmberError):
    """A tokenizer or chat template cannot be loaded or rendered."""


class InvalidParameterError(EmberError, ValueError):
    """A generation parameter is out of range or of the wrong kind."""


def check_count(name: str, value: object, *, optional: bool = False) -> None:
    """Raises InvalidParameterError naming `name` unless `value` is an integer >= 1 (numpy's count, a bool does
    not), or None where `optional`."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidParameterError(
            f"{name}={value!r} is invalid; expected an integer >= 1" + (" or None" if optional else "")
        )
