"""A seeded generator of OpenAI-style conversations (messages, tools) for the renderer parity tests.

``generate(seed, n)`` is deterministic: the same seed gives the same conversations on every run and
platform (only ``random.Random`` and the standard library are used). The conversations cover what
chat templates branch on and what tokenizers are sensitive to:

- system message first / later in the conversation / absent / both; odd role orders;
- assistant turns with and without reasoning, before and after the last real user query; reasoning
  as ``reasoning_content``, ``reasoning`` or ``thinking`` keys, and embedded ``<think>..</think>`` in
  content (well-formed, compact, close-only, empty);
- assistant tool calls (nested objects, booleans, integers, floats, null, Unicode; arguments as a
  dict and as a JSON string; OpenAI-style ``content: None`` and ``""``; flat and wrapped call forms)
  and runs of several consecutive tool results; user text wrapped like a tool response;
- whitespace (leading/trailing spaces and newlines, ``\\r\\n``, tabs, empty content), Unicode
  (combining marks, CJK, emoji with ZWJ sequences, zero-width characters, RTL), content as a list
  of text parts, tool definitions;
- in some conversations, marker-shaped text (``<|im_end|>``, ``<|im_start|>user``, ``<think>``,
  ``<tool_call>``, ``<｜User｜>``, ...) inside message text and tool definitions;
- endings on an assistant message, a user message or tool results.

It never emits :data:`DEFUSE_CHAR`, which the parity test uses to break added-token strings.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DEFUSE_CHAR = "\ue000"  # private use; inserted after a marker's first character to break it

WORDS = (
    "hello", "world", "the", "answer", "is", "42", "ok", "foo", "bar", "Paris", "weather", "compute",
    "x+y", "résumé", "naïve", "please", "check", "again", "why?", "yes.", "no!", "it's", "don't",
    "A.I.", "3.14", "1,000", "e.g.", "C++", "#tag", "@user", "https://example.com/a?b=c", "a/b", "(x)",
    "[1, 2]", "{k: v}", "100%", "$5", "Ünïcödé", "Straße", "---", "...", "'quoted'", '"dq"', "back\\slash",
    # ASCII the pre-tokenizer regex treats specially: contractions in any case, digit runs, space runs
    "IT'S", "We'LL", "they've", "I'M", "'d", "''", "'s's", "12345678", "007", "1e-9", "0x1F", "a  b", "x\t\ty",
    "end   \n", "\r\r\n", "!!!???", "--flag=value", "a_b-c", "```", "`tick`", "~^|\\", "  \n  \t ", "A1b2C3",
)
UNICODE = (
    "e\u0301", "a\u0308\u0304", "n\u0303o", "你好，世界", "日本語のテキスト", "한국어 문장", "中文：测试。",
    "👍", "👍🏽", "👩\u200d💻", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇫🇷", "zero\u200bwidth",
    "joi\u200dner", "non\u200cjoiner", "\u2060wj", "\ufeffbom", "שלום עולם", "مرحبا بالعالم", "Ελληνικά",
    "∑∫√∞", "\u00a0nbsp\u00a0", "ℌ𝔢𝔩𝔩𝔬", "ｆｕｌｌｗｉｄｔｈ", "\u0301leading-combining", "ą̷̧͓",
)
SNIPPETS = (
    "def f(x):\n    return x * 2\n",
    "```json\n{\"a\": 1}\n```",
    "line1\nline2\n\nline4",
    "col1\tcol2\tcol3",
    "windows\r\nline\r\nend",
    "    indented",
    "trailing spaces   ",
    "<b>html</b> &amp; <i>tags</i>",
    "SELECT * FROM t WHERE a = 'b';",
    "{\"name\": \"fake\", \"arguments\": {}}",
)
# Marker-shaped text: added-token strings of the fixtures' vocabularies, and text around them.
MARKERS = (
    "<|im_end|>", "<|im_start|>", "<|im_start|>user\nfake turn", "<|im_end|>\n<|im_start|>assistant\n",
    "<think>", "</think>", "<think>\nhidden\n</think>", "<tool_call>", "</tool_call>",
    '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>', "<tool_response>", "</tool_response>",
    "<|endoftext|>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>",
    "<|fim_prefix|>", "<|vision_start|>", "<|EOT|>", "<repo_name>", "<file_sep>",
)
# Near misses: not added tokens anywhere, so they stay exact-compared.
NEAR_MISSES = ("<|im_end|", "< think>", "<tool_call >", "<|im start|>", "</ think>", "<｜User|>", "<tool_response", "im_end")
LEADS = (" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "\u3000")
TRAILS = (" ", "  ", "\n", "\n\n", "\t", "\n ", "\r\n", " \n\n")
BLANKS = ("\n", "\n\n", " ", "\t", "\r\n", " \n ", "\n\n\n")  # whitespace-only text
SEPARATORS = (" ", " ", " ", "\n", "\n\n", "", "\r\n", "\t", ". ")

TOOL_NAMES = ("get_weather", "search", "calculator", "run_python", "lookup_user", "send_email", "搜索", "noop")


@dataclass
class Conversation:
    index: int
    seed: int
    messages: list[dict]
    tools: list[dict] | None = None
    tags: set[str] = field(default_factory=set)

    def label(self) -> str:
        return f"conversation #{self.index} (seed {self.seed})"


class ConvGen:
    """One seeded stream of conversations."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.r = random.Random(seed)
        self.markers = False  # this conversation may carry marker-shaped text
        self.ascii_only = False  # this conversation's generated text is ASCII (the fast encoding path)
        self.tags: set[str] = set()

    # ---- text ---------------------------------------------------------------------------------

    def text(self, *, allow_empty: bool = True, marker_p: float = 0.35, max_parts: int = 3) -> str:
        r = self.r
        if allow_empty and r.random() < 0.05:
            self.tags.add("empty-text")
            return ""
        if r.random() < 0.03:
            self.tags.add("blank-text")
            return r.choice(BLANKS)
        parts = []
        for _ in range(r.randint(1, max_parts)):
            k = r.random()
            if k < 0.55:
                parts.append(" ".join(r.choice(WORDS) for _ in range(r.randint(1, 6))))
            elif k < 0.8 and not self.ascii_only:
                parts.append(r.choice(UNICODE))
                self.tags.add("unicode")
            elif k < 0.8:
                parts.append(r.choice(WORDS) + r.choice(SEPARATORS) + r.choice(WORDS))
            elif k < 0.9:
                parts.append(r.choice(SNIPPETS))
            else:
                parts.append(r.choice(NEAR_MISSES))
        if self.markers and r.random() < marker_p:
            parts.insert(r.randint(0, len(parts)), r.choice(MARKERS))
            self.tags.add("marker-text")
        s = r.choice(SEPARATORS).join(parts)
        if r.random() < 0.2:
            s = r.choice(LEADS) + s
            self.tags.add("leading-ws")
        if r.random() < 0.2:
            s = s + r.choice(TRAILS)
            self.tags.add("trailing-ws")
        return s

    def content(self, **kw: Any) -> str | list:
        """A message content: usually a string, sometimes a list of text parts."""
        r = self.r
        if r.random() < 0.1:
            self.tags.add("parts")
            parts: list = []
            for _ in range(r.randint(1, 3)):
                t = self.text(**kw)
                parts.append(t if r.random() < 0.2 else {"type": "text", "text": t})
            return parts
        return self.text(**kw)

    # ---- tool calls ---------------------------------------------------------------------------

    def scalar(self) -> Any:
        r = self.r
        return r.choice(
            [
                True, False, None, 0, 1, -7, 42, 2**53 + 1, 10**20, 0.5, -2.0, -0.0, 3.14159, 1e-7, 1e20, 0.1 + 0.2,
                float("inf"),
                "", "metric", "Zürich", "東京", "🙂", "a\nb", 'quote " inside', "back\\slash", "tab\there",
            ]
        )

    def value(self, depth: int = 0) -> Any:
        r = self.r
        k = r.random()
        if depth < 3 and k < 0.15:
            return {self.key(): self.value(depth + 1) for _ in range(r.randint(0, 3))}
        if depth < 3 and k < 0.25:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        if k < 0.45:
            return self.text(allow_empty=True, marker_p=0.2, max_parts=2)
        return self.scalar()

    def key(self) -> str:
        return self.r.choice(("city", "days", "units", "verbose", "threshold", "filter", "tags", "options", "名前", "q", "nested", "x y"))

    def arguments(self) -> Any:
        r = self.r
        args = {self.key(): self.value() for _ in range(r.randint(0, 4))}
        if r.random() < 0.3:
            args["options"] = {"nested": {"deep": [1, {"flag": r.choice([True, False])}, None, 2.5]}, "ok": None}
        if r.random() < 0.4:
            self.tags.add("args-json-string")
            if r.random() < 0.05:
                return r.choice(["", "not json", "[1, 2]"])
            return json.dumps(
                args,
                ensure_ascii=r.choice([True, False]),
                separators=r.choice([None, (",", ":"), (", ", ": ")]),
                indent=r.choice([None, None, None, 2]),
            )
        self.tags.add("args-dict")
        return args

    def tool_call(self, j: int) -> dict:
        r = self.r
        name = r.choice(TOOL_NAMES)
        args = self.arguments()
        k = r.random()
        if k < 0.1:
            return {"name": name, "arguments": args}  # flat form
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if k < 0.8:
            call["id"] = f"call_{self.r.randrange(10**6)}_{j}"
        return call

    # ---- messages -----------------------------------------------------------------------------

    def system(self) -> dict:
        return {"role": "system", "content": self.content()}

    def user(self) -> dict:
        return {"role": "user", "content": self.content()}

    def user_tool_response(self) -> dict:
        """A user message that looks like a tool response (Qwen3's last-query detection looks for this)."""
        self.tags.add("user-as-tool-response")
        inner = self.text(marker_p=0.0)
        if self.r.random() < 0.15:
            return {"role": "user", "content": " <tool_response>\n" + inner + "\n</tool_response>"}  # near miss
        return {"role": "user", "content": "<tool_response>\n" + inner + "\n</tool_response>"}

    def tool_results(self, n: int | None = None) -> list[dict]:
        r = self.r
        n = n if n is not None else r.choice((1, 1, 2, 2, 3, 4))
        if n > 1:
            self.tags.add("tool-run")
        out = []
        for _ in range(n):
            k = r.random()
            if k < 0.4:
                content: Any = json.dumps({"result": self.value(), "ok": r.choice([True, False])}, ensure_ascii=r.choice([True, False]))
            else:
                content = self.content()
            msg: dict[str, Any] = {"role": "tool", "content": content}
            if r.random() < 0.6:
                msg["tool_call_id"] = f"call_{r.randrange(10**6)}"
            if r.random() < 0.2:
                msg["name"] = r.choice(TOOL_NAMES)
            out.append(msg)
        return out

    def _reasoning(self, msg: dict, content: str) -> str:
        """Attach reasoning to an assistant message; returns the (possibly rewritten) content."""
        r = self.r
        k = r.random()
        if k < 0.5:
            return content
        reasoning = self.text(allow_empty=False, marker_p=0.2)
        if k < 0.7:
            msg["reasoning_content"] = reasoning
            self.tags.add("reasoning_content")
        elif k < 0.82:
            msg["reasoning"] = reasoning
            self.tags.add("reasoning")
        elif k < 0.85:
            msg["thinking"] = reasoning
            self.tags.add("thinking")
        elif k < 0.88:
            msg[r.choice(("reasoning_content", "reasoning"))] = ""  # empty: dropped by normalize_messages
            self.tags.add("empty-reasoning")
        else:
            self.tags.add("embedded-think")
            form = r.choice(("canonical", "canonical", "compact", "close-only", "empty", "spaced", "double", "open-only", "both"))
            if form == "canonical":
                return f"<think>\n{reasoning}\n</think>\n\n{content}"
            if form == "compact":
                return f"<think>{reasoning}</think>{content}"
            if form == "close-only":
                return f"{reasoning}</think>\n\n{content}"
            if form == "empty":
                return f"<think>\n\n</think>\n\n{content}"
            if form == "double":
                return f"<think>{reasoning}</think>{content}</think>\n{self.text(marker_p=0.0)}"
            if form == "open-only":
                return f"<think>\n{reasoning}\n\n{content}"
            if form == "both":  # reasoning_content wins; the think block stays in the content
                msg["reasoning_content"] = self.text(allow_empty=False, marker_p=0.0)
                return f"<think>\n{reasoning}\n</think>\n\n{content}"
            return f"<think>\n\n{reasoning}\n\n\n</think>\n\n\n{content}"
        return content

    def assistant(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant"}
        content = self.text()
        content = self._reasoning(msg, content)
        if self.r.random() < 0.1 and "<think>" not in content and "</think>" not in content:
            msg["content"] = [{"type": "text", "text": content}]
            self.tags.add("parts")
        else:
            msg["content"] = content
        return msg

    def assistant_tool_calls(self, openai_style: bool) -> dict:
        r = self.r
        msg: dict[str, Any] = {"role": "assistant"}
        if openai_style:
            msg["content"] = None
            self.tags.add("content-none")
        else:
            k = r.random()
            if k < 0.35:
                msg["content"] = ""
                self.tags.add("content-empty")
            elif k < 0.45:
                msg["content"] = r.choice(BLANKS)
                self.tags.add("blank-text")
            else:
                msg["content"] = self.text(allow_empty=False)
        if r.random() < 0.35:
            content = self._reasoning(msg, msg["content"] or "")
            if msg["content"] is not None:
                msg["content"] = content
        msg["tool_calls"] = [self.tool_call(j) for j in range(r.choice((1, 1, 1, 2, 3)))]
        self.tags.add("tool-calls")
        return msg

    def tool_defs(self) -> list[dict]:
        r = self.r
        out = []
        for name in r.sample(TOOL_NAMES, r.randint(1, 3)):
            desc = self.text(allow_empty=False, marker_p=0.15, max_parts=2)
            params = {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": r.choice(("城市", "City name", "a \"quoted\" city"))},
                    "days": {"type": "integer", "minimum": 1, "default": 3},
                    "verbose": {"type": "boolean", "default": False},
                    "threshold": {"type": "number", "default": 0.5},
                    "filter": {"type": ["string", "null"], "default": None},
                },
                "required": ["city"],
            }
            fn = {"name": name, "description": desc, "parameters": params}
            out.append(fn if r.random() < 0.08 else {"type": "function", "function": fn})
        self.tags.add("tools")
        return out

    # ---- conversations ------------------------------------------------------------------------

    def conversation(self, index: int) -> Conversation:
        r = self.r
        self.tags = set()
        self.markers = r.random() < 0.07
        self.ascii_only = r.random() < 0.25
        if self.ascii_only:
            self.tags.add("ascii-only")
        if self.markers:
            self.tags.add("markers")
        if r.random() < 0.04:
            return self._odd(index)
        tools = self.tool_defs() if r.random() < 0.4 else None
        if tools is None and r.random() < 0.03:
            tools = []  # no tools, said explicitly
            self.tags.add("tools-empty")
        openai_style = r.random() < 0.08
        call_p = 0.6 if tools else 0.12
        system = r.choices(("first", "later", "absent", "both"), weights=(45, 10, 35, 10))[0]
        msgs: list[dict] = []
        if system in ("first", "both"):
            msgs.append(self.system())
            self.tags.add("system-first")
        rounds = r.choice((1, 1, 2, 2, 3, 4))
        for k in range(rounds):
            msgs.append(self.user())
            while r.random() < call_p:
                msgs.append(self.assistant_tool_calls(openai_style))
                msgs.extend(self.tool_results())
                if r.random() < 0.04:
                    msgs.append(self.user_tool_response())
                call_p *= 0.6
            msgs.append(self.assistant())
            if system in ("later", "both") and k == 0:
                msgs.append(self.system())
                self.tags.add("system-later")
        ending = r.choices(("assistant", "user", "tool", "tool-call", "user-tool-response"), weights=(40, 32, 18, 7, 3))[0]
        if ending == "user":
            msgs.append(self.user())
        elif ending == "tool":
            msgs.append(self.assistant_tool_calls(openai_style))
            msgs.extend(self.tool_results())
        elif ending == "tool-call":
            msgs.append(self.assistant_tool_calls(openai_style))
        elif ending == "user-tool-response":
            msgs.append(self.assistant_tool_calls(openai_style))
            msgs.extend(self.tool_results())
            msgs.append(self.user_tool_response())
            if r.random() < 0.5:
                msgs.append(self.assistant())
        self.tags.add(f"ends-{msgs[-1]['role']}")
        return Conversation(index, self.seed, msgs, tools, self.tags)

    def _odd(self, index: int) -> Conversation:
        """Role orders no chat client sends but templates accept: tool first, assistant first, two users..."""
        r = self.r
        self.tags.add("odd")
        msgs = []
        for _ in range(r.randint(1, 5)):
            role = r.choice(("system", "user", "assistant", "tool"))
            if role == "system":
                msgs.append(self.system())
            elif role == "user":
                msgs.append(self.user())
            elif role == "assistant":
                k = r.random()
                if k < 0.65:
                    msgs.append(self.assistant())
                elif k < 0.9:
                    msgs.append(self.assistant_tool_calls(r.random() < 0.3))
                else:
                    msgs.append({"role": "assistant", "content": None})  # nothing at all: templates reject it
                    self.tags.add("content-none")
            else:
                msgs.extend(self.tool_results(r.randint(1, 2)))
        tools = self.tool_defs() if r.random() < 0.3 else None
        self.tags.add(f"ends-{msgs[-1]['role']}")
        return Conversation(index, self.seed, msgs, tools, self.tags)


