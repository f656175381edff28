"""Which chat templates strip which edges of a message's text: the table of docs/bridges.md.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/template_edges.py [ID ...]

For every template of the gap-finding corpus (tests/bridge_gaps.py, without its template mutations)
whose id contains one of ``ID``, transformers' ``apply_chat_template`` renders a conversation whose
system, user, assistant (in history, followed by a user turn) and tool texts are a word with whitespace
at one edge (a space, a tab, LF, CRLF, a no-break space). An edge is *stripped* where the render is the
same as with the bare word, *kept* otherwise. Only transformers renders here: nothing
of tito runs.

A template that strips an edge of an assistant text cannot give back a reply the model sampled with that
whitespace: tito's bridge keeps the sampled ids where the template is append-only for the turn (the
splice), and elsewhere breaks with ``edge_whitespace_stripped`` naming the message (docs/bridges.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jinja2  # noqa: E402

from tests.bridge_gaps import NotApplicable, corpus  # noqa: E402

WORD = "Zebra"
KINDS = {"␠": " ", "⇥": "\t", "LF": "\n", "CRLF": "\r\n", "NBSP": "\u00a0"}


def conversation(role: str, text: str, string_args: bool) -> tuple[list[dict], list[dict] | None]:
    """A conversation with ``text`` in one message of ``role`` and plain words elsewhere."""
    if role == "system":
        return [{"role": "system", "content": text}, {"role": "user", "content": "hi"}], None
    if role == "user":
        return [{"role": "user", "content": text}], None
    if role == "assistant":
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text},
                {"role": "user", "content": "ok"}], None
    args = json.dumps({"q": "x"}) if string_args else {"q": "x"}
    tools = [{"type": "function", "function": {"name": "search", "description": "search",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "search", "arguments": args}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "abcDEF123", "content": text}], tools


def edges(entry, role: str) -> str:
    """What the template does with each edge of a ``role`` text: ``keeps all``, ``strips ...`` or ``—``
    (it renders no such conversation). An edge is stripped where the render with it equals the render
    without it."""
    hf = entry.pair[1]

    def render(text: str) -> str | None:
        messages, tools = conversation(role, text, entry.string_args)
        try:
            return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except (jinja2.TemplateError, TypeError, ValueError):
            return None

    plain = render(WORD)
    if plain is None or WORD not in plain:
        return "—"
    stripped = [f"{side} {name}" for side in ("opening", "end") for name, ws in KINDS.items()
                if render(ws + WORD if side == "opening" else WORD + ws) == plain]
    if not stripped:
        return "keeps all"
    if len(stripped) == 2 * len(KINDS):
        return "strips both edges"
    return "strips " + ", ".join(stripped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*")
    args = parser.parse_args()
    print("| template | system | user | assistant | tool |")
    print("|---|---|---|---|---|")
    seen: dict[str, str] = {}
    for entry in corpus(mutate=False):
        name = entry.id.split("@")[0]
        if (args.ids and not any(i in entry.id for i in args.ids)) or name in seen:
            continue
        try:
            row = " | ".join(edges(entry, role) for role in ("system", "user", "assistant", "tool"))
        except NotApplicable:
            continue
        seen[name] = row
        print(f"| {name} | {row} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
