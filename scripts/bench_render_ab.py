"""A renderer change against a git revision, in one process: identical output on every family, then speed.

    .venv/bin/python scripts/bench_render_ab.py --base REV [--fixtures DIR] [--rounds 9] [--bridge] [--identity-only | --timing-only]

The revision's ``renderers/`` is extracted with ``git archive`` into a temporary directory and imported
under another name next to the working tree's ``tito_renderers``.

1. Identity: for every fixture family (each tokenizer fixture with the renderer its template selects
   and with the generic renderer; the template-only fixtures on the vocabulary tests/ pairs them
   with, reconstructed ones included), both sides render the same conversations (plain chat, tool
   turns, with and without the generation prompt) and bridge the same turns (a tool result, a user
   message, a cut-off completion). Ids, message indices, sampled mask and content flags must be
   equal, and a Break or an error must be the same. One line per family; any difference exits 1.
2. Speed (Qwen3 only): both render the same never-seen conversations of bench_render.py (1 / 10 /
   30 tool turns, code and multilingual tool results), alternating which goes first each round.
   Prints each side's median ms per call and base / working tree. On a shared machine, only the
   ratio is worth reading: both sides see the same noise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))  # tests.reconstructed builds the template-only families' tokenizers

import bench_render as bench  # noqa: E402

import tito_renderers  # noqa: E402


def load_base(rev: str, where: Path):
    """The revision's renderers package, imported as ``base_renderers``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "renderers"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "renderers").rename(where / "base_renderers")
    sys.path.insert(0, str(where))
    return importlib.import_module("base_renderers")


