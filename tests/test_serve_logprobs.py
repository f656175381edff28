"""vLLM's sampling options on `tito serve`'s token routes, with the real embedded engine (SmolLM2-135M, CPU),
real Ray and loopback HTTP: stopping at the model's EOS unless ``ignore_eos``, ``min_tokens``,
``logprobs`` / ``top_logprobs`` with the k most likely tokens, and ``prompt_logprobs``, in vLLM's shapes
on /inference/v1/generate, /v1/completions and /v1/chat/completions.

Every value is checked against an independent reference: a plain transformers forward pass of the same
weights (``AutoModelForCausalLM``, its own attention, not the engine's packed batch). The same requests are
compared with vLLM's own server in tests/test_vllm_serve.py.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

from ._support import EMBEDDED_ENGINE, SMOLLM2, http_call, reference, serving, smollm2_gguf  # noqa: E402

NAME = "smollm2-logprobs"
EOS = 2  # <|im_end|>, SmolLM2's EOS
ATOL = 1e-4  # fp32 on CPU: the engine's packed forward and transformers' agree to ~1e-6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory, "tito-test-serve-logprobs",
                 [f"model={smollm2_gguf()}", f"served_model_name={NAME}", *EMBEDDED_ENGINE]) as srv:
        yield srv


@pytest.fixture(scope="module")
def model():
    """transformers' own forward over the same weights (the converted checkpoint the engine loads)."""
    from transformers import AutoModelForCausalLM

    from rollout.models import converted_dir

    m = AutoModelForCausalLM.from_pretrained(str(converted_dir(smollm2_gguf())), torch_dtype=torch.float32)
    m.config._attn_implementation = "eager"
    return m.eval()


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: row i is the model's next-token logits after ids[: i + 1]."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def post(srv, path, body):
    return http_call(srv.url + path, "POST", body, timeout=300)


def prompt_ids(content: str) -> list[int]:
    hf = reference(SMOLLM2)
    text = hf.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


PROMPT_TEXT = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return prompt_ids(PROMPT_TEXT)


@pytest.fixture(scope="module")
def free_run(server, prompt) -> list[int]:
    """The greedy completion (ignore_eos, so it runs through <|im_end|>)."""
    status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0, "ignore_eos": True}})
    assert status == 200, r
    ids = r["choices"][0]["token_ids"]
    assert EOS in ids[:20], f"the probe prompt's greedy answer does not reach EOS: {ids}"
    return ids


# ---- EOS ----------------------------------------------------------------------------------------


def test_every_route_stops_at_eos_unless_ignore_eos(server, prompt, free_run):
    """No stop_token_ids: generate, completions and chat stop at the model's EOS (included in token_ids,
    stop_reason null as vLLM reports EOS); with ignore_eos they sample through it to max_tokens."""
    end = free_run.index(EOS) + 1
    status, g = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0}})
    status2, c = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                  "return_token_ids": True})
    status3, ch = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 24, "temperature": 0,
        "return_token_ids": True})
    assert (status, status2, status3) == (200, 200, 200), (g, c, ch)
    for name, choice in (("generate", g["choices"][0]), ("completions", c["choices"][0]), ("chat", ch["choices"][0])):
        assert choice["token_ids"] == free_run[:end], name
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None, (name, choice)
    status, g = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0, "ignore_eos": True}})
    status2, c = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True})
    for choice in (g["choices"][0], c["choices"][0]):
        assert choice["token_ids"] == free_run and choice["finish_reason"] == "length"


# ---- min_tokens ---------------------------------------------------------------------------------


def test_min_tokens_masks_eos_until_reached(server, model, prompt, free_run):
    """min_tokens = m: EOS cannot be sampled among the first m tokens. The tokens before EOS's position are
    the free run's; at that position the token is the argmax with EOS masked, and its logprob is of the
    masked distribution (vLLM's processed logprobs), checked against transformers' logits."""
    p = free_run.index(EOS)
    m = p + 3
    status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0, "min_tokens": m, "logprobs": 0}})
    assert status == 200, r
    choice = r["choices"][0]
    ids = choice["token_ids"]
    assert ids[:p] == free_run[:p] and EOS not in ids[:m] and len(ids) > m, ids
    logits = logits_of(model, prompt + ids)[len(prompt) - 1:]
    for i in range(m):
        masked = logits[i].clone()
        masked[EOS] = float("-inf")
        logp = torch.log_softmax(masked, -1)
        assert ids[i] == int(masked.argmax()), i
        assert abs(choice["logprobs"]["content"][i]["logprob"] - float(logp[ids[i]])) <= ATOL, i
    status, c = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                 "min_tokens": m, "return_token_ids": True})
    assert status == 200 and c["choices"][0]["token_ids"] == ids, c
    status, err = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "min_tokens": 5})
    assert status == 400 and err["error"]["param"] == "min_tokens", err
    status, err = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 4, "min_tokens": 5}})
    assert status == 400 and err["error"]["param"] == "sampling_params.min_tokens", err


