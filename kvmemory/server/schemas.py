"""The server's request and response bodies as pydantic models: FastAPI validates every request
with them and they make the OpenAPI schema complete. Requests are strict (no "3" for 3, no true
for 1) and refuse unknown keys; a value outside a declared range is a 400 naming its parameter
(kvmemory.server.errors turns pydantic's errors into OpenAI's shape).

Custom error types (PydanticCustomError) carry the OpenAI error code they answer with:
missing_required_parameter, unsupported_parameter, invalid_value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from kvmemory.index import SELECTORS
from kvmemory.options import AskOptions
from kvmemory.window import ORDERS

MAX_STOP = 4
STRICT = ConfigDict(strict=True, extra="forbid")


def _utf8(v: str) -> str:
    """A string that is text: JSON's \\ud800 escapes decode to a lone surrogate, which no tokenizer (and
    no UTF-8) can take. Refused here, as a 400 naming the parameter, not a 500 deeper in."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_value", "holds a lone UTF-16 surrogate at character {at}: not text",
                                  {"at": e.start}) from None
    return v


def _non_blank(v: str) -> str:
    _utf8(v)
    if not v.strip():
        raise PydanticCustomError("missing_required_parameter", "must be a non-empty string")
    return v


Text = Annotated[str, AfterValidator(_utf8)]
NonBlank = Annotated[str, AfterValidator(_non_blank)]
# a seed is what torch's generators take: a signed or unsigned 64-bit integer
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def _neutral(*allowed):
    """A parameter accepted at its neutral value only (OpenAI clients send some by default)."""
    def check(v):
        if v is not None and v not in allowed:
            raise PydanticCustomError("unsupported_parameter",
                                      "{value!r} is not supported by this server (supported: {allowed})",
                                      {"value": v, "allowed": list(allowed)})
        return v
    return AfterValidator(check)


def _absent(v):
    if v not in (None, [], {}):
        raise PydanticCustomError("unsupported_parameter", "not supported by this server")
    return v


Unsupported = Annotated[Any, AfterValidator(_absent)]


def _answer(v):
    if v is None:
        return None
    if isinstance(v, bool) or not str(v).strip():
        raise PydanticCustomError("invalid_value", "the expected final answer must be a non-empty string or a number")
    return str(v)


ExpectedAnswer = Annotated[str | int | float | None, AfterValidator(_answer)]


# ---------------------------------------------------------------------- errors
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""
    error: ErrorBody


# ---------------------------------------------------------------------- chat completions
class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")      # name, refusal ...: accepted, unused
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


# OpenAI parameters this server does not have: accepted only absent, null or empty
UNSUPPORTED = ("tools", "tool_choice", "audio", "prediction",
               "web_search_options", "functions", "function_call", "modalities", "reasoning_effort", "verbosity")
_Unsupported = create_model("_Unsupported", __config__=STRICT, **{k: (Unsupported, None) for k in UNSUPPORTED})


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """Structured output: "json_object" (any JSON object) or "json_schema" (one schema, strict), both
    by constrained decoding (kvmemory.grammar); "text" as without it."""
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Unsupported):
    """POST /v1/chat/completions (OpenAI's shape). Sampling parameters this server does not have are
    accepted at their neutral value only; others are refused with a 400 naming them."""
    model_config = STRICT
    model: Annotated[str, Field(min_length=1, examples=["kvmemory"])]
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    stop: Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    seed: Seed | None = None
    prompt_cache_key: Text | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    metadata: dict[str, str] | None = None
    n: Annotated[int | None, Field(ge=1, le=8)] = None
    # sampling, as OpenAI's and vLLM's servers take it (kvmemory.decode.Sampler)
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    top_k: Annotated[int | None, Field(ge=-1, description="the k most likely tokens only; 0 or -1: all")] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    parallel_tool_calls: bool | None = None
    store: Annotated[bool | None, _neutral(False)] = None
    service_tier: Annotated[str | None, _neutral("auto", "default")] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    """The answer's tokens with their log-probabilities under the model (logprobs: true), and the
    top_logprobs likeliest at each step. A conversation restored from the store gives the same
    numbers, bit for bit, as the same conversation computed afresh."""
    content: list[TokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class _Completion(BaseModel):
    """What a completion and each of its chunks carry."""
    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage
    kvmemory: dict[str, Any] | None = Field(None, description="with a user: what its memory recalled "
                                            "(sessions, turns, scores) and the window's tokens grafted, "
                                            "re-rotated, recomputed, prefilled")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChoiceLogprobs | None = None       # streamed: every token's, on the chunk that finishes


class ChatCompletionChunk(_Completion):
    """One server-sent event of a streamed completion (`data: {...}`; the last is `data: [DONE]`)."""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvmemory: dict[str, Any] | None = None         # on the chunk that carries finish_reason


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvmemory"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    queue: int
    dtype: str = "float32"             # what the model computes in (a store of it holds KV of this dtype)
    dtype_reason: str = ""             # why: asked for, the store's, or measured at start-up (kvmemory.model.choose)
    invariant_rows: bool = False       # batched decoding reduces rows alike whatever the batch (serve --invariant-rows)


# ---------------------------------------------------------------------- documents and jobs
class DocumentCreate(BaseModel):
    """POST /v1/documents as JSON; the same endpoint takes a multipart upload (`file`, `doc_id`)."""
    model_config = STRICT
    text: Text
    doc_id: Text | None = None


class DocumentUpload(BaseModel):
    """POST /v1/documents as multipart/form-data."""
    file: bytes = Field(json_schema_extra={"format": "binary"})
    doc_id: str | None = None


class JobCreated(BaseModel):
    job_id: str
    doc_id: str
    status: Literal["queued", "running", "done", "failed"]


class JobProgress(BaseModel):
    tokens_done: int
    tokens_total: int | None


class Job(BaseModel):
    id: str
    doc_id: str
    status: Literal["queued", "running", "done", "failed"]
    progress: JobProgress
    error: str | None
    created: float


class Document(BaseModel):
    doc_id: str
    n_tokens: int
    blocks: int
    kv_bytes: int = Field(description="the KV its tokens hold (before the store's codec)")
    source: str
    created: float


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Document]


