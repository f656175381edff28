"""Wire formats of the HTTP API as msgspec Structs (decoded strictly; no per-request pydantic).

Request structs forbid unknown fields, so a typo (``max_token``) is a 400 naming the field instead of a
silently ignored setting. Fields vLLM accepts but that change nothing for a token-in/token-out engine
(``skip_special_tokens``, ``detokenize``...) are accepted and ignored; fields whose meaning this server
cannot honour (stop strings on the token route, penalties, more than 20 alternatives, streaming) are
refused by :func:`check_unsupported` with a message naming them.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from ..engines.protocol import MAX_LOGPROBS


class BadRequest(ValueError):
    """A request the server refuses with 400; the text names the problem and ``param`` the field
    (OpenAI's ``error.param``: ``"seed"``, ``"sampling_params.top_k"``, ``"messages"``...)."""

    status = 400
    kind = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFound(BadRequest):
    """404: a model or LoRA adapter name the server does not serve (vLLM's NotFoundError)."""

    status = 404
    kind = "NotFoundError"


class Conflict(BadRequest):
    """409: a request id that is already running."""

    status = 409
    kind = "ConflictError"


class TooLarge(BadRequest):
    """413: a body over the server's limit."""

    status = 413
    kind = "RequestTooLargeError"


class VLLMSamplingParams(msgspec.Struct):
    """vLLM's SamplingParams JSON, the subset a tokens-only engine can honour (see the module doc). Unlike the
    bodies, other keys are not refused here but sorted by :func:`decode_sampling`, as vLLM's server takes them."""

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
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's, with the k most likely
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob, with the k most likely
    min_tokens: int = 0  # no stop id or EOS before this many tokens
    output_kind: int = 0  # vLLM's RequestOutputKind: 0 cumulative, 2 final only (1 deltas: refused)
    routed_experts_prompt_start: int = 0  # vLLM's: where returned MoE routing starts (none is returned)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True  # tokens out: nothing is detokenized
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # prime-rl's orchestrator sets these in its extra_body and verifiers merges that into sampling_params;
    # neither is a field of vLLM's SamplingParams, so vLLM's server ignores both there
    return_token_ids: bool | None = None  # token ids are always returned on this route
    cache_salt: str | None = None  # the request's salt when the top level has none (decode_generate)


# vLLM's SamplingParams fields that ask for what these engines cannot do: a 400 naming the field unless sent
# with a value that asks for nothing (vLLM's default, or an empty list/dict). watermarking=False skips a
# watermark the engines never apply.
VLLM_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "allowed_token_ids": (None,), "bad_words": (None, []), "logit_bias": (None, {}), "extra_args": (None, {}),
    "logprob_token_ids": (None,), "prompt_logprob_token_ids": (None,), "prompt_logprob_start": (None,),
    "structured_outputs": (None,), "thinking_token_budget": (None,), "repetition_detection": (None,),
    "trace_decode_token_ids": (None,), "watermarking": (None, False),
}
# vLLM's fields that only tune how vLLM works inside (no token, logprob or answer of this route changes):
# accepted and ignored, as the engines have no such machinery
VLLM_INTERNAL = frozenset({"flat_logprobs", "skip_clone", "stream_interval", "output_text_buffer_length",
                           "skip_reading_prefix_cache"})
_SAMPLING_FIELDS = frozenset(VLLMSamplingParams.__struct_fields__)


def decode_sampling(raw: bytes) -> tuple[VLLMSamplingParams, list[str]]:
    """``sampling_params`` as vLLM's server takes it, and the keys it ignores. vLLM decodes it into its
    SamplingParams without refusing unknown keys (prime-rl's ``return_token_ids`` and ``cache_salt`` land
    there). Here: tito's fields are decoded strictly; vLLM's fields this server cannot honour are a 400
    (VLLM_UNHONOURED); vLLM's internal ones are ignored; any other key is returned, for the caller to make
    visible (a typo is otherwise silently ignored, as by vLLM)."""
    raw = bytes(raw)  # a msgspec.Raw slice of the body
    keys = decode(raw, dict[str, msgspec.Raw], where="sampling_params")
    for name in keys.keys() & VLLM_UNHONOURED.keys():
        value = msgspec.json.decode(keys[name])
        if not any(value == v and type(value) is type(v) for v in VLLM_UNHONOURED[name]):
            shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:80]}..."
            raise BadRequest(f"sampling_params.{name}={shown} is not supported by the engines",
                             f"sampling_params.{name}")
    unknown = [k for k in keys if k not in _SAMPLING_FIELDS and k not in VLLM_UNHONOURED and k not in VLLM_INTERNAL]
    return decode(raw, VLLMSamplingParams, where="sampling_params"), unknown


