"""The engines: token ids in, sampled token ids and their logprobs out; and the weights they serve.

- protocol.py: the engine protocol (GenerateRequest, SamplingParams, GenerateResult): all the loop knows.
- embedded.py + embedded_kv.py: the torch engine (the light default; CPU or GPU), its KV and sampler.
- vllm_backend.py + vllm_worker.py: vLLM's AsyncLLM in this process, and the code tito runs in its workers.
- replay.py: recorded completions, for tests and dry runs. streaming.py: token-by-token results.
- factory.py: which class each ``engine.backend`` is and how it is built.
- checkpoint.py: validating a weights directory before any engine pauses.

A new backend is one module here plus its line in factory.py; weight transports and adapters go here too,
beside the engines that load them. It may import rollout/models.py (finding and loading model files) and nothing else in rollout/: the loop,
serve, follow, data and the command line all import it. Engines never import tito_renderers: they see ids."""