def interleaved(fns: dict, inputs: list, per_round: int, rounds: int) -> dict[str, float]:
    """Median ms per call of each function, every call on its own input, the order alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    i = 0
    for k in range(rounds):
        for name in (list(fns) if k % 2 == 0 else list(reversed(fns))):
            chunk = inputs[i * per_round : (i + 1) * per_round]
            i += 1
            t0 = time.perf_counter()
            for x in chunk:
                fns[name](x)
            times[name].append((time.perf_counter() - t0) / per_round * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--bridge", action="store_true", help="time bridges instead of cold renders")
    ap.add_argument("--identity-only", action="store_true", help="check identical output on every family; no timing")
    ap.add_argument("--timing-only", action="store_true", help="skip the families' identity check (Qwen3's still runs)")
    args = ap.parse_args()
    path = Path(args.fixtures) / "tokenizers" / "qwen3-0.6b"
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"base": load_base(args.base, Path(tmp)), "tree": tito_renderers}
        if not args.timing_only and not same_on_every_family(modules, Path(args.fixtures)):
            raise SystemExit(1)
        if args.identity_only:
            return
        sides = {}
        for name, module in modules.items():
            tok = module.load_tokenizer(path)
            clear = importlib.import_module(module.__name__ + ".pieces").clear_caches
            sides[name] = (tok, module.create_renderer(tok), clear)
        tok0, r0, _ = sides["base"]
        for style in ("code", "multilingual"):
            for turns in (1, 10, 30):
                msgs = bench.conversation(turns, tok0, style)
                if args.bridge:
                    fns, inputs, n = bridges(sides, r0, tok0, msgs, style, args.rounds)
                else:
                    n = {1: 200, 10: 60, 30: 25}[turns]
                    inputs = [bench.unique(msgs, f"ab{i}") for i in range(n * (2 * args.rounds + 1))]
                    fns = {name: (lambda m, r=r, clear=clear: (clear(), r.render(m, bench.TOOLS)))
                           for name, (_, r, clear) in sides.items()}
                    for fn in fns.values():  # warm up on inputs no round uses
                        for m in inputs[-n:]:
                            fn(m)
                same_output(fns, inputs[-n:])
                med = interleaved(fns, inputs, n, args.rounds)
                print(f"{style:12s} {turns:2d} turns: base {med['base']:.4f} ms, tree {med['tree']:.4f} ms "
                      f"({med['base'] / med['tree']:.2f}x)", flush=True)


# Template-only fixtures and the tokenizer fixture of their vocabulary (as tests/ pair them).
TEMPLATE_ON = {
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama-3.1-8b-instruct",
    "nvidia-Llama-3_3-Nemotron-Super-49B-v1_5.jinja": "llama-3.1-8b-instruct",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek-r1",
    "Qwen-Qwen3.5-4B.jinja": "qwen3-0.6b",
}


def families(fixtures: Path) -> list[tuple[str, Path, str | None, str | None]]:
    """(label, tokenizer directory, template file or None, renderer name or None: chosen by the
    template) for every family the fixtures hold."""
    out: list[tuple[str, Path, str | None, str | None]] = []
    for d in sorted((fixtures / "tokenizers").iterdir()):
        out += [(d.name, d, None, None), (f"{d.name} (generic)", d, None, "generic")]
    for template, vocab in TEMPLATE_ON.items():
        out.append((template.removesuffix(".jinja"), fixtures / "tokenizers" / vocab, str(fixtures / "templates" / template), None))
    from tests import reconstructed  # builds into ~/.cache/tito once

    for name, spec in reconstructed.SPECS.items():
        if spec.template is None:  # Mistral's template is generated by mistral-common at test time
            continue
        built = reconstructed.build(reconstructed.VOCABULARY.get(name, name))
        out.append((f"{name} (reconstructed)", built, str(fixtures / "templates" / spec.template), None))
    return out


def identity_inputs(tools: list[dict]) -> list[tuple[list[dict], list[dict] | None]]:
    """Conversations every family is rendered with: a plain chat, a system prompt, and tool turns."""
    call = {"role": "assistant", "content": "", "reasoning_content": "I should search.",
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "tito"}}}]}
    plain = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4."},
             {"role": "user", "content": "And données 数据 🙂 <|im_end|> </think>?"}]
    system = [{"role": "system", "content": "You are terse."}, *plain]
    agent = [{"role": "system", "content": "You are a research agent."}, {"role": "user", "content": "Find tito."},
             call, {"role": "tool", "content": "def f(x):\n    return {\"a\": [1, 2]}\n"},
             {"role": "assistant", "content": "Found it: f returns a dict."}, {"role": "user", "content": "Thanks!"}]
    return [(plain, None), (system, None), (agent, tools)]


def _outcome(call) -> tuple:
    """What a render or bridge gave, as comparable values: its ids and attribution, a Break's reason,
    position and detail, or the error's type and message."""
    try:
        out = call()
    except Exception as exc:  # both sides must raise the same error
        return ("error", type(exc).__name__, str(exc))
    if hasattr(out, "reason"):
        return ("break", str(out.reason), out.position, out.detail)
    extra = (out.prefix_len, out.synthesized) if hasattr(out, "appended") else ()
    out = getattr(out, "appended", out)
    return (*extra, list(out.token_ids), list(out.message_indices), list(out.sampled_mask), list(out.is_content))