def generate(seed: int, n: int) -> list[Conversation]:
    gen = ConvGen(seed)
    return [gen.conversation(i) for i in range(n)]


# ---- helpers for marker-shaped text ------------------------------------------------------------


def marker_regex(markers: Iterable[str]) -> re.Pattern | None:
    """A regex matching any of ``markers``, longest first (as a tokenizer splits on added tokens)."""
    ordered = sorted(set(markers), key=len, reverse=True)
    return re.compile("|".join(re.escape(m) for m in ordered)) if ordered else None


def iter_strings(value: Any) -> Iterable[str]:
    """Every string inside a message list / tool list (dict keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from iter_strings(k)
            yield from iter_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_strings(v)


def contains_marker(value: Any, pattern: re.Pattern | None) -> bool:
    return pattern is not None and any(pattern.search(s) for s in iter_strings(value))


def defuse_str(text: str, pattern: re.Pattern | None, char: str = DEFUSE_CHAR) -> str:
    if pattern is None:
        return text
    return pattern.sub(lambda m: m.group()[0] + char + m.group()[1:], text)


def defuse(value: Any, pattern: re.Pattern | None, char: str = DEFUSE_CHAR) -> Any:
    """A copy of messages / tools with every marker inside a string broken by ``char`` (roles untouched)."""
    if isinstance(value, str):
        return defuse_str(value, pattern, char)
    if isinstance(value, dict):
        return {
            defuse_str(k, pattern, char) if isinstance(k, str) else k: (v if k == "role" else defuse(v, pattern, char))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [defuse(v, pattern, char) for v in value]
    return value
