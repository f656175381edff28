"""The generic bridge where the load-time probe finds a template not append-only: render the whole
conversation and bridge when it extends the previous tokens exactly.

The probe answers for every conversation at once, from sentinel histories. A template that keeps
conversation-wide state (DeepSeek's first tool round, a system prompt or tool list placed next to the
last user message, Llama 3.1's tool calls that drop the reply's text) is flagged for all of them, yet
for a given conversation its full render very often does start with the previous prompt plus the
completion as sampled. So, for those turns, the bridge renders history + the sampled turn (as its
parsed assistant message) + the new messages, and keeps the render's tail when its ids start with
``prev_prompt_ids + prev_completion_ids`` exactly: the check is on the ids the model sampled, never
on a re-render of them. Where they differ, the Break names the first diverging position.

The bridge is given ids, not messages: the renderer remembers which conversation each prompt it
produced was rendered from (renderers/conversations.py: ``render(..., add_generation_prompt=True)``
and every successful bridge), so a caller that only passes ids back (the renderer service) needs
nothing more.
A caller may also pass the history itself (``GenericRenderer.bridge(..., history=messages)``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from .base import TemplateRejected
from .messages import MessageError
from .types import Break, BreakReason, Bridged, ParsedResponse, RenderedTokens


class RendersWhole(Protocol):
    """What the full-render bridge uses of the generic renderer (a Protocol, so that this module
    needs nothing of renderers/generic.py, which imports it)."""

    history_arguments: str
    stop_token_ids: tuple[int, ...]
    tokenizer: Any
    probe: Any

    def parse_response(self, completion_ids: list[int], prompt_ids: list[int] | None = None,
                       tools: list[dict] | None = None) -> ParsedResponse: ...

    def _render_tokens(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> RenderedTokens: ...

    def _try_text(self, msgs: list[dict], tools: list[dict] | None, agp: bool) -> str | None: ...


def assistant_message(renderer: RendersWhole, completion: list[int], tools: list[dict] | None) -> dict:
    """The sampled turn as the message a re-render uses: parsed, tool-call arguments in the form the
    template renders in history. A completion that starts with the template's own text before a reply
    (the assistant header of a template whose generation prompt leaves it to the model) is parsed after
    it: the re-render writes it again, and a parse would take it for the reply's text."""
    head = renderer.probe.reply_head
    if head:
        head_ids = renderer.tokenizer.encode(head)
        if head_ids and list(completion[: len(head_ids)]) == head_ids:
            completion = completion[len(head_ids) :]
    return renderer.parse_response(completion, tools=tools).to_message(renderer.history_arguments)


def as_sampled(renderer: RendersWhole, message: dict, completion: list[int],
               prompt: list[int] | None = None) -> list[dict]:
    """:func:`assistant_message`'s ``message`` with its text as sampled, where the parse stripped it (see
    :func:`exact_texts`), never ``message`` itself; empty where the parse stripped nothing. The texts are
    :func:`sampled_texts`."""
    out: list[dict] = []
    for text in sampled_texts(renderer, completion, prompt):
        out += [m for m in exact_texts(message, text) if m != message and m not in out]
    return out


def sampled_texts(renderer: RendersWhole, completion: list[int], prompt: list[int] | None = None) -> list[str]:
    """The reply's text as sampled (its stop tokens and the template's own text around it removed), read
    two ways, each a candidate (the caller's re-render against the sampled ids decides): the completion
    decoded alone, and decoded after the prompt's last tokens. A SentencePiece decoder drops the space of
    the first "▁" it decodes, so alone a reply the model opened with a space (" C++", the first token
    "▁C") reads "C++"; after the prompt's text (a ``[/INST]`` spelled in plain tokens) it keeps it. Which
    is the reply's own text only a render can tell."""
    end = len(completion)
    while end and completion[end - 1] in renderer.stop_token_ids:
        end -= 1
    texts = [renderer.tokenizer.decode(completion[:end])]
    if prompt:
        context = list(prompt[-4:])
        before = renderer.tokenizer.decode(context)
        joined = renderer.tokenizer.decode([*context, *completion[:end]])
        if joined.startswith(before) and joined[len(before):] != texts[0]:
            texts.append(joined[len(before):])
    # the template's own text around the reply: SentencePiece Mistral's space after [/INST], Llama 2's
    # space before </s>
    head, gap = renderer.probe.reply_head, renderer.probe.close_gap
    out: list[str] = []
    for text in texts:
        if head and text.startswith(head):
            text = text[len(head) :]
        if gap and text.endswith(gap):
            text = text[: len(text) - len(gap)]
        if text not in out:
            out.append(text)
    return out


