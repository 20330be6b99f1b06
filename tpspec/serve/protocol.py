"""OpenAI request bodies and how they become :class:`~tpspec.SamplingParams`.

Fields follow the OpenAI API (``response_format`` and ``logit_bias`` included), plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``structured_outputs``,
``allowed_token_ids``, ``bad_words``; see :mod:`tpspec.serve.structured`). A field the request leaves out
takes the checkpoint's generation default when it has one, else vLLM's default.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .structured import logit_bias_of, structured_outputs_of


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, status: int, *, kind: str = "BadRequestError", param: str | None = None) -> dict:
    """An OpenAI-style error body."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


class _Sampling(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        logit_bias_of(value)  # a ValueError here is a 400 naming the field
        return value

    @model_validator(mode="after")
    def _check_structured_outputs(self) -> "_Sampling":
        structured_outputs_of(self.response_format, self.structured_outputs)
        return self

    def sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The ``SamplingParams`` fields this request sets (unset ones are left out)."""
        values = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                  "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                  "include_stop_str_in_output": self.include_stop_str_in_output,
                  "skip_special_tokens": self.skip_special_tokens, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                  "max_tokens": max_tokens, "logprobs": logprobs,
                  "structured_outputs": structured_outputs_of(self.response_format, self.structured_outputs),
                  "logit_bias": logit_bias_of(self.logit_bias), "allowed_token_ids": self.allowed_token_ids,
                  "bad_words": self.bad_words}
        return {k: v for k, v in values.items() if v is not None}


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a token-id list or
    a list of token-id lists (each one prompt). ``logprobs``: top-N per token (0-20)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``logprobs`` (bool) with ``top_logprobs`` (0-20);
    ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


