"""The HTML sample viewer, built from real shards: a two-segment rollout written by the real renderer
service (Qwen3: the first completion stops inside its reasoning, so the next turn breaks), parsed back
with html.parser. Every token is there with its id, logprob, message and turn; message colours are
distinct; the break sits at its position; text that looks like HTML stays text."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from rollout.data import open_shards
from rollout.data.viewer import token_texts, write_viewer
from rollout.renderer_service import RendererService
from rollout.turns import RolloutMeta, SampledTurn

from ._support import REPO, ours, tokenizer_dir

QWEN3 = "qwen3-0.6b"
USER = 'Say <script>alert(1)</script> "quoted" & it\'s héllo 日本語 🎉'


class Page(HTMLParser):
    """Collects each section's token spans (attributes, text), break markers (with the number of tokens
    before them), notes, the CSS and the script tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: dict[str, dict] = {}
        self.scripts = 0
        self.css = ""
        self.options: list[str] = []
        self._sec: dict | None = None
        self._span: dict | None = None
        self._tag: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._tag = tag
        if tag == "script":
            self.scripts += 1
        if tag == "option":
            self.options.append(a.get("value", ""))
        if tag == "section":
            self._sec = self.sections[a["id"]] = {"attrs": a, "tokens": [], "breaks": [], "starts": []}
        elif tag == "span" and self._sec is not None:
            cls = a.get("class", "").split()
            if "t" in cls:
                self._span = {"cls": cls, **a, "text": ""}
                self._sec["tokens"].append(self._span)
            elif "brk" in cls:
                self._sec["breaks"].append({**a, "at": len(self._sec["tokens"])})
        elif tag == "p" and self._sec is not None and "brk-start" in a.get("class", ""):
            self._sec["starts"].append("")

    def handle_endtag(self, tag):
        if tag == "span":
            self._span = None
        elif tag == "section":
            self._sec = None
        self._tag = None

    def handle_data(self, data):
        if self._span is not None:
            self._span["text"] += data
        elif self._tag == "style":
            self.css += data
        elif self._sec is not None and self._sec["starts"] and self._tag == "p":
            self._sec["starts"][-1] += data


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A real rollout: turn 0 stops inside <think> (a Break), turn 1 answers with HTML-looking text."""
    out = tmp_path_factory.mktemp("shards")
    tokdir = str(tokenizer_dir(QWEN3))
    svc = RendererService(tokdir, out_dir=str(out), rows_per_file=100, model_name=tokdir)
    tok, r = svc.tokenizer, svc.renderer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}]
    prompt = svc.begin("r0", msgs, None).ids
    c0 = tok.encode("<think>\nhmm<|im_end|>")
    lp0 = [-0.05 * (i + 1) for i in range(len(c0))]
    p0 = r.parse_response(c0, prompt, None).to_message()
    again = {"role": "user", "content": "again"}
    nxt = svc.extend("r0", SampledTurn(0, c0, lp0, 0, p0), [again])
    assert nxt.kind == "render" and nxt.brk is not None  # the Break this test is about
    ids = nxt.ids
    c1 = tok.encode("<think>\nok</think>\n\n<script>x</script> 🎉<|im_end|>")
    lp1 = [-1.5 / (i + 1) for i in range(len(c1))]
    p1 = r.parse_response(c1, ids, None).to_message()
    meta = RolloutMeta(task_id="t0", group_id="g0", reward=1.0, finish_reason="no_tool_call",
                       messages=msgs + [p0, again, p1])
    assert svc.finish("r0", meta, last_turn=SampledTurn(1, c1, lp1, 0, p1)) == 2
    svc.close()
    rows = open_shards(out).to_table().to_pylist()
    assert [row["segment_index"] for row in rows] == [0, 1]
    return out, rows


@pytest.fixture(scope="module")
def page(shards, tmp_path_factory):
    out, _ = shards
    html_file = tmp_path_factory.mktemp("html") / "view.html"
    assert write_viewer(out, html_file, tokenizer=ours(QWEN3)) == 2  # loaded once per session, as in tito
    source = html_file.read_text(encoding="utf-8")
    parsed = Page()
    parsed.feed(source)
    return source, parsed


def test_every_token_with_its_id_logprob_message_and_turn(shards, page):
    _, rows = shards
    _, parsed = page
    assert parsed.options == ["s0", "s1"]
    for i, row in enumerate(rows):
        spans = parsed.sections[f"s{i}"]["tokens"]
        assert [int(s["data-id"]) for s in spans] == row["token_ids"]
        assert [int(s["data-m"]) for s in spans] == row["message_index"]
        assert [int(s["data-t"]) for s in spans] == row["turn_index"]
        for s, sampled, lp in zip(spans, row["loss_mask"], row["logprobs"]):
            assert ("s" in s["cls"]) == sampled
            if sampled:
                assert math.isclose(float(s["data-lp"]), lp, rel_tol=1e-3)
            else:
                assert "data-lp" not in s
        # the pieces join to exactly the decoded sample (multi-byte characters kept whole)
        assert "".join(s["text"] for s in spans) == ours(QWEN3).decode(row["token_ids"])
        roles = json.loads(parsed.sections[f"s{i}"]["attrs"]["data-roles"])
        assert roles == [m["role"] for m in json.loads(row["messages"])]


def test_message_colours_are_distinct_and_scaffolding_differs(shards, page):
    _, rows = shards
    _, parsed = page
    colour = dict(re.findall(r"\.(m\d+|sc)\{background:(#[0-9a-f]{6})", parsed.css))
    for i in range(len(rows)):
        spans = parsed.sections[f"s{i}"]["tokens"]
        by_message: dict[int, set[str]] = {}
        for s in spans:
            cls = next(c for c in s["cls"] if c == "sc" or re.fullmatch(r"m\d+", c))
            by_message.setdefault(int(s["data-m"]), set()).add(colour[cls])
        assert all(len(c) == 1 for c in by_message.values()), by_message  # one colour per message
        used = [next(iter(c)) for c in by_message.values()]
        assert len(set(used)) == len(used) >= 3, by_message  # distinct across messages (scaffolding included)
        assert -1 in by_message


def test_the_break_is_marked_at_its_position(shards, page):
    _, rows = shards
    _, parsed = page
    brk = json.loads(rows[0]["breaks"])
    assert len(brk) == 1 and brk[0]["reason"] == "stop_inside_reasoning"
    first = parsed.sections["s0"]
    assert [(b["data-reason"], b["at"], b["title"]) for b in first["breaks"]] == [
        ("stop_inside_reasoning", brk[0]["position"], brk[0]["detail"])]
    assert first["tokens"][brk[0]["position"] - 1]["data-id"] == str(rows[0]["token_ids"][brk[0]["position"] - 1])
    second = parsed.sections["s1"]
    assert not second["breaks"] and len(second["starts"]) == 1 and "stop_inside_reasoning" in second["starts"][0]


def test_html_looking_text_is_escaped(shards, page):
    source, parsed = page
    assert parsed.scripts == 1  # the page's own script; no token text became a tag
    assert "<script>alert" not in source and "<script>x" not in source
    texts = "".join(s["text"] for sec in parsed.sections.values() for s in sec["tokens"])
    assert USER in texts and "<script>x</script> 🎉" in texts
    assert not re.search(r"\b(src|href)\s*=|<link|@import|url\(", source)  # self-contained: nothing fetched


def test_page_size_per_token_is_small(shards, page):
    _, rows = shards
    source, _ = page
    tokens = sum(len(r["token_ids"]) for r in rows)
    assert len(source.encode()) - 8000 < 120 * tokens  # page chrome (CSS, JS) plus ~80-100 bytes a token


def test_without_a_tokenizer_ids_are_shown(shards, tmp_path):
    out, rows = shards
    html_file = tmp_path / "ids.html"
    write_viewer(out, html_file, start=1, limit=5, tokenizer=None)
    parsed = Page()
    parsed.feed(html_file.read_text(encoding="utf-8"))
    assert list(parsed.sections) == ["s1"]
    assert [s["text"] for s in parsed.sections["s1"]["tokens"]] == [f"[{t}]" for t in rows[1]["token_ids"]]


def test_token_texts_join_to_the_decoded_text():
    tok = ours(QWEN3)
    text = "naïve 日本語 🎉🎉 <|im_end|> ok\n\tdone"
    ids = tok.encode(text)
    pieces = token_texts(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids)
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.slow
def test_tito_inspect_html_and_bad_sample(shards, tmp_path, capsys):
    out, _ = shards
    target = tmp_path / "one.html"
    cmd = [sys.executable, "-m", "rollout.cli", "inspect", str(out), "--html", str(target), "--sample", "1",
           "--limit", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 samples from row 1 written to" in done.stdout
    parsed = Page()
    parsed.feed(target.read_text(encoding="utf-8"))
    assert list(parsed.sections) == ["s1"]
    from rollout.cli.main import main

    bad = tmp_path / "bad.html"  # the same command line in this process: a clear error and no file
    assert main(["inspect", str(out), "--html", str(bad), "--sample", "7"]) == 2
    assert "sample 7 is out of range: the shards hold 2 rows" in capsys.readouterr().err and not bad.exists()


def test_terminal_sample_has_no_ansi_outside_a_terminal(shards):
    from rollout.data.inspect_shards import inspect

    out, rows = shards
    plain = inspect(out, sample=1, tokenizer=ours(QWEN3))  # stdout here is pytest's capture: not a terminal
    assert "\x1b" not in plain and "trainable tokens between [[ and ]]" in plain
    sampled = [t for t, m in zip(rows[1]["token_ids"], rows[1]["loss_mask"]) if m]
    assert f"[[{ours(QWEN3).decode(sampled)}]]" in plain  # the one sampled run of segment 2, marked
    assert "\x1b[42;30m" in inspect(out, sample=1, tokenizer=ours(QWEN3), color=True)
