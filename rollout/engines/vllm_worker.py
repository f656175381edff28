"""Code tito runs inside vLLM's worker processes (vLLM's ``worker_extension_cls``), called by name through
``AsyncLLM.collective_rpc``. Imported only there, where vLLM and torch are loaded.

Why it exists: vLLM's in-place disk reload (``reload_weights``, vLLM 0.32) skips a tied output layer. A model
whose ``lm_head`` is tied to ``embed_tokens`` (SmolLM2, Llama 3.2 1B/3B, Qwen2.5 0.5B-3B) has no
``lm_head.weight`` in its checkpoint, so the reload finds nothing to load for the lm_head ("ParallelLMHead:
Failed to load weights") and does not process it again. On CPU that processing is where vLLM packs the weight
into its GEMM kernel's own layout (``dispatch_cpu_unquantized_gemm``): the embeddings were reloaded, but tokens
were still scored with the packed copy of the OLD ones. Measured on SmolLM2-135M after one training step:
sampled logprobs 0.05 nats away from a forward pass of the new weights, every linear layer and norm itself
reloaded correctly. :meth:`TitoWorkerExtension.tito_refresh_tied_lm_head` ties the lm_head to the embeddings
again and re-runs its processing; the vLLM backend calls it after every reload (on GPU the processing of an
unquantized lm_head does nothing, so it is only the re-tie there).
"""

from __future__ import annotations

from typing import Any


class TitoWorkerExtension:
    """Mixed into vLLM's Worker class (method names are prefixed ``tito_``: vLLM refuses an extension whose names
    collide with the Worker's own)."""

    def tito_refresh_tied_lm_head(self) -> bool:
        """Where the model config ties the output layer to the input embeddings: point ``lm_head.weight`` at
        ``embed_tokens.weight`` and re-run the lm_head's post-load processing (its packed CPU GEMM); True if it
        did. A model without tied embeddings, or with another layout, is left as it is (False)."""
        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        if not getattr(config, "tie_word_embeddings", False):
            return False
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(embed, "weight"):
            return False
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)
        return True