def stripped_edge(renderer: RendersWhole, prompt: list[int], completion: list[int], history: list[dict],
                  message: dict, msgs: list[dict], tools: list[dict] | None) -> str | None:
    """Why the sampled turn cannot come back when the template strips whitespace the model sampled at an
    edge of its reply: the template renders the conversation the same with and without that whitespace,
    so no render holds the sampled ids (Llama 2's ``content.strip()``, Llama 3's ``| trim``). None where
    the reply has no such edge, or the template keeps it. Checked on the template's text, only after a
    bridge failed (for the Break's reason)."""
    if "tool_calls" in message or "reasoning_content" in message:
        return None
    def render(content: str) -> str | None:
        return renderer._try_text([*history, {**message, "content": content}, *msgs], tools, True)

    for text in sampled_texts(renderer, completion, prompt):
        if text == text.strip():
            continue
        full = render(text)
        if full is None:
            continue
        edges = [name for name, cut in (("opening", text.lstrip()), ("end", text.rstrip())) if cut != text and render(cut) == full]
        if edges:
            lead, trail = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()) :]
            what = {"opening": f"the {lead!r} opening", "end": f"the {trail!r} ending"}
            return (f"message {len(history)} (assistant, the sampled turn): the template strips "
                    f"{' and '.join(what[e] for e in edges)} of its reply, rendering the same text without it, "
                    "so no render holds the sampled ids")
    return None


def exact_texts(message: dict, sampled: str) -> list[dict]:
    """``message`` with the reply's text as sampled where the parse may have stripped it, most likely
    first (``message`` itself may be one); empty where it stripped nothing. A parse strips the text
    around a reply, and a template that renders it verbatim (Mistral's, Qwen's) renders other ids than
    the model's from the stripped one.

    A plain reply (no calls, no reasoning, no markup) is ``sampled`` stripped: one candidate. A reply
    with tool calls keeps the whitespace ``sampled`` opens with, and some of the whitespace between its
    text and the first call: how much is the template's own separator (Qwen's ``"\n"`` before
    ``<tool_call>``) only a render can tell, so each split is a candidate. Candidates only: the caller's
    re-render against the sampled ids decides."""
    if "reasoning_content" in message:
        return []
    content = message["content"]
    if "tool_calls" not in message:
        return [{**message, "content": sampled}] if sampled != content and sampled.strip() == content else []
    lead = sampled[: len(sampled) - len(sampled.lstrip())]
    if content.startswith(lead):
        lead = ""  # the parse kept it (or there is none)
    if not content or not sampled.startswith(lead + content):
        return []
    after = sampled[len(lead) + len(content) :]
    trail = after[: len(after) - len(after.lstrip())]
    if not lead and not trail:
        return []
    return [{**message, "content": lead + content + trail[:j]} for j in range(len(trail) + 1)]


def full_bridge(
    renderer: RendersWhole,
    prompt: list[int],
    completion: list[int],
    history: list[dict],
    assistant: dict,
    msgs: list[dict],
    tools: list[dict] | None,
    closing_ids: Collection[int],
    why: str,
) -> Bridged | Break:
    """Bridge by rendering ``history + [assistant] + msgs``: the render's tail when its ids start with
    ``prompt + completion`` exactly (after a completion that did not close its turn, the render's
    close right after it is the synthesized token), else a Break naming where they diverge. ``why``:
    what the probe found, for the Break's detail."""
    prefix = [*prompt, *completion]
    n = len(prefix)
    conversation = [*history, assistant, *msgs]
    try:
        rendered = renderer._render_tokens(conversation, tools, True)
    except (TemplateRejected, MessageError) as exc:
        return Break(BreakReason.TEMPLATE_ERROR, f"the template rejects the conversation with the new messages: {exc}", n)
    ids = rendered.token_ids
    if ids[:n] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), n))
        where = f"token {at} of the previous prompt" if at < len(prompt) else f"token {at - len(prompt)} of the completion"
        moves = why.startswith("MOVES: ") and any(m["role"] == "system" for m in msgs)
        reason = BreakReason.SYSTEM_MESSAGE_MOVES if moves else BreakReason.TEMPLATE_NOT_APPEND_ONLY
        got = ids[at] if at < len(ids) else None
        return Break(
            reason,
            f"the full render with the new messages differs from the previous tokens at {where} "
            f"(render id {got}, previous id {prefix[at] if at < n else None}); the probe found: {why.removeprefix('MOVES: ')}",
            at,
        )
    synthesized = 0
    if not completion or completion[-1] not in closing_ids:
        if n >= len(ids) or ids[n] not in closing_ids:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR,
                "the completion ended without a stop token and the full render puts no turn-closing token right after it",
                n,
            )
        synthesized = 1
    h = len(history) + 1
    start = n + synthesized
    appended = RenderedTokens(
        token_ids=ids[n:],
        message_indices=[-1] * synthesized + [i - h if i >= h else -1 for i in rendered.message_indices[start:]],
        sampled_mask=[False] * (len(ids) - n),  # context: the model samples none of it
        is_content=[False] * synthesized + rendered.is_content[start:],
    )
    return Bridged(prefix_len=n, appended=appended, synthesized=synthesized, prev_prompt_ids=prompt,
                   prev_completion_ids=list(completion))
