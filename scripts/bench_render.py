"""Render and bridge speed against transformers' apply_chat_template and PyPI renderers 0.1.12, in one run.

    .venv/bin/python scripts/bench_render.py [--fixtures DIR] [--repeats 7] [--no-pypi] [--write docs/benchmarks.md]

Agent conversations with 1, 10 and 30 tool turns (each: an assistant turn with reasoning and a tool
call, then a ~150-token tool result) on the Qwen3 tokenizer, then 10 tool turns on other families
(Llama 3.1, gpt-oss) and on the Qwen3 template through the generic renderer. For each size it times

- reference: ``apply_chat_template(tokenize=True)``
- tito render, cold: ``Renderer.render`` (ids + attribution) of never-seen content (every message's
  text made unique per call), with tito's caches of encoded text emptied first (``clear_caches()``:
  what stays is the template's own strings, split on added tokens and encoded, as transformers keeps
  its compiled template)
- tito render, warm: the same conversation again (each rollout of a GRPO group renders the same prompt)
- tito bridge: appending one never-seen ~150-token tool result to the history (flat in its length)
- PyPI ``renderers==0.1.12`` (Qwen3 only): cold render and ``bridge_to_next_turn`` on the same kind of
  content, in its own venv (the one tests/test_serve_embedded.py builds), next to transformers timed in
  that process

Each figure is the median of ``--repeats`` rounds; a round times enough calls to last ~0.15 s, and the
reference's rounds alternate with tito's. The machine is shared and noisy, so the ratios (each the
median of the rounds' ratios) are the figures to read.
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

import tito_renderers as renderers  # noqa: E402
from tito_renderers.pieces import clear_caches  # noqa: E402

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


def unique(msgs: list[dict], tag: str) -> list[dict]:
    """The conversation with every message's text made unique: no cache anywhere can help."""
    return [dict(m, content=f"[{tag}] {m['content']}") if m.get("content") else m for m in msgs]


