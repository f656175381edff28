"""``tito serve``: the engine fleet behind vLLM's token-in/token-out HTTP API, plus chat sessions (docs/serve.md).

- launch.py: start-up (Ray, actors, uvicorn); state.py: what the routes share; guard.py: API keys, deadlines.
- app.py: the vLLM routes (/inference/v1/generate, /v1/models, /health, /metrics); openai_routes.py,
  streaming.py, responses.py, sse.py, stops.py, text_bound.py: the OpenAI routes, whole or streamed.
- schemas.py: the wire structs; calls.py: sampling, the engine call and its accounting; logprobs.py:
  vLLM's logprob shapes; metrics.py: Prometheus exposition.
- sessions.py, chat_session.py: server-side bridged chat sessions; fleet.py: routing over the engines;
  admin.py: pause/resume, weight updates and the other admin routes.

It may import the loop core (config, handles, routing, turns, startup) and rollout/engines; never
the command line (rollout/cli/ starts it) or actors."""