# ---- top logprobs -------------------------------------------------------------------------------


def reference_top(model, prompt: list[int], ids: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    logp = torch.log_softmax(logits_of(model, prompt + ids)[len(prompt) - 1: len(prompt) - 1 + len(ids)], -1)
    values, top = torch.topk(logp, k, dim=-1)
    return [(t.tolist(), v.tolist()) for t, v in zip(top, values)]


def test_generate_logprobs_k_in_vllms_shape(server, model, prompt):
    """sampling_params.logprobs=5 (greedy): per token its rank and the 5 most likely tokens, the sampled one
    first (vLLM's GenerateLogProbsContent), equal to transformers' top-5 ids and values."""
    status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 6, "temperature": 0, "logprobs": 5}})
    assert status == 200, r
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    ref = reference_top(model, prompt, choice["token_ids"], 5)
    for entry, t, (top_ids, top_lps) in zip(content, choice["token_ids"], ref):
        assert set(entry) == {"token_id", "logprob", "token", "rank", "top_logprobs"}
        assert entry["token_id"] == t == top_ids[0] and entry["rank"] == 1
        assert [e["token_id"] for e in entry["top_logprobs"]] == top_ids
        assert [e["rank"] for e in entry["top_logprobs"]] == [1, 2, 3, 4, 5]
        assert max(abs(e["logprob"] - v) for e, v in zip(entry["top_logprobs"], top_lps)) <= ATOL
        assert abs(entry["logprob"] - top_lps[0]) <= ATOL
    # logprobs=0 (vLLM: the sampled token alone in top_logprobs, with its rank)
    status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 3, "temperature": 0, "logprobs": 0}})
    entry = r["choices"][0]["logprobs"]["content"][0]
    assert entry["rank"] == 1 and [e["token_id"] for e in entry["top_logprobs"]] == [entry["token_id"]]


def test_sampled_top_logprobs_are_of_the_distribution_sampled_from(server, model, prompt):
    """temperature 0.7, top_k 4, logprobs=6: the alternatives are log_softmax(top-4 logits / 0.7) (the
    processed distribution the sampled token's logprob is of), the 5th and 6th are vLLM's -9999.0 (filtered
    out), and the sampled token's own entry agrees with its place in the list."""
    status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 6, "temperature": 0.7, "top_k": 4, "seed": 3, "logprobs": 6, "ignore_eos": True}})
    assert status == 200, r
    choice = r["choices"][0]
    logits = logits_of(model, prompt + choice["token_ids"])[len(prompt) - 1:]
    for i, entry in enumerate(choice["logprobs"]["content"]):
        values, top = torch.topk(logits[i], 4)
        expect = torch.log_softmax(values / 0.7, -1).tolist()
        listed = entry["top_logprobs"]
        # vLLM's order: the sampled token first, then the others most likely first
        rest = [e for e in listed if e["token_id"] != entry["token_id"]]
        assert listed[0]["token_id"] == entry["token_id"]
        by_id = {e["token_id"]: e["logprob"] for e in listed}
        for t, v in zip(top.tolist(), expect):
            assert abs(by_id[t] - v) <= ATOL, (i, t)
        assert [e["logprob"] for e in rest][-2:] == [-9999.0, -9999.0] or len(rest) < 5
        assert entry["token_id"] in top.tolist() and entry["rank"] == top.tolist().index(entry["token_id"]) + 1