def interleaved(fns: dict, inputs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``rounds`` rounds, every call on its own input, the
    functions' rounds interleaved (their order alternating): a ratio taken round by round sees the same
    machine on both sides, which the shared box's load otherwise moves by 20% between minutes."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for k in range(rounds):
        for name in list(fns) if k % 2 == 0 else list(reversed(fns)):
            n = len(inputs[name]) // rounds
            chunk = inputs[name][k * n : (k + 1) * n]
            t0 = time.perf_counter()
            for x in chunk:
                fns[name](x)
            times[name].append((time.perf_counter() - t0) / n)
    return times


def calls_for(fn, x, budget: float = 0.15) -> int:
    """How many calls of ``fn`` fill a round of ~budget seconds (at least 3)."""
    t0 = time.perf_counter()
    fn(x)
    return max(3, min(400, int(budget / max(time.perf_counter() - t0, 1e-6))))


def measure(r, hf, tok, turns: int, repeats: int, style: str, pypi: dict | None = None) -> dict:
    """One row: medians over ``repeats`` rounds, for a conversation of ``turns`` tool turns, every call
    on never-seen content (and tito's encoding caches emptied before each cold render)."""
    msgs = conversation(turns, tok, style)
    hist, last = msgs[:-1], msgs[-1]
    template = r.tokenizer.chat_template
    prompt = r.render_ids(hist[:-1], TOOLS, add_generation_prompt=True)
    turn = r.render_ids(hist, TOOLS)[len(prompt):]
    completion = turn[: max(i for i, t in enumerate(turn) if t in r.stop_token_ids) + 1]  # through its stop token
    n_tokens = len(r.render_ids(msgs, TOOLS))

    def ref(m):
        out = hf.apply_chat_template(m, tools=TOOLS, tokenize=True, chat_template=template)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    assert r.render_ids(msgs, TOOLS) == ref(msgs), "parity broken: benchmark would be meaningless"
    assert isinstance(r.bridge(prompt, completion, [last], TOOLS), renderers.Bridged)

    def cold(m):
        clear_caches()
        r.render(m, TOOLS)

    def bridge(m):
        r.bridge(prompt, completion, m, TOOLS)

    def bridge_ids(m):  # and the whole next prompt read from it (a copy of the history)
        return r.bridge(prompt, completion, m, TOOLS).token_ids

    n_render = calls_for(ref, msgs) * repeats
    n_ours = calls_for(cold, msgs) * repeats
    convs = [unique(msgs, f"{style}{turns}.{i}") for i in range(max(n_render, n_ours))]
    rng = random.Random(1)
    results = [[{"role": "tool", "content": f"[{i}] " + tool_result(rng, 150, tok, style)}] for i in range(64)]
    n_bridge = calls_for(bridge, results[0]) * repeats
    fresh = [[dict(results[i % 64][0], content=f"<{i}> {results[i % 64][0]['content']}")] for i in range(n_bridge)]
    fresh_ids = [[dict(m[0], content=f"ids {m[0]['content']}")] for m in fresh]
    for i in range(20):  # warm up (the first row would otherwise pay for it)
        cold(unique(msgs, f"warmup{i}"))
        bridge([dict(results[i][0], content=f"warmup{i}")])
    times = interleaved({"ref": ref, "cold": cold, "warm": lambda _m: r.render(msgs, TOOLS)},
                        {"ref": convs[:n_render], "cold": convs[:n_ours], "warm": [None] * n_ours}, repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    bridges = interleaved({"bridge": bridge, "bridge_ids": bridge_ids}, {"bridge": fresh, "bridge_ids": fresh_ids}, repeats)
    med.update({name: statistics.median(t) for name, t in bridges.items()})
    for side in ("cold", "warm"):  # HF over tito, round by round
        med[f"{side}_ratio"] = statistics.median(a / b for a, b in zip(times["ref"], times[side], strict=True))
    row = {"turns": turns, "tokens": n_tokens, **med}
    if pypi is not None:
        row["pypi"] = pypi_measure(pypi, msgs, last, style, turns, repeats)
    return row


# The PyPI `renderers` package, timed in its own venv (tests/test_serve_embedded.py builds it) on the same
# conversations, next to transformers in that process: its ratio to transformers is comparable with ours.
PYPI_SCRIPT = r"""
import json, statistics, sys, time
from renderers import Qwen3RendererConfig, create_renderer
from renderers.base import load_tokenizer
from transformers import AutoTokenizer
job = json.load(open(sys.argv[1]))
r = create_renderer(load_tokenizer(job["tokenizer"]), Qwen3RendererConfig())
hf = AutoTokenizer.from_pretrained(job["tokenizer"], local_files_only=True)
tools, rounds = job["tools"], job["rounds"]
def per_call(fn, inputs):
    n = len(inputs) // rounds
    out = []
    for k in range(rounds):
        chunk = inputs[k * n:(k + 1) * n]
        t0 = time.perf_counter()
        for x in chunk:
            fn(x)
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)
msgs = job["messages"]
hist = msgs[:-1]
prompt = r.render_ids(hist[:-1], tools=tools, add_generation_prompt=True)
turn = r.render_ids(hist, tools=tools)[len(prompt):]
stops = set(r.get_stop_token_ids())
completion = turn[: max(i for i, t in enumerate(turn) if t in stops) + 1]
assert r.render_ids(msgs, tools=tools) == hf.apply_chat_template(msgs, tools=tools, tokenize=True)["input_ids"]
res = {
    "ref": per_call(lambda m: hf.apply_chat_template(m, tools=tools, tokenize=True), job["convs"]),
    "cold": per_call(lambda m: r.render(m, tools=tools), job["convs"]),
    "bridge": per_call(lambda m: r.bridge_to_next_turn(prompt, completion, m, tools=tools), job["fresh"]),
}
print(json.dumps(res))
"""


def pypi_measure(pypi: dict, msgs, last, style: str, turns: int, repeats: int) -> dict | None:
    import json
    import subprocess
    import tempfile

    n = 40 * repeats if turns < 30 else 12 * repeats
    job = {"tokenizer": pypi["tokenizer"], "tools": TOOLS, "rounds": repeats,
           "messages": [dict(m) for m in msgs],
           "convs": [unique(msgs, f"pypi{style}{turns}.{i}") for i in range(n)],
           "fresh": [[dict(last, content=f"<{i}> {last['content']}")] for i in range(n * 4)]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run([pypi["python"], "-I", "-c", PYPI_SCRIPT, f.name], capture_output=True, text=True,
                          env=env, timeout=1800)
    os.unlink(f.name)
    if done.returncode != 0:
        print(f"renderers (PyPI) failed: {done.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


# Other families at 10 tool turns: (label, fixture tokenizer, renderer name or None for the hash's choice)
FAMILIES = (
    ("qwen3 (hand-coded)", "qwen3-0.6b", None),
    ("qwen3 template, generic renderer", "qwen3-0.6b", "generic"),
    ("llama 3.1", "llama-3.1-8b-instruct", None),
    ("gpt-oss (harmony)", "gpt-oss-20b", None),
)


def pypi_python() -> str | None:
    """The interpreter of the venv holding renderers==0.1.12 (built by tests/test_serve_embedded.py)."""
    cache = Path(os.environ.get("TITO_CACHE") or "~/.cache/tito").expanduser()
    python = cache / "venvs" / "renderers-0.1.12" / "bin" / "python"
    return str(python) if python.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write", help="replace the render section of this markdown file with the table")
    ap.add_argument("--no-pypi", action="store_true", help="skip renderers==0.1.12 (PyPI)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    def load(fixture: str):
        path = Path(args.fixtures) / "tokenizers" / fixture
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True), renderers.load_tokenizer(path)

    hf, tok = load("qwen3-0.6b")
    r = renderers.create_renderer(tok)
    python = None if args.no_pypi else pypi_python()
    pypi = {"python": python, "tokenizer": str(Path(args.fixtures) / "tokenizers" / "qwen3-0.6b")} if python else None
    if not args.no_pypi and python is None:
        print("renderers==0.1.12 venv not found (run tests/test_serve_embedded.py once): skipped", file=sys.stderr)

    tables = []
    for style, title in (("code", "code and JSON tool results (ASCII)"), ("multilingual", "multilingual tool results")):
        rows = [measure(r, hf, tok, turns, args.repeats, style, pypi) for turns in (1, 10, 30)]
        tables.append(f"### Qwen3, {title}\n\n" + format_table(rows))
        print(tables[-1], flush=True)
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


def format_table(rows: list[dict]) -> str:
    lines = [
        "| tool turns | tokens | HF apply_chat_template (ms) | tito cold (ms) | tito warm (ms) | tito cold vs HF "
        "| renderers 0.1.12 cold vs HF | tito bridge (ms) | tito bridge + token_ids (ms) | renderers 0.1.12 bridge (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        p = row.get("pypi")
        pypi_ratio = f"{p['ref'] / p['cold']:.2f}x" if p else "-"
        pypi_bridge = f"{p['bridge'] * 1e3:.3f}" if p else "-"
        lines.append(f"| {row['turns']} | {row['tokens']} | {row['ref'] * 1e3:.3f} | {row['cold'] * 1e3:.3f} "
                     f"| {row['warm'] * 1e3:.3f} | {row['cold_ratio']:.2f}x | {pypi_ratio} "
                     f"| {row['bridge'] * 1e3:.3f} | {row['bridge_ids'] * 1e3:.3f} | {pypi_bridge} |")
    return "\n".join(lines)


def format_family_table(rows: list[tuple]) -> str:
    lines = [
        "| template | renderer | tokens | tito cold vs HF | tito warm vs HF | bridge (ms) | bridge vs hand-coded qwen3 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = rows[0][2]["bridge"]  # the hand-coded Qwen3 bridge
    for label, name, row in rows:
        lines.append(f"| {label} | `{name}` | {row['tokens']} | {row['cold_ratio']:.2f}x "
                     f"| {row['warm_ratio']:.2f}x | {row['bridge'] * 1e3:.3f} | {row['bridge'] / base:.2f}x |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's name (ratios to transformers differ between CPU models as much as between runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_section(path: Path, table: str, repeats: int) -> None:
    begin, end = markers("bench_render")
    body = (
        f"{begin}\n## Render and bridge\n\n"
        f"Command: `.venv/bin/python scripts/bench_render.py --repeats {repeats} --write docs/benchmarks.md`  \n"
        f"Machine: {cpu_model()}, {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d')}; median of {repeats} rounds, transformers' and tito's rounds interleaved "
        "(a ratio is the median of the rounds' ratios).  \n"
        "Reference: transformers `apply_chat_template(tokenize=True)`, and the PyPI `renderers==0.1.12` package "
        "(its own venv, in a subprocess; its ratio is to transformers timed in that process). Cold: every call "
        "renders never-seen content (each message's text made unique) and tito's caches of encoded text are "
        "emptied first (the template's own strings stay split and encoded, as transformers keeps its compiled "
        "template); warm: the same conversation again. tito render returns ids plus per-token attribution; the "
        "bridge appends one never-seen ~150-token tool result and the generation prompt to the history; it keeps "
        "the history by reference, and `Bridged.token_ids` (the whole next prompt, a copy of the history) is built "
        "when first read: the bridge + token_ids column times both.\n\n"
        f"{table}\n{end}"
    )
    replace_section(path, "bench_render", body)


if __name__ == "__main__":
    main()
