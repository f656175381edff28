"""``tito inspect DIR --html FILE``: one self-contained HTML page to read training samples token by token.

Every token is a ``<span>`` coloured by the message it belongs to (template scaffolding grey), sampled
tokens (``loss_mask``) underlined and bold; a toggle colours sampled tokens by the sampler's logprob
instead; hovering a token shows its id, decoded text, logprob, message index and role, and turn. A
break is marked where it cut the segment (``position``, else the segment's end) with its reason, and a
segment that a break started says so at its top. Prev/next buttons, a sample list and the arrow keys
move between samples.

The page is rendered here, not by script, so it reads without JavaScript (every sample one below the
other; the script shows one at a time and runs navigation, the heat toggle and the hover box) and tests can check it with an HTML parser. It carries no network
references. Size: about 80 bytes a token; ``limit`` (default 200 samples from ``start``) keeps a large
run's page small enough for a browser.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from .readers import open_shards, shard_files

# Distinct pastel backgrounds for message 0, 1, 2, ... (cycled); scaffolding (-1) is grey.
PALETTE = ["#cfe3ff", "#ffe0b3", "#d4f5d0", "#f6d0f0", "#fff3a8", "#d0f0f5", "#ffd6d6", "#e2d9ff",
           "#e8f5c8", "#ffe6f0", "#d9e8e0", "#f5e6d3"]
SCAFFOLD = "#e4e4e4"
# logprob heat: probability buckets 0-9 (p < 0.1 ... p >= 0.9), red to green
HEAT = ["#d73027", "#e8553a", "#f46d43", "#fa9a58", "#fdae61", "#fee08b", "#d9ef8b", "#a6d96a", "#66bd63", "#1a9850"]


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text, so that the pieces join to the decoded whole: a character whose bytes are
    split over several tokens goes to the last of them (the others get ""), and each token is decoded
    after a few tokens of context (decoders that drop a leading space on a lone token keep it)."""
    out = [""] * len(ids)
    start = 0  # first token whose text is not out yet
    for i in range(len(ids)):
        ctx = max(0, start - 4)
        before = tokenizer.decode(ids[ctx:start]) if start > ctx else ""
        full = tokenizer.decode(ids[ctx:i + 1])
        if full.endswith("\ufffd") and i + 1 - start < 4 and i + 1 < len(ids):
            continue  # an incomplete character: wait for its remaining bytes
        out[i] = full[len(before):] if full.startswith(before) else tokenizer.decode(ids[start:i + 1])
        start = i + 1
    return out


def _heat(logprob: float) -> int:
    return min(9, max(0, int(math.exp(min(logprob, 0.0)) * 10)))


