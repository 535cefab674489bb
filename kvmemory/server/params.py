"""A request as the chat service uses it: ChatParams, from a chat completion (params_of) or a text
completion (completion_params); the checks the schema cannot say (the model's name, stream_options
without stream, ids, logit_bias's token ids), and the sampling keys away from their neutral values."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmemory.server.errors import ApiError, bad, check_id
from kvmemory.server.schemas import ChatCompletionRequest
from kvmemory.server.schemas_text import CompletionRequest

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ChatParams:
    """A validated chat request, as the service uses it."""
    messages: list[dict]           # [{"role": system|user|assistant, "content": str}]
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    session: str | None
    user: str | None = None        # the owner of a memory across sessions (the `user` field or X-Kvmemory-User)
    sampling: dict = field(default_factory=dict)   # kvmemory.decode.sampler's keys beyond temperature/top_p
    logprobs: int | None = None    # None: none; else how many top_logprobs each token carries
    prompt_ids: list[int] | None = None   # a text completion's prompt, as tokens (no chat template)
    schema: dict | None = None     # response_format's JSON schema: the answer constrained to it (kvmemory.grammar)
    n: int = 1                     # choices, decoded beside each other (seed + i each)


def params_of(req: ChatCompletionRequest, model_ids: tuple[str, ...], headers, vocab: int = 1 << 31) -> ChatParams:
    """The service's view of a request; ApiError for what the schema cannot say (the model's name,
    stream_options without stream, a malformed session id)."""
    check_common(req, model_ids)
    user = req.user or headers.get("x-kvmemory-user")
    session = req.prompt_cache_key or headers.get("x-session-id") or user
    if session is not None:
        check_id(session, "prompt_cache_key")
    if user is not None:
        check_id(user, "user")
    stop = stops_of(req)
    mt = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    if (req.n or 1) > 1 and req.stream:
        raise bad("n", "n > 1 is served without stream (the choices come whole)")
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    sampling = sampling_of(req, vocab)
    schema = None
    if req.response_format is not None and req.response_format.type == "json_object":
        schema = {"type": "object"}
    elif req.response_format is not None and req.response_format.type == "json_schema":
        if req.response_format.json_schema is None:
            raise bad("response_format", "a json_schema response_format needs its json_schema")
        schema = req.response_format.json_schema.schema_
    return ChatParams(messages, 1.0 if req.temperature is None else req.temperature,
                      1.0 if req.top_p is None else req.top_p, mt, stop, req.seed, req.stream,
                      bool(req.stream_options and req.stream_options.include_usage), session, user,
                      sampling, (req.top_logprobs or 0) if req.logprobs else None, schema=schema, n=req.n or 1)


def check_common(req, model_ids: tuple[str, ...]) -> None:
    if req.model not in model_ids:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_ids[0]!r}",
                       param="model", code="model_not_found")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")


def stops_of(req) -> list[str]:
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if any(not s for s in stop):
        raise bad("stop", "a stop string must not be empty")
    return stop


def sampling_of(req, vocab: int) -> dict:
    """kvmemory.decode.sampler's keys a request sets away from their neutral values (top_k 0 or -1,
    repetition_penalty 1: off), logit_bias's keys checked as token ids."""
    given = {"top_k": max(0, req.top_k or 0), "min_p": req.min_p or 0.0,
             "repetition_penalty": req.repetition_penalty or 1.0, "presence_penalty": req.presence_penalty or 0.0,
             "frequency_penalty": req.frequency_penalty or 0.0}
    sampling = {k: v for k, v in given.items() if v != (1.0 if k == "repetition_penalty" else 0)}
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            if not k.isdigit() or int(k) >= vocab:
                raise bad("logit_bias", f"logit_bias keys are token ids in 0..{vocab - 1}, got {k!r}")
            bias[int(k)] = float(v)
        sampling["logit_bias"] = bias
    return sampling


COMPLETION_MAX_TOKENS = 16          # OpenAI's default for a text completion


def completion_params(req: CompletionRequest, model_ids: tuple[str, ...], headers, tokenizer,
                      vocab: int = 1 << 31) -> ChatParams:
    """A text completion as the chat service runs it: the prompt's tokens as they are (no chat template,
    no user memory), saved and restored like a conversation."""
    check_common(req, model_ids)
    session = req.prompt_cache_key or headers.get("x-session-id")
    if session is not None:
        check_id(session, "prompt_cache_key")
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ChatParams([], 1.0 if req.temperature is None else req.temperature, 1.0 if req.top_p is None else req.top_p,
                      req.max_tokens or COMPLETION_MAX_TOKENS, stops_of(req), req.seed, req.stream,
                      bool(req.stream_options and req.stream_options.include_usage), session, None,
                      sampling_of(req, vocab), req.logprobs, prompt_ids=ids)