def _calls(r, msgs: list[dict], tools: list[dict] | None) -> list[tuple[str, object]]:
    """Renders of every prefix of ``msgs`` (a prompt before an assistant turn, else a conversation) and bridges from
    each prompt before an assistant turn: its sampled turn (as the template renders it, cut after its
    last stop id, or cut short) then the next message."""
    calls: list[tuple[str, object]] = []
    for k in range(1, len(msgs) + 1):  # a prompt before each assistant turn, each conversation through one
        agp = k < len(msgs) and msgs[k]["role"] == "assistant"
        calls.append((f"render {k} agp={agp}", lambda k=k, agp=agp: r.render(msgs[:k], tools, add_generation_prompt=agp)))
    for k, m in enumerate(msgs):
        if m["role"] != "assistant" or k + 1 >= len(msgs):
            continue
        try:
            prompt = r.render_ids(msgs[:k], tools, add_generation_prompt=True)
            turn = r.render_ids(msgs[: k + 1], tools)[len(prompt):]
        except Exception:
            continue  # both sides' renders are compared above
        stops = [i for i, t in enumerate(turn) if t in r.stop_token_ids]
        sampled = turn[: stops[-1] + 1] if stops else turn
        for label, completion in (("stopped", sampled), ("cut", sampled[: max(1, len(sampled) // 2)])):
            nxt = msgs[k + 1 : k + 2]
            calls.append((f"bridge after {k} ({label})", lambda p=prompt, c=completion, n=nxt: r.bridge(p, c, n, tools)))
    return calls


def same_on_every_family(modules: dict, fixtures: Path) -> bool:
    """Every family's renders and bridges agree between the sides; one line per family."""
    ok = True
    loaded: dict[tuple[str, Path], object] = {}
    for label, tok_dir, template, name in families(fixtures):
        renderers = {}
        for side, module in modules.items():
            key = (side, tok_dir)
            if key not in loaded:  # a vocabulary loads in seconds: once per side
                loaded[key] = module.load_tokenizer(tok_dir)
            tok = loaded[key]
            if template is not None:
                tok = tok.with_chat_template(Path(template).read_text(encoding="utf-8"), f"{tok.name_or_path} + {template}")
            try:
                renderers[side] = module.create_renderer(tok, name=name)
            except Exception as exc:
                renderers[side] = f"{type(exc).__name__}: {exc}"
        if any(isinstance(r, str) for r in renderers.values()):
            same = renderers["base"] == renderers["tree"]
            ok = ok and same
            print(f"identity {label:44s} {'same' if same else 'DIFFERENT'}: no renderer ({renderers['tree']})"[:200], flush=True)
            continue
        checked, differ = 0, []
        for msgs, tools in identity_inputs(TOOLS_FOR_IDENTITY):
            pairs = zip(*(_calls(r, msgs, tools) for r in (renderers["base"], renderers["tree"])))
            for (what, base_call), (_, tree_call) in pairs:
                checked += 1
                if _outcome(base_call) != _outcome(tree_call):
                    differ.append(what)
        ok = ok and not differ
        kind = type(renderers["tree"]).__name__
        status = "same" if not differ else f"DIFFERENT in {len(differ)}: {', '.join(differ[:4])}"
        print(f"identity {label:44s} {kind:26s} {checked:3d} calls {status}", flush=True)
    print(f"identity: {'identical ids, attribution and breaks on every family' if ok else 'DIFFERENCES (above)'}", flush=True)
    return ok


def same_output(fns: dict, inputs: list) -> None:
    """A speed-up that changes a token or its attribution is a bug: both sides must agree on every input."""
    for x in inputs:
        base, tree = (fns[name](x) for name in ("base", "tree"))
        base, tree = (out[-1] if isinstance(out, tuple) else out for out in (base, tree))  # a render: (None, tokens)
        for field in ("token_ids", "message_indices", "sampled_mask", "is_content"):
            got, want = (getattr(getattr(out, "appended", out), field) for out in (tree, base))
            if got != want:
                raise SystemExit(f"the working tree's {field} differ from the base revision's on {str(x)[:200]}")


TOOLS_FOR_IDENTITY = [{"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                       "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


def bridges(sides: dict, r0, tok0, msgs: list[dict], style: str, rounds: int):
    """Bridge calls appending one never-seen ~150-token tool result, as bench_render.py times them."""
    hist = msgs[:-1]
    prompt = r0.render_ids(hist[:-1], bench.TOOLS, add_generation_prompt=True)
    turn = r0.render_ids(hist, bench.TOOLS)[len(prompt):]
    completion = turn[: max(i for i, t in enumerate(turn) if t in r0.stop_token_ids) + 1]
    rng = random.Random(1)
    results = [{"role": "tool", "content": f"[{i}] " + bench.tool_result(rng, 150, tok0, style)} for i in range(64)]
    n = 1000
    inputs = [[dict(results[i % 64], content=f"<{i}> {results[i % 64]['content']}")] for i in range(n * (2 * rounds + 1))]
    fns = {name: (lambda m, r=r: r.bridge(prompt, completion, m, bench.TOOLS)) for name, (_, r, _) in sides.items()}
    for fn in fns.values():
        for m in inputs[-n:]:
            fn(m)
    return fns, inputs, n


if __name__ == "__main__":
    main()
