"""What the OpenAI routes answer, whole or streamed (openai_routes.py, streaming.py): a validated request
(:class:`Call`), the parsed choices of a chat completion, its finish reason, and the token texts logprobs
name. One module both route modules import, so neither imports the other's internals."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..engines.protocol import GenerateOutput, GenerateRequest, GenerateResult
from . import calls
from .logprobs import chat_logprobs, prompt_logprobs
from .schemas import ChatBody, weight_spans
from .state import ServerState
from .stops import TextStream


@dataclass
class Call:
    """One validated request, ready to run: what both the whole and the streamed answer need."""

    rid: str
    reqs: list[GenerateRequest]
    prompts: list[list[int]]
    key: str | None
    stops: list[str]
    include_stop: bool
    ignored: list[str] = field(default_factory=list)

    def texts(self, decode) -> list[TextStream] | None:
        return [TextStream(decode, self.stops, self.include_stop) for _ in range(self.reqs[0].sampling.n)]


def system_fingerprint() -> str:
    """``tito-<version>``, where vLLM sends ``vllm-<version>-<build>``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"tito-{version('tito')}"
    except PackageNotFoundError:  # a source checkout that was never installed
        return "tito-unknown"


def token_decoder(state: ServerState):
    """The tokenizer's decode as vLLM's logprobs name tokens with it (special tokens kept): ids -> text."""
    return state.parser.tokenizer.decode


def chat_choice(state: ServerState, body: ChatBody, r: GenerateResult, prompt: list[int],
                text: TextStream | None) -> tuple[GenerateResult, dict, Any, TextStream | None]:
    """The parsed answer of one completion: (result, assistant message, parse, its stop-string stream)."""
    parsed = state.parser.parse_response(r.completion_ids, prompt, body.tools)
    assistant = parsed.to_message()
    if text is not None and text.stopped and isinstance(assistant.get("content"), str):
        content = assistant["content"]
        at = content.find(text.stop)
        if at >= 0:  # the stop string and what its last token carried after it are not content
            assistant["content"] = content[: at + len(text.stop) if text.include_stop else at]
    return r, assistant, parsed, text


def chat_response(state: ServerState, body: ChatBody, rid: str, prompt: list[int], out: GenerateOutput,
                  parsed_all: list, turn: Any) -> dict:
    token_text = token_decoder(state)
    choices = []
    for i, (r, assistant, parsed, text) in enumerate(parsed_all):
        message = {"role": "assistant", "content": assistant.get("content"),
                   "reasoning_content": assistant.get("reasoning_content"),
                   "tool_calls": assistant.get("tool_calls", [])}
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": chat_finish(r, assistant),
                                  "stop_reason": calls.stop_reason(state, r, text),
                                  "weight_versions": weight_spans(r.weight_version, len(r.completion_ids), r.token_versions),
                                  # every tool-call attempt with its status, malformed ones included (RL rewards them)
                                  "tool_call_attempts": [{"name": c.name, "status": str(c.status), "error": c.error,
                                                          "raw": c.raw} for c in parsed.tool_calls]}
        if body.logprobs and r.logprobs is not None:
            choice["logprobs"] = chat_logprobs(token_text, r.completion_ids, r.logprobs, r.top_logprobs,
                                               body.top_logprobs, body.return_tokens_as_token_ids)
        else:
            choice["logprobs"] = None
        if body.return_token_ids:
            choice["token_ids"] = r.completion_ids
        choices.append(choice)
    cached = max(r.cached_prompt_tokens for r in out.results)
    resp: dict[str, Any] = {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_names[0],
        "choices": choices,
        "usage": calls.usage(len(prompt), sum(len(r.completion_ids) for r in out.results), cached),
    }
    if body.return_token_ids:
        resp["prompt_token_ids"] = prompt
    resp["prompt_logprobs"] = prompt_logprobs(token_text, prompt, out.prompt_logprobs)
    if turn is not None:
        resp["session"] = turn.info
    return resp


def chat_finish(r: GenerateResult, assistant: dict) -> str:
    return "tool_calls" if r.finish_reason == "stop" and assistant.get("tool_calls") else r.finish_reason
