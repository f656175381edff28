"""Render and bridge speed against transformers' apply_chat_template + encode, in the same run.

    .venv/bin/python scripts/bench_render.py [--fixtures DIR] [--repeats 7] [--write docs/benchmarks.md]

Agent conversations with 1, 10 and 30 tool turns (each: an assistant turn with reasoning and a tool
call, then a ~150-token tool result) on the Qwen3 tokenizer, then 10 tool turns on other families
(Llama 3.1, gpt-oss) and on the Qwen3 template through the generic renderer. For each size it times

- reference: ``apply_chat_template(tokenize=False)`` + ``tokenizer(text, add_special_tokens=False)``
- tito render, cold: ``Renderer.render`` (ids + attribution) with its encoding caches emptied first
- tito render, warm: the same conversation again (each rollout of a GRPO group renders the same prompt)
- tito bridge: appending one never-seen ~150-token tool result to the full history
- the tokenizer's own encode of that tool result, for scale: no renderer can bridge faster than this

Each figure is the median of ``--repeats`` rounds; a round times enough calls to last ~0.2 s. The
machine is shared and noisy, so the ratio (measured back to back) is the figure to read.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchdoc import markers, replace_section  # noqa: E402

import renderers  # noqa: E402
from renderers.pieces import clear_caches  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                                          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
MULTILINGUAL = ("données du modèle résumé naïve 数据 模型 训练 🙂 👍🏽 Привет мир تجربة ˈfəʊnə "
                "значение 42 3.14 { } [ ] : , \n").split(" ")


def _code_corpus() -> list[str]:
    """Lines of this Python's standard library: the kind of text a coding agent's tools return."""
    import inspect
    import json as json_module
    import pathlib as pathlib_module
    import statistics as statistics_module

    return "".join(inspect.getsource(m) for m in (json_module.decoder, pathlib_module, statistics_module)).splitlines(True)


CODE = _code_corpus()


def tool_result(rng: random.Random, n_tokens: int, tok, style: str) -> str:
    """About n_tokens of text: a slice of stdlib source (code) or a run of multilingual words."""
    if style == "code":
        start = rng.randrange(len(CODE) - 200)
        lines = []
        while len(tok.backend.encode("".join(lines)).ids) < n_tokens:
            lines.append(CODE[start + len(lines)])
        return "".join(lines)
    words: list[str] = []
    while len(tok.backend.encode(" ".join(words)).ids) < n_tokens:
        words.append(rng.choice(MULTILINGUAL))
    return " ".join(words)


def conversation(turns: int, tok, style: str, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are a research agent."},
            {"role": "user", "content": "Find everything about token-in token-out rollouts."}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": "", "reasoning_content": f"Step {t}: search again.",
                     "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": f"q{t}"}}}]})
        msgs.append({"role": "tool", "content": tool_result(rng, 150, tok, style)})
    return msgs


def timeit(fn, min_time: float = 0.2) -> float:
    """Seconds per call: run fn enough times to last min_time."""
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return elapsed / n
        n *= 2


def measure(r, hf, tok, turns: int, repeats: int, style: str) -> tuple:
    """One row of the table: medians over `repeats` rounds for a conversation of `turns` tool turns."""
    msgs = conversation(turns, tok, style)
    hist, last = msgs[:-1], msgs[-1]
    template = r.tokenizer.chat_template
    prompt = r.render_ids(hist[:-1], TOOLS, add_generation_prompt=True)
    turn = r.render_ids(hist, TOOLS)[len(prompt):]
    completion = turn[: max(i for i, t in enumerate(turn) if t in r.stop_token_ids) + 1]  # through its stop token
    n_tokens = len(r.render_ids(msgs, TOOLS))

    def ref():
        return hf(hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, chat_template=template),
                  add_special_tokens=False)["input_ids"]

    assert r.render_ids(msgs, TOOLS) == ref(), "parity broken: benchmark would be meaningless"
    assert isinstance(r.bridge(prompt, completion, [last], TOOLS), renderers.Bridged)

    def cold():  # nothing cached: every run of text is encoded
        clear_caches()
        r.render(msgs, TOOLS)

    def warm():  # the same prompt again, as for each rollout of a GRPO group
        r.render(msgs, TOOLS)

    rng = random.Random(1)
    pool = [{"role": "tool", "content": tool_result(rng, 150, tok, style)} for _ in range(64)]
    fresh_results = iter([dict(m, content=f"[{i}] {m['content']}") for i in range(100_000) for m in pool[i % 64 : i % 64 + 1]])

    def bridge_cold():  # a tool result never seen before (the template's scaffold stays cached)
        r.bridge(prompt, completion, [next(fresh_results)], TOOLS)

    def encode_only():  # the tokenizer's own cost for the tool result's text, for scale
        tok.backend.encode("\n" + last["content"] + "\n", add_special_tokens=False)

    times = {f: [] for f in (ref, cold, warm, bridge_cold, encode_only)}
    for _ in range(repeats):
        for f in times:
            times[f].append(timeit(f))
    med = {f.__name__: statistics.median(t) for f, t in times.items()}
    return (turns, n_tokens, n_tokens / med["ref"], n_tokens / med["cold"], n_tokens / med["warm"],
                 med["ref"] / med["cold"], med["ref"] / med["warm"], med["bridge_cold"] * 1e3,
                 med["encode_only"] * 1e3)


# Other families at 10 tool turns: (label, fixture tokenizer, renderer name or None for the hash's choice)
FAMILIES = (
    ("qwen3 (hand-coded)", "qwen3-0.6b", None),
    ("qwen3 template, generic renderer", "qwen3-0.6b", "generic"),
    ("llama 3.1", "llama-3.1-8b-instruct", None),
    ("gpt-oss (harmony)", "gpt-oss-20b", None),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write", help="replace the render section of this markdown file with the table")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    def load(fixture: str):
        path = Path(args.fixtures) / "tokenizers" / fixture
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True), renderers.load_tokenizer(path)

    hf, tok = load("qwen3-0.6b")
    r = renderers.create_renderer(tok)

    tables = []
    for style, title in (("code", "code and JSON tool results (ASCII)"), ("multilingual", "multilingual tool results")):
        rows = [measure(r, hf, tok, turns, args.repeats, style) for turns in (1, 10, 30)]
        tables.append(f"### {title}\n\n" + format_table(rows))
    family_rows = []
    for label, fixture, name in FAMILIES:
        hf_f, tok_f = load(fixture)
        r_f = renderers.create_renderer(tok_f, name=name)
        family_rows.append((label, r_f.name, measure(r_f, hf_f, tok_f, 10, args.repeats, "code")))
    tables.append("### families, 10 tool turns of code tool results\n\n" + format_family_table(family_rows))
    table = "\n\n".join(tables)
    print(table)
    if args.write:
        write_section(Path(args.write), table, args.repeats)


def format_table(rows: list[tuple]) -> str:
    lines = [
        "| tool turns | tokens | reference tok/s | tito cold tok/s | tito warm tok/s | speed-up cold | speed-up warm "
        "| bridge, 150-token tool result (ms) | tokenizer encode of that result alone (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for turns, n, ref_tps, cold_tps, warm_tps, r_cold, r_warm, br_ms, enc_ms in rows:
        lines.append(f"| {turns} | {n} | {ref_tps:,.0f} | {cold_tps:,.0f} | {warm_tps:,.0f} | {r_cold:.2f}x "
                     f"| {r_warm:.2f}x | {br_ms:.3f} | {enc_ms:.3f} |")
    return "\n".join(lines)


def format_family_table(rows: list[tuple]) -> str:
    lines = [
        "| template | renderer | tokens | speed-up cold | speed-up warm | bridge (ms) | bridge vs hand-coded qwen3 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = rows[0][2][7]  # the hand-coded Qwen3 bridge
    for label, name, (_turns, n, _ref, _cold, _warm, r_cold, r_warm, br_ms, _enc) in rows:
        lines.append(f"| {label} | `{name}` | {n} | {r_cold:.2f}x | {r_warm:.2f}x | {br_ms:.3f} | {br_ms / base:.2f}x |")
    return "\n".join(lines)


def write_section(path: Path, table: str, repeats: int) -> None:
    begin, end = markers("bench_render")
    body = (
        f"{begin}\n## Render and bridge\n\n"
        f"Command: `.venv/bin/python scripts/bench_render.py --write docs/benchmarks.md`  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d')}; median of {repeats} rounds.  \n"
        "Reference: transformers `apply_chat_template(tokenize=False)` + `tokenizer(text, add_special_tokens=False)`. "
        "tito render returns ids plus per-token attribution; the bridge appends one tool result and the "
        "generation prompt to the full history.\n\n"
        f"{table}\n{end}"
    )
    replace_section(path, "bench_render", body)


if __name__ == "__main__":
    main()
