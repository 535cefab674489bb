"""Request and response bodies of the text completions and tokenizer endpoints (OpenAI's and vLLM's
shapes), beside kvmemory/server/schemas.py's."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from kvmemory.server.schemas import (MAX_STOP, STRICT, ChatMessage, NonBlank, Seed, StreamOptions, Text,
                                     Unsupported, Usage, _Completion, _neutral)


class CompletionRequest(BaseModel):
    """POST /v1/completions (OpenAI's legacy text completions): a text prompt continued, with the same
    persistence as a chat (its prefix saved and restored: usage.prompt_tokens_details.cached_tokens)."""
    model_config = STRICT
    model: Annotated[str, Field(min_length=1, examples=["kvmemory"])]
    prompt: Annotated[NonBlank, Field(max_length=200_000)] | Annotated[list[NonBlank], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    stop: Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int | None, _neutral(1)] = None
    echo: Annotated[bool | None, _neutral(False)] = None
    best_of: Annotated[int | None, _neutral(1)] = None
    suffix: Unsupported = None
    user: Text | None = None
    prompt_cache_key: Text | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text prompt, or chat messages rendered with the model's chat template."""
    model_config = STRICT
    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str