def _attr(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _roles(row: dict) -> list[str]:
    try:
        messages = json.loads(row.get("messages") or "[]")
    except json.JSONDecodeError:
        return []
    return [str(m.get("role", "?")) if isinstance(m, dict) else "?" for m in messages]


def _break_marker(brk: dict, where: str) -> str:
    reason = str(brk.get("reason", "?"))
    detail = str(brk.get("detail") or "")
    return (f'<span class="brk" data-reason="{_attr(reason)}" data-turn="{_attr(brk.get("turn"))}" '
            f'data-where="{where}" title="{_attr(detail)}">break: {html.escape(reason)} (turn {_attr(brk.get("turn"))})'
            "</span>")


def sample_section(index: int, row: dict, tokenizer: Any | None) -> str:
    """One sample as a ``<section>``: header, legend, the token spans with break markers."""
    ids = list(row["token_ids"] or [])
    mask, lps = row["loss_mask"] or [], row["logprobs"] or []
    mis, tis = row["message_index"] or [], row["turn_index"] or []
    texts = token_texts(tokenizer, ids) if tokenizer is not None else [f"[{t}]" for t in ids]
    special = tokenizer.special_ids if tokenizer is not None else frozenset()
    roles = _roles(row)
    seg, segs = row.get("segment_index", 0), row.get("segment_count", 1)
    try:
        breaks = json.loads(row.get("breaks") or "[]")
    except json.JSONDecodeError:
        breaks = []
    # breaks[k] ended segment k and started segment k + 1 (a break always starts a new segment; one
    # after the last row's segment started a segment that never sampled a token, so was not written)
    ending = breaks[seg] if seg < len(breaks) else None
    started = breaks[seg - 1] if 0 < seg <= len(breaks) else None
    cut = len(ids)
    if ending is not None and isinstance(ending.get("position"), int):
        cut = min(max(ending["position"], 0), len(ids))

    parts: list[str] = []
    for i, tid in enumerate(ids):
        if i == cut and ending is not None:
            parts.append(_break_marker(ending, "position"))
        mi = mis[i] if i < len(mis) else -1
        cls = ["t", f"m{mi % len(PALETTE)}" if mi >= 0 else "sc"]
        attrs = f' data-id="{tid}" data-m="{mi}" data-t="{tis[i] if i < len(tis) else 0}"'
        if tid in special:
            cls.append("sp")
        if i < len(mask) and mask[i]:
            lp = float(lps[i]) if i < len(lps) else 0.0
            cls += ["s", f"h{_heat(lp)}"]
            attrs += f' data-lp="{lp:.4g}"'
        parts.append(f'<span class="{" ".join(cls)}"{attrs}>{html.escape(texts[i])}</span>')
    if ending is not None and cut == len(ids):
        parts.append(_break_marker(ending, "end"))

    sampled = sum(1 for m in mask if m)
    legend = "".join(
        f'<span class="sw m{k % len(PALETTE)}">{k} {html.escape(roles[k] if k < len(roles) else "?")}</span>'
        for k in sorted({m for m in mis if m >= 0}))
    legend += '<span class="sw sc">scaffolding</span><span class="sw s">sampled</span>'
    error = f'<p class="err">error: {html.escape(str(row["error"]))}</p>' if row.get("error") else ""
    head = (f"<h2>#{index} · rollout {html.escape(str(row.get('rollout_id')))} · segment {seg + 1}/{segs}</h2>"
            f"<p class=meta>task {html.escape(str(row.get('task_id')))} · reward {float(row.get('reward') or 0):.3f} · "
            f"advantage {float(row.get('advantage') or 0):.3f} · finish {html.escape(str(row.get('finish_reason')))} · "
            f"{len(ids)} tokens, {sampled} sampled · model {html.escape(str(row.get('model')))} · renderer "
            f"{html.escape(str(row.get('renderer')))} · weights v{row.get('weight_version', 0)}</p>{error}")
    top = ""
    if started is not None:
        top = (f'<p class="brk-start">this segment starts after a break at turn {_attr(started.get("turn"))}: '
               f'{html.escape(str(started.get("reason")))} — {html.escape(str(started.get("detail") or ""))}</p>')
    return (f'<section class="sample" id="s{index}" data-roles="{_attr(json.dumps(roles))}">{head}'
            f'<p class="legend">{legend}</p>{top}<pre class="tokens">{"".join(parts)}</pre></section>')


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:.5em 1em;display:flex;gap:.6em;
align-items:center;flex-wrap:wrap;z-index:2}
header h1{font-size:16px;margin:0 1em 0 0}header select{max-width:46em}
main{padding:0 1.2em 2em}h2{font-size:15px;margin:.8em 0 .2em}.meta{margin:.2em 0;color:#444}
.err{color:#b00020;margin:.2em 0}
pre.tokens{white-space:pre-wrap;word-break:break-word;font:13px/1.7 ui-monospace,Menlo,Consolas,monospace;
background:#fff;border:1px solid #ddd;padding:.8em;margin:.4em 0}
.t{border-radius:2px}.t:hover,.t.pin{outline:2px solid #333}
.sc{background:SCAFFOLD;color:#666}.sp{font-weight:700}
.s{font-weight:700;border-bottom:2px solid #1a5fb4}
.heat .t{background:transparent!important;color:#999}.heat .t.s{color:#000;border-bottom-color:transparent}
.brk{background:#b00020;color:#fff;font:700 12px system-ui,sans-serif;padding:1px 6px;margin:0 3px;border-radius:3px}
.brk-start{background:#fde7ea;border-left:4px solid #b00020;padding:.3em .6em;margin:.3em 0}
.legend .sw{display:inline-block;padding:0 6px;margin-right:4px;border-radius:3px;font-size:12px}
.legend .sw.s{background:#fff}
#heatkey{display:none;font-size:12px;color:#444}.heat #heatkey{display:inline}
#heatkey i{display:inline-block;width:12px;height:12px;vertical-align:middle}
#tip{position:fixed;display:none;background:#222;color:#fff;font:12px/1.4 ui-monospace,monospace;padding:6px 8px;
border-radius:4px;pointer-events:none;white-space:pre;z-index:3;max-width:60em}
"""

_JS = """
const secs=[...document.querySelectorAll('section.sample')];const pick=document.getElementById('pick');
const heat=document.getElementById('heat');const tip=document.getElementById('tip');
let cur=0;
function show(i,keep){if(!secs.length)return;cur=Math.max(0,Math.min(secs.length-1,i));
secs.forEach((s,k)=>s.hidden=k!==cur);pick.selectedIndex=cur;if(!keep)history.replaceState(null,'','#'+secs[cur].id);}
document.getElementById('prev').onclick=()=>show(cur-1);document.getElementById('next').onclick=()=>show(cur+1);
pick.onchange=()=>show(pick.selectedIndex);
heat.onchange=()=>document.body.classList.toggle('heat',heat.checked);
document.addEventListener('keydown',e=>{if(e.target.tagName==='SELECT')return;
if(e.key==='ArrowLeft')show(cur-1);if(e.key==='ArrowRight')show(cur+1);});
function describe(t){const roles=JSON.parse(t.closest('section').dataset.roles||'[]');const m=+t.dataset.m;
const lp=t.dataset.lp;return ['id '+t.dataset.id+'   text '+JSON.stringify(t.textContent),
lp!==undefined?'logprob '+lp+'   p '+Math.exp(+lp).toFixed(3)+'   (sampled)':'context (not sampled)',
(m<0?'template scaffolding':'message '+m+' ('+(roles[m]||'?')+')')+'   turn '+t.dataset.t].join('\\n');}
document.addEventListener('mouseover',e=>{const t=e.target.closest('.t');if(!t){tip.style.display='none';return;}
tip.textContent=describe(t);tip.style.display='block';});
document.addEventListener('mousemove',e=>{tip.style.left=(e.clientX+14)+'px';tip.style.top=(e.clientY+14)+'px';});
// the address: #s<row>[/t<token>][/heat] selects a sample, pins the hover box on a token, turns the heat on
const parts=location.hash.slice(1).split('/');const at=secs.findIndex(s=>s.id===parts[0]);show(at<0?0:at,true);
if(parts.includes('heat')){heat.checked=true;document.body.classList.add('heat');}
const pin=parts.find(p=>/^t[0-9]+$/.test(p));const pinned=pin&&secs[cur].querySelectorAll('.t')[+pin.slice(1)];
if(pinned){pinned.classList.add('pin');pinned.scrollIntoView({block:'center'});const r=pinned.getBoundingClientRect();
tip.textContent=describe(pinned);tip.style.display='block';tip.style.left=r.left+'px';tip.style.top=(r.bottom+6)+'px';}
"""


def _css() -> str:
    rules = [f".m{k}{{background:{c}}}" for k, c in enumerate(PALETTE)]
    rules += [f".heat .t.s.h{k}{{background:{c}!important}}" for k, c in enumerate(HEAT)]
    return _CSS.replace("SCAFFOLD", SCAFFOLD) + "\n".join(rules)


def _heat_key() -> str:
    """The heat scale, shown only while the heat is on."""
    cells = "".join(f'<i style="background:{c}"></i>' for c in HEAT)
    return f'<span id=heatkey>p 0 {cells} 1</span>'


def render_page(rows: list[tuple[int, dict]], tokenizer: Any | None, source: str, total: int) -> str:
    """The whole page for ``rows`` (``(row number, row)`` pairs) of a shard set holding ``total`` rows."""
    options = "".join(
        f'<option value="s{i}">#{i} {html.escape(str(r.get("rollout_id")))} seg {r.get("segment_index", 0) + 1}/'
        f'{r.get("segment_count", 1)} · reward {float(r.get("reward") or 0):.3f} · {html.escape(str(r.get("finish_reason")))}'
        "</option>" for i, r in rows)
    shown = f"{len(rows)} of {total} samples" + ("" if len(rows) == total else f" (rows {rows[0][0]}-{rows[-1][0]})"
                                                  if rows else "")
    decoded = "" if tokenizer is not None else " · no tokenizer: token ids shown"
    sections = "".join(sample_section(i, r, tokenizer) for i, r in rows)
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>tito samples</title>"
        f"<style>{_css()}</style></head><body>"
        f"<header><h1>tito · {html.escape(source)}</h1><button id=prev>◀ prev</button><select id=pick>{options}</select>"
        f"<button id=next>next ▶</button><label><input type=checkbox id=heat> logprob heat</label>{_heat_key()}"
        f"<span class=meta>{shown}{decoded} · hover a token for its id and logprob</span></header>"
        f"<main>{sections or '<p>no samples</p>'}</main><div id=tip></div><script>{_JS}</script></body></html>"
    )


def write_viewer(path: str | Path, out: str | Path, *, start: int = 0, limit: int = 200,
                 tokenizer: Any | None = None) -> int:
    """Write the page for rows ``start .. start + limit`` of the shards at ``path``; returns how many.
    The file is written whole or not at all (a temporary name, then a rename)."""
    try:
        data, _ = open_shards(path), shard_files(path)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    total = data.count_rows()
    if not 0 <= start < max(total, 1):
        raise ValueError(f"sample {start} is out of range: the shards hold {total} rows")
    if limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    numbers = list(range(start, min(start + limit, total)))
    rows = list(zip(numbers, data.take(numbers).to_pylist())) if numbers else []
    page = render_page(rows, tokenizer, str(path), total)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return len(rows)
