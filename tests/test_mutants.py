"""The ids-only bridge on content mutants (tests/mutants.py; issue 43): a seeded sample of mutants per
template, each rendered and bridged turn by turn from transformers' ids on a fresh renderer. Parity with
transformers (a marker's text inside a message read as text: ``MarkersAsText``), no needless break, no
wrong bridge, no drift. scripts/measure_mutants.py runs every mutant (figures in docs/fidelity.md).

Also: a reply the model sampled with whitespace its template strips breaks with
``edge_whitespace_stripped`` naming the message, and bridges where the template keeps it."""

from __future__ import annotations

import pytest

from tito_renderers import Break, BreakReason, Bridged

from .bridge_gaps import Entry, corpus, measure_conversations
from .mutants import KINDS, MarkersAsText, mutants

CORPUS = {e.id: e for e in corpus()}
# every mistral-common generator version (Tekken), the shipped SentencePiece and Tekken files, [INST] as
# plain text (spm-v1), Llama 2, and fixture families
SAMPLE = [
    "mistral-v1", "mistral-v2", "mistral-v3", "mistral-v7", "mistral-v11", "mistral-v13-think", "mistral-v15",
    "mistral-v7-spm@spm-v7", "mistral-v2-spm@spm-v2", "mistral-v3@tekken-240718", "mistral-v3@tekken-240911",
    "mistral-v7@spm-v1-text", "llama-2", "qwen2.5", "llama-3.1", "deepseek-v3", "nemotron-super",
]


@pytest.mark.parametrize("entry_id", SAMPLE)
def test_no_mutant_breaks_needlessly_nor_bridges_wrong(entry_id: str) -> None:
    entry = CORPUS[entry_id]
    reference = MarkersAsText(entry)
    totals: dict[str, int] = {}
    bad: list = []
    for label, messages, tools in mutants(entry, seed=5, n=1, per_conversation=14):
        found: list = []
        counts = measure_conversations(reference, [(messages, tools)], found)
        bad += [(label, *f) for f in found]
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    print(entry_id, totals)
    assert not bad, bad[:5]
    assert totals["needless"] == totals["wrong"] == totals["drift"] == totals["unequal"] == 0, totals
    assert totals["exact"] >= 5, totals


def test_the_mutations_cover_every_kind_the_issue_names() -> None:
    """Each whitespace kind alone and combined, empty, unicode spaces inside, a delimiter's text."""
    labels = {label.split(":")[0] for label, _ in KINDS}
    assert {"lead", "trail", "both", "mixed", "blank", "empty", "inner", "delimiter"} <= labels
    for ws in (" ", "\t", "\n", "\r\n"):
        assert any(change("x") == ws + "x" for _, change in KINDS) and any(change("x") == "x" + ws for _, change in KINDS)


def _sampled(entry: Entry, history: list[dict], reply: str) -> tuple[list[int], list[int]]:
    """Transformers' prompt, and what a model samples replying ``reply`` verbatim: the template's own
    text of the turn (rendered by transformers around a placeholder) with ``reply`` in its place."""
    hf = entry.pair[1]
    prompt = entry.reference_ids(history, None, True)
    full = entry.reference_ids([*history, {"role": "assistant", "content": "QZXQ"}], None, False)
    assert full[: len(prompt)] == prompt
    text = hf.decode(full[len(prompt):])
    return prompt, list(hf(text.replace("QZXQ", reply), add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("entry_id", ["llama-2", "llama-2-on-llama-3-vocab"])
@pytest.mark.parametrize("reply", [" 4\n", "4 ", "\t4"])
def test_a_sampled_edge_the_template_strips_breaks_with_its_own_reason(entry_id: str, reply: str) -> None:
    """Llama 2 renders ``content.strip()``: a reply sampled with whitespace at an edge never comes back in a
    re-render (transformers' render of the turn holds the stripped reply). Where the bridge must re-render
    (the system prompt folds into a user turn), it breaks and says why, naming the sampled turn's index."""
    entry = CORPUS[entry_id]
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
    prompt, completion = _sampled(entry, history, reply)
    new = [{"role": "user", "content": "And 3+3?"}]
    stripped = entry.reference_ids([*history, {"role": "assistant", "content": reply}, *new], None, True)
    assert stripped[: len(prompt) + len(completion)] != prompt + completion  # truly not append-only
    result = entry.renderer().bridge(prompt, completion, new)
    assert isinstance(result, Break), result
    assert result.reason is BreakReason.EDGE_WHITESPACE_STRIPPED, result
    assert "(assistant, the sampled turn)" in result.detail, result.detail
    lead, trail = reply[: len(reply) - len(reply.lstrip())], reply[len(reply.rstrip()):]
    for edge, side in ((lead, "opening"), (trail, "ending")):
        if edge:
            assert f"{edge!r} {side}" in result.detail, result.detail


@pytest.mark.parametrize("entry_id", ["mistral-v7", "mistral-v7-spm@spm-v7", "mistral-v3@tekken-240718"])
@pytest.mark.parametrize("reply", [" 4\n", "4 ", "\t4", "\r\n4\r\n"])
def test_a_sampled_edge_the_template_keeps_bridges(entry_id: str, reply: str) -> None:
    """Mistral's templates render a reply verbatim: the same sampled whitespace bridges, and the bridge is
    transformers' render of the conversation with that reply."""
    entry = CORPUS[entry_id]
    history = [{"role": "user", "content": "What is 2+2?"}]
    prompt, completion = _sampled(entry, history, reply)
    new = [{"role": "user", "content": "And 3+3?"}]
    result = entry.renderer().bridge(prompt, completion, new)
    assert isinstance(result, Bridged), result
    assert result.token_ids == entry.reference_ids([*history, {"role": "assistant", "content": reply}, *new], None, True)