# Accepted on the OpenAI routes (clients send them by default) and without effect: the engines have no
# such sampling controls. Each response that carried one says so in the X-Tito-Ignored header.
IGNORED_OPENAI = (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", None))


def check_unsupported(values: dict[str, Any], where: str = "sampling_params", openai: bool = False) -> list[str]:
    """Refuse settings this server would otherwise silently ignore. ``where``: the prefix of the fields'
    names ("sampling_params" or "" for top-level fields). On the OpenAI routes (``openai``), stop strings
    are honoured by the server and the IGNORED_OPENAI fields are accepted: their names are returned."""
    prefix = f"{where}." if where else ""
    stop = values.get("stop")
    if stop and not openai:
        raise BadRequest(f"{prefix}stop: stop strings are not supported by a token-in/token-out route; "
                         "use stop_token_ids (the OpenAI routes honour stop strings)", f"{prefix}stop")
    ignored = []
    for name, neutral in (("min_p", 0.0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", None)):
        value = values.get(name)
        if value is None or value == neutral or value == {}:
            continue
        if openai and any(name == n for n, _ in IGNORED_OPENAI):
            ignored.append(name)
            continue
        raise BadRequest(f"{prefix}{name}={value!r} is not supported by the engines (only {neutral!r})",
                         f"{prefix}{name}")
    # vLLM takes -1 (the whole vocabulary) up to its max_logprobs (20 by default); here at most 20
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        k = values.get(name)
        if isinstance(k, int) and not isinstance(k, bool) and not 0 <= k <= MAX_LOGPROBS:
            raise BadRequest(f"{prefix}{name}={k}: the number of most likely tokens per position must be in "
                             f"[0, {MAX_LOGPROBS}]", f"{prefix}{name}")
    if values.get("prompt_logprobs") is not None and values.get("stream"):
        raise BadRequest(f"{prefix}prompt_logprobs is not available with stream=true", f"{prefix}prompt_logprobs")
    # vLLM's RequestOutputKind (SkyRL's Tinker-style sample() sends 2): unstreamed, 0 and 2 both give the whole
    # completion; 1 would leave only its last delta
    kind = values.get("output_kind")
    if kind is not None and kind not in (0, 2):
        raise BadRequest(f"{prefix}output_kind={kind!r}: only 0 (cumulative) or 2 (final only); this route answers "
                         "with the whole completion, not deltas", f"{prefix}output_kind")
    # each bound blames its own field: max_tokens=-1 is max_tokens' fault, not min_tokens'
    for name in ("max_tokens", "max_completion_tokens"):
        n = values.get(name)
        if n is not None and n < 1:
            raise BadRequest(f"{prefix}{name}={n} must be >= 1", f"{prefix}{name}")
    # chat's max_completion_tokens wins over its max_tokens
    name = "max_completion_tokens" if values.get("max_completion_tokens") is not None else "max_tokens"
    min_tokens, max_tokens = values.get("min_tokens") or 0, values.get(name)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        bound = f"[0, {name}={max_tokens}]" if max_tokens is not None else "[0, max_model_len)"
        raise BadRequest(f"{prefix}min_tokens={min_tokens} must be in {bound}", f"{prefix}min_tokens")
    return ignored


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /inference/v1/generate`` (vLLM 0.33 ``GenerateRequest``, tokens mode)."""

    token_ids: list[int]
    model: str | None = None
    sampling_params: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))  # decode_sampling
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    stream: bool = False
    output_mode: str = "tokens"
    return_token_ids: bool | None = None
    kv_transfer_params: dict | None = None


class TopLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None


class TokenLogprob(msgspec.Struct):
    """vLLM's ``GenerateLogProbsContent`` (plus ``token``); see rollout/serve/logprobs.py."""

    token_id: int
    logprob: float
    token: str  # "token_id:<id>", vLLM's return_tokens_as_token_ids form (the renderers client checks it)
    rank: int | None = None  # the sampled token's rank (None: the engine reports no ranks)
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class WeightVersionSpan(msgspec.Struct):
    """vLLM's ``WeightVersionSpan``: completion tokens ``[start, end)`` were sampled by weights ``version``
    (tito's integer version as a string, as vLLM labels weights with strings)."""

    version: str
    start: int
    end: int


def weight_spans(version: int, tokens: int, token_versions: list[int] | None = None) -> list[WeightVersionSpan]:
    """vLLM's ``weight_versions``: the completion's tokens ``[start, end)`` each weight version sampled. One span
    unless an update kept the request running (``token_versions``, one version per token, non-decreasing)."""
    if not token_versions:
        return [WeightVersionSpan(str(version), 0, tokens)]
    spans: list[WeightVersionSpan] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1].version == str(v):
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(str(v), i, i + 1))
    return spans


class GenerateChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: int | None
    weight_versions: list[WeightVersionSpan]
    routed_experts: None = None  # vLLM's MoE routing record and sampling mask: not recorded here
    sampling_mask: None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: None = None


class Timing(msgspec.Struct):
    """Where the time went, in seconds: the engine's own (queue + prefill + decode, as it reports) and
    the engine call as the server saw it (adds Ray's transport)."""

    engine_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    engine_call_s: float


class GenerateResponse(msgspec.Struct):
    """vLLM's ``GenerateTokensResponse``; the fields tito never fills (multimodal, KV transfer) are null, as
    vLLM sends them when unused."""

    request_id: str
    model: str
    created: int
    choices: list[GenerateChoice]
    prompt_token_ids: list[int]
    usage: Usage
    metrics: Timing
    output_mode: str = "tokens"
    prompt_logprobs: list[dict | None] | None = None  # sampling_params.prompt_logprobs (logprobs.py)
    prompt_token_id_logprobs: None = None
    mm_placeholders: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    prompt_logprobs: int | None = None
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
    include_stop_str_in_output: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    add_special_tokens: bool = True  # token-id prompts are sent as they are: nothing is added to them
    suffix: str | None = None
    best_of: int | None = None
    metadata: dict | None = None
    store: bool | None = None


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
    prompt_logprobs: int | None = None
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_tokens_as_token_ids: bool = False
    add_special_tokens: bool = False  # vLLM's chat default: the template places any BOS itself
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``POST /tokenize``: a text ``prompt`` or chat ``messages``."""

    prompt: str | None = None
    messages: list[dict] | None = None
    model: str | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    request_ids: list[str]


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    weight_dir: str
    version: int


MAX_JSON_DEPTH = 64  # deeper bodies are refused before decoding (msgspec would recurse ~1000 levels first)
# a JSON string (its escapes included); written so the regex engine never backtracks
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_PATH = re.compile(r"at `\$\.?([^`]*)`")


def check_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` before decoding it. Brackets inside strings are text:
    strings are cut out first (one regex pass), then the depth is the maximum running sum of the
    remaining brackets (numpy), so a 50 MB body costs tens of milliseconds, never a deep recursion."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case: cannot be deeper than that
        return
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return
    # "[" 0x5B and "{" 0x7B have bit 1 set, "]" 0x5D and "}" 0x7D do not: +1 / -1 per bracket
    steps = (np.frombuffer(brackets, dtype=np.uint8) & 0x02).astype(np.int32) - 1
    depth = int(np.cumsum(steps, out=steps).max())
    if depth > limit:
        raise BadRequest(f"the JSON body is nested {depth} levels deep; at most {limit} are accepted")


def decode(raw: bytes, type_: Any, where: str = "") -> Any:
    """Decode a JSON body strictly; every problem is a BadRequest naming it (msgspec's path included,
    and as ``param``). ``where``: the field of the body ``raw`` is (its path is put before msgspec's)."""
    if not raw:
        raise BadRequest("empty request body: expected a JSON object")
    check_depth(raw)
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if where:
            at = message.rfind(" - at `$")
            message = (f"{message[:at]} - at `$.{where}{message[at + 8:]}" if at >= 0
                       else f"{message} - at `$.{where}`")
        m = _PATH.search(message)
        raise BadRequest(f"invalid request: {message}", m.group(1) if m else None) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    except RecursionError:  # nesting under the depth limit, but through a recursive Python path
        raise BadRequest("the JSON body is nested too deeply") from None


def struct_values(obj: msgspec.Struct) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__struct_fields__}
