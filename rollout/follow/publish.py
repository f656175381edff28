"""The trainer's side of the weights: publish a policy version for ``tito run --follow`` to load.

::

    from rollout.follow.publish import publish_weights, latest_version

    start = latest_version(run_dir) + 1              # 0 when nothing was published: the service's own model
    for k in range(start, steps + 1):
        ...                                          # train on batch k (sampled by version k - 1)
        publish_weights(run_dir, k, model)           # RUN_DIR/broadcasts/step_k/, STABLE last

Any torch trainer can call it: ``model_or_state_dict`` is a ``torch.nn.Module`` (its ``state_dict()``) or a
mapping of parameter names to tensors, with the names the model's Hugging Face checkpoint uses
(``model.layers.0.self_attn.q_proj.weight``; unwrap DDP's ``module.`` / torch.compile's ``_orig_mod.``
first, and gather FSDP/ZeRO shards to one full state dict on the rank that publishes). The config comes
from ``model.config`` for a transformers model, else from ``config=`` (a dict, or the path of a
``config.json`` or of the directory holding it).

What is written: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
past ``max_shard_bytes``), contiguous CPU tensors in their own dtype, with ``{"format": "pt"}`` metadata,
and ``config.json``: the layout of ``save_pretrained``, which the embedded engine
(``EmbeddedEngine.update_weights``) and vLLM's in-place reload both load. A tied output layer (the config
ties ``lm_head.weight`` to the input embeddings: SmolLM2, Llama 3.2 1B/3B, Qwen2.5 small) is not written,
as ``save_pretrained`` leaves it out: the loaders tie it again. An ``lm_head.weight`` that the config ties
but whose values differ from the embeddings is refused, since every loader would silently drop it.

Atomicity: everything is written into a hidden temporary directory in ``broadcasts/`` and fsynced, the
directory is renamed to ``step_{version}``, and only then is the empty ``STABLE`` file created and fsynced:
a reader that waits for ``STABLE`` (``rollout.data.layout.stable_versions``) never sees a partial
checkpoint, and a directory without ``STABLE`` is never read. On any failure the temporary (and a
``step_{version}`` this call renamed into place) is removed, and the error propagates.

Refused with a one-line ``ValueError``, before anything is written: a version that is not an int > 0 or
whose ``step_{version}`` already exists, a state dict with NaN or infinite values (the rollout side
refuses them too; failing here, at the trainer, is cheaper), a non-tensor entry, and a missing config.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.layout import STABLE, broadcast_dir, stable_versions

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # save_pretrained's default shard size (5 GB)


def latest_version(run_dir: str | os.PathLike) -> int:
    """The highest published (``STABLE``) version in ``run_dir``, 0 when none was published yet (version 0
    is the model the rollout service started with). A trainer resuming a run continues at this + 1."""
    versions = stable_versions(run_dir)
    return versions[-1] if versions else 0


def publish_weights(run_dir: str | os.PathLike, version: int, model_or_state_dict: Any, *,
                    config: Mapping[str, Any] | str | os.PathLike | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write ``RUN_DIR/broadcasts/step_{version}/`` (safetensors + ``config.json``, then ``STABLE``) and
    return its path. See the module docstring for what is written, the order, and what is refused."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(f"publish_weights: version must be an int > 0 (0 is the service's starting model), "
                         f"got {version!r}")
    target = broadcast_dir(run_dir, version)
    if target.exists():
        raise ValueError(f"publish_weights: version {version} already exists at {target}; versions are "
                         "published once (the next one is latest_version(run_dir) + 1)")
    cfg = _config_json(model_or_state_dict, config)
    tensors = _tensors(model_or_state_dict, cfg)
    shards = _shards(tensors, max_shard_bytes)

    from safetensors.torch import save_file

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step_{version}-"))
    try:
        if len(shards) == 1:
            names = [WEIGHTS]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            _write_text(tmp / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True) + "\n")
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            _fsync_file(tmp / name)
        _write_text(tmp / CONFIG, cfg)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, target, f"publish_weights: version {version}")


def publish_adapter(run_dir: str | os.PathLike, version: int, peft_model: Any) -> Path:
    """Write a peft model's LoRA adapter as ``RUN_DIR/broadcasts/step_{version}/`` (``adapter_model.safetensors``
    and ``adapter_config.json``, what prime-rl's LoRA trainer publishes each step), then ``STABLE``, in the order
    and with the guarantees of :func:`publish_weights`. A follow service loads it as version ``version`` of its
    adapter (rollout/follow/service.py); the base weights never move."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(f"publish_adapter: version must be an int > 0, got {version!r}")
    if not callable(getattr(peft_model, "save_pretrained", None)) or not hasattr(peft_model, "peft_config"):
        raise ValueError("publish_adapter: pass a peft model (peft.get_peft_model / PeftModel)")
    target = broadcast_dir(run_dir, version)
    if target.exists():
        raise ValueError(f"publish_adapter: version {version} already exists at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".step_{version}-"))
    try:
        peft_model.save_pretrained(str(tmp), safe_serialization=True)
        for f in tmp.iterdir():
            _fsync_file(f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, target, f"publish_adapter: version {version}")


def _commit(tmp: Path, target: Path, what: str) -> Path:
    """Rename the written ``tmp`` to ``target``, then create ``STABLE``, each step fsynced; on any failure nothing
    of it is left (neither ``tmp`` nor a ``target`` this call renamed into place)."""
    renamed = False
    try:
        _fsync_dir(tmp)
        if target.exists():  # published by someone else while this one was writing
            raise ValueError(f"{what} already exists at {target}")
        os.rename(tmp, target)
        renamed = True
        _fsync_dir(target.parent)
        fd = os.open(target / STABLE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if renamed:
            shutil.rmtree(target, ignore_errors=True)
        raise
    return target


# -- what is written ------------------------------------------------------------------------------------------

def _config_json(source: Any, config: Mapping[str, Any] | str | os.PathLike | None) -> str:
    """config.json's text: ``config`` when given (a mapping, or a config.json path or its directory), else
    the transformers model's own config, as ``save_pretrained`` writes it."""
    if config is None:
        hf = getattr(source, "config", None)
        if hf is None or not hasattr(hf, "to_json_string"):
            raise ValueError("publish_weights: no config: pass config= (a dict or a config.json path) unless the "
                             "model is a transformers model with .config")
        data = json.loads(hf.to_json_string(use_diff=True))
        if not data.get("architectures") and hasattr(source, "save_pretrained"):
            data["architectures"] = [type(source).__name__]  # what save_pretrained adds
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        path = Path(config)
        if path.is_dir():
            path = path / CONFIG
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"publish_weights: config {str(config)!r} is not a readable config.json "
                             f"({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ValueError("publish_weights: the config has no model_type (loaders pick the architecture by it)")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _tensors(source: Any, cfg_text: str) -> dict[str, torch.Tensor]:
    """The tensors to write: detached, on the CPU, contiguous, none sharing memory with another (safetensors
    refuses shared storage); tied output layers dropped; all finite, else ValueError."""
    import torch

    if isinstance(source, torch.nn.Module):
        state = source.state_dict()
    elif isinstance(source, Mapping):
        state = dict(source)
    else:
        raise ValueError(f"publish_weights: expected a torch.nn.Module or a state dict, got {type(source).__name__}")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"publish_weights: state dict entries that are not tensors: {bad[:5]}")
    if not state:
        raise ValueError("publish_weights: the state dict is empty")

    for target, src in _tied(source, json.loads(cfg_text), state).items():
        a, b = state[target], state[src]
        if not (_same_view(a, b) or (a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu()))):
            raise ValueError(f"publish_weights: the config ties {target} to {src} but their values differ "
                             "(loaders would drop the former); tie them, or set tie_word_embeddings false")
        del state[target]

    nonfinite = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        more = f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else ""
        raise ValueError(f"publish_weights: non-finite values (NaN/inf) in {', '.join(nonfinite[:3])}{more}; "
                         "nothing was published")

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():  # shares memory with an earlier tensor (an untied alias, a view)
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def _tied(source: Any, cfg: dict[str, Any], state: Mapping[str, Any]) -> dict[str, str]:
    """{target: source} of the tied parameters present in ``state`` (the target is left out of the files):
    a transformers model's own ``all_tied_weights_keys`` (it follows the config), else, for a bare state dict
    whose config sets ``tie_word_embeddings``, ``lm_head.weight`` to the ``*embed_tokens.weight`` tensor."""
    pairs = getattr(source, "all_tied_weights_keys", None)
    if pairs is None:
        pairs = {}
        embeds = [k for k in state if k.endswith("embed_tokens.weight")]
        if cfg.get("tie_word_embeddings") and "lm_head.weight" in state and len(embeds) == 1:
            pairs = {"lm_head.weight": embeds[0]}
    return {t: s for t, s in dict(pairs).items() if t in state and s in state and t != s}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in state-dict order, cut into consecutive groups of at most ``max_bytes`` (a bigger tensor
    gets a shard of its own)."""
    if max_bytes <= 0:
        raise ValueError(f"publish_weights: max_shard_bytes must be > 0, got {max_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


# -- durability -------------------------------------------------------------------------------------------------

def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["latest_version", "publish_weights"]