class Deleted(BaseModel):
    doc_id: str
    deleted: bool


# ---------------------------------------------------------------------- ask
class AskRequest(BaseModel):
    """POST /v1/ask. Unset fields take Memory.ask's defaults."""
    model_config = STRICT
    question: Annotated[NonBlank, Field(max_length=8000)]
    top_k: Annotated[int | None, Field(ge=1, le=64)] = None
    selector: Literal[tuple(SELECTORS)] | None = None          # type: ignore[valid-type]
    max_new_tokens: Annotated[int | None, Field(ge=1, le=512)] = None
    recompute: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    expand: bool | None = None
    min_relevance: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    rerank: Annotated[int | None, Field(ge=0, le=64)] = None
    rerank_margin: Annotated[float | None, Field(ge=0.0, le=100.0)] = None
    rerank_keep: bool | None = None
    max_context_tokens: Annotated[int | None, Field(ge=1, le=1 << 20)] = None
    seam: Annotated[int | None, Field(ge=0, le=4096)] = None
    reread: bool | None = None
    order: Literal[tuple(ORDERS)] | None = None               # type: ignore[valid-type]
    stream: bool = False

    def options(self, defaults: AskOptions) -> AskOptions:
        """The request's options: what it sets, over the server's `defaults` (kvmemory.options)."""
        return defaults.but(**self.model_dump(exclude={"question", "stream"}))


class Passage(BaseModel):
    doc_id: str
    start_token: int
    end_token: int
    score: float
    text: str


class AskResponse(BaseModel):
    """The answer, the passages it was grafted from (window order) and the figures of the request.
    Streamed (stream: true), events are {"type": "delta", "text"} and a last {"type": "final", ...}."""
    answer: str
    sources: list[Passage]
    stats: dict[str, Any]


# ---------------------------------------------------------------------- the solution library
class LearnRequest(BaseModel):
    model_config = STRICT
    problem: Annotated[NonBlank, Field(max_length=20000)]
    solution: Annotated[NonBlank, Field(max_length=20000)]
    answer: ExpectedAnswer = None
    unverified: bool = False


class LearnResponse(BaseModel):
    entry_id: str
    verified: bool
    answer: str | None
    n_tokens: int


class SolveRequest(BaseModel):
    model_config = STRICT
    problem: Annotated[NonBlank, Field(max_length=8000)]
    answer: ExpectedAnswer = None
    k: Annotated[int, Field(ge=0, le=16)] = 3
    attempts: Annotated[int, Field(ge=1, le=16)] = 1
    max_new_tokens: Annotated[int, Field(ge=1, le=512)] = 256
    learn: bool = True
    recompute: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0


class SolveResponse(BaseModel):
    text: str
    answer: str | None
    verified: bool | None
    sources: list[str]
    learned: str | None
    stats: dict[str, Any]


# ---------------------------------------------------------------------- sessions
class Recalled(BaseModel):
    doc_id: str
    start_token: int
    end_token: int
    score: float
    text: str


class Session(BaseModel):
    id: str
    states: list[str]
    turns: int
    tokens: int
    created: float
    updated: float
    last_recall: list[Recalled]


class SessionDeleted(BaseModel):
    id: str
    deleted: bool
    states: int
    documents: int = Field(description="the session's older turns forgotten (kept when it outgrew the window)")


# ---------------------------------------------------------------------- users (chat memory)
class KeptSession(BaseModel):
    id: str
    turns: int
    tokens: int
    first: float
    last: float
    states: int


class UserMemory(BaseModel):
    """What a user's memory keeps (GET /v1/users/{user}/memory)."""
    user: str
    turns: int
    tokens: int
    kv_bytes: int
    sessions: list[KeptSession]


class UserForgotten(BaseModel):
    user: str
    session: str | None
    deleted: bool
    turns: int
    states: int
    sessions: int