def test_completions_and_chat_top_logprobs_in_vllms_shape(server, model, prompt):
    """/v1/completions logprobs=3: top_logprobs a dict of the sampled token and the 3 most likely (by text,
    or "token_id:<id>"); chat top_logprobs=3: a list of the first 3 {token, logprob, bytes}. Both equal the
    reference's values, and the streamed chunks carry the same lists as the whole answer."""
    tok = reference(SMOLLM2)
    status, c = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3,
                                                 "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200, c
    choice = c["choices"][0]
    ref = reference_top(model, prompt, choice["token_ids"], 3)
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for top, (ids, values) in zip(lp["top_logprobs"], ref):
        assert list(top) == [f"token_id:{t}" for t in ids]  # the sampled token is the first of the greedy top 3
        assert max(abs(a - b) for a, b in zip(top.values(), values)) <= ATOL
    status, ch = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 3, "return_token_ids": True})
    assert status == 200, ch
    ids = ch["choices"][0]["token_ids"]
    ref = reference_top(model, ch["prompt_token_ids"], ids, 3)
    for entry, t, (top_ids, values) in zip(ch["choices"][0]["logprobs"]["content"], ids, ref):
        assert entry["token"] == tok.decode([t]) and entry["bytes"] == list(entry["token"].encode())
        assert [e["token"] for e in entry["top_logprobs"]] == [tok.decode([x]) for x in top_ids]
        assert max(abs(e["logprob"] - v) for e, v in zip(entry["top_logprobs"], values)) <= ATOL
        assert all(set(e) == {"token", "logprob", "bytes"} for e in entry["top_logprobs"])
    whole = lp["top_logprobs"]
    streamed = []
    req = urllib.request.Request(server.url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({
            "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3, "stream": True,
            "return_tokens_as_token_ids": True}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: {"):
                for ch_ in json.loads(line[6:])["choices"]:
                    if ch_.get("logprobs"):
                        streamed += ch_["logprobs"]["top_logprobs"]
    assert [list(d) for d in streamed] == [list(d) for d in whole]


# ---- prompt logprobs ----------------------------------------------------------------------------


def test_prompt_logprobs_score_the_prompt(server, model, prompt):
    """prompt_logprobs=2 on completions and generate: null for the first token, then per prompt token
    {"<id>": {logprob, rank, decoded_token}}, the token itself first, then the 2 most likely, equal to
    transformers' log_softmax at the previous position (ranks counted as vLLM does)."""
    tok = reference(SMOLLM2)
    logp = torch.log_softmax(logits_of(model, prompt), -1)
    status, c = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                 "prompt_logprobs": 2})
    status2, g = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}})
    assert status == status2 == 200, (c, g)
    for scores in (c["choices"][0]["prompt_logprobs"], g["prompt_logprobs"]):
        assert len(scores) == len(prompt) and scores[0] is None
        for i in range(1, len(prompt)):
            row = logp[i - 1]
            own = float(row[prompt[i]])
            top_v, top_i = torch.topk(row, 2)
            entry = scores[i]
            assert next(iter(entry)) == str(prompt[i])
            assert set(entry) == {str(prompt[i]), *map(str, top_i.tolist())}
            assert abs(entry[str(prompt[i])]["logprob"] - own) <= ATOL
            assert entry[str(prompt[i])]["rank"] == int((row >= row[prompt[i]]).sum())
            for rank, (t, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), 1):
                assert abs(entry[str(t)]["logprob"] - v) <= ATOL and entry[str(t)]["decoded_token"] == tok.decode([t])
                if t != prompt[i]:
                    assert entry[str(t)]["rank"] == rank


def test_prompt_logprobs_after_a_session_turn_ignore_the_cached_prefix(server, prompt):
    """A chat session's next turn reuses the engine's KV for the shared prefix; its prompt_logprobs are still
    those of a fresh prefill (the cached positions have no logits, so a scored prompt is prefilled whole)."""
    headers = {"X-Session-ID": "scored-session"}
    first = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0}
    status, r1 = http_call(server.url + "/v1/chat/completions", "POST", first, headers, timeout=120)
    assert status == 200, r1
    second = {"messages": [*first["messages"], r1["choices"][0]["message"], {"role": "user", "content": "Again."}],
              "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "return_token_ids": True}
    status, r2 = http_call(server.url + "/v1/chat/completions", "POST", second, headers, timeout=120)
    assert status == 200, r2
    ids = r2["prompt_token_ids"]
    status, fresh = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                     "prompt_logprobs": 1})
    a = [None if e is None else e[str(t)]["logprob"] for e, t in zip(r2["prompt_logprobs"], ids)]
    b = [None if e is None else e[str(t)]["logprob"] for e, t in zip(fresh["choices"][0]["prompt_logprobs"], ids)]
    assert a[0] is None and b[0] is None
    assert max(abs(x - y) for x, y in zip(a[1:], b[1:])) <= ATOL


def test_bad_logprob_settings_are_refused(server, prompt):
    for path, body, param in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "stream": True},
         "prompt_logprobs"),
        ("/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "prompt_logprobs": -1}},
         "sampling_params.prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 30}, "top_logprobs"),
    ):
        status, err = post(server, path, body)
        assert status == 400 and err["error"]["param"] == param, (path, err)


def test_token_text_of_a_character_split_across_tokens():
    """A character whose UTF-8 bytes span tokens: alone each token decodes to U+FFFD; vLLM names the first ""
    and the one that completes the character by the whole character (decoded after the earlier tokens)."""
    from rollout.serve.logprobs import token_text

    hf = reference(SMOLLM2)
    decode = hf.decode
    for s in ("🙂", "日"):
        ids = hf(s, add_special_tokens=False)["input_ids"]
        assert len(ids) > 1 and decode(ids[:1]).endswith("\ufffd"), (s, ids)
        assert token_text(decode, ids[0], []) == ""
        assert token_text(decode, ids[-1], ids[:-1]) == s
    assert token_text(decode, hf(" Paris", add_special_tokens=False)["input_ids"][0], [5, 6]) == " Paris"
