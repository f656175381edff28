"""Wire formats of the HTTP API as msgspec Structs (decoded strictly; no per-request pydantic).

Request structs forbid unknown fields, so a typo (``max_token``) is a 400 naming the field instead of a
silently ignored setting. Fields vLLM accepts but that change nothing for a token-in/token-out engine
(``skip_special_tokens``, ``detokenize``...) are accepted and ignored; fields whose meaning this server
cannot honour (stop strings, penalties, top-k alternatives, streaming) are refused by
:func:`check_unsupported` with a message naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class BadRequest(ValueError):
    """A request the server refuses with 400; the text names the problem."""


class VLLMSamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's SamplingParams JSON, the subset a tokens-only engine can honour (see the module doc)."""

    max_tokens: int | None = None  # None: the server's default (the room left in max_model_len), not 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0 or 1: the sampled token's logprob
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True  # tokens out: nothing is detokenized
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True


def check_unsupported(values: dict[str, Any], where: str = "sampling_params") -> None:
    """Refuse settings this server would otherwise silently ignore."""
    stop = values.get("stop")
    if stop:
        raise BadRequest(f"{where}.stop: stop strings are not supported by a token-in/token-out server; "
                         "use stop_token_ids")
    for name, neutral in (("min_p", 0.0), ("min_tokens", 0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        value = values.get(name)
        if value is not None and value != neutral:
            raise BadRequest(f"{where}.{name}={value!r} is not supported by the engines (only {neutral!r})")
    if values.get("prompt_logprobs") is not None:
        raise BadRequest(f"{where}.prompt_logprobs is not supported (prompt tokens are not scored)")
    lp = values.get("logprobs")
    if isinstance(lp, int) and not isinstance(lp, bool) and lp > 1:
        raise BadRequest(f"{where}.logprobs={lp}: only the sampled token's logprob is returned (use 0 or 1)")


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /inference/v1/generate`` (vLLM 0.33 ``GenerateRequest``, tokens mode)."""

    token_ids: list[int]
    model: str | None = None
    sampling_params: VLLMSamplingParams = msgspec.field(default_factory=VLLMSamplingParams)
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    stream: bool = False
    output_mode: str = "tokens"
    return_token_ids: bool | None = None
    kv_transfer_params: dict | None = None


class TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    token: str  # "token_id:<id>", vLLM's return_tokens_as_token_ids form (the renderers client checks it)
    rank: int = 1
    top_logprobs: list[dict] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class GenerateChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: int | None
    weight_versions: list[int]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timing(msgspec.Struct):
    """Where the time went, in seconds: the engine's own (queue + prefill + decode, as it reports) and
    the engine call as the server saw it (adds Ray's transport)."""

    engine_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    engine_call_s: float


class GenerateResponse(msgspec.Struct):
    request_id: str
    choices: list[GenerateChoice]
    prompt_token_ids: list[int]
    usage: Usage
    metrics: Timing


class CompletionsBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/completions`` with token-id prompts (``prompt``: a list of ids or a list of such lists)."""

    prompt: Any
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    request_id: str | None = None
    priority: int = 0
    user: str | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ChatBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/chat/completions`` (OpenAI shape; token ids on request with ``return_token_ids``)."""

    messages: list[dict]
    model: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    return_token_ids: bool = False
    chat_template_kwargs: dict | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    priority: int = 0
    user: str | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    request_ids: list[str]


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    weight_dir: str
    version: int


def decode(raw: bytes, type_: type) -> Any:
    """Decode a JSON body strictly; every problem is a BadRequest naming it (msgspec's path included)."""
    if not raw:
        raise BadRequest("empty request body: expected a JSON object")
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None


def struct_values(obj: msgspec.Struct) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__struct_fields__}
