"""``tito serve``: the engine fleet behind vLLM's token-in/token-out HTTP API, plus chat sessions (docs/serve.md)."""
