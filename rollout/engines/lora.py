"""LoRA adapters for the embedded engine: read and validate a peft adapter directory, and apply any number of loaded
adapters in one packed forward, each token under its own request's adapter (or none).

A peft adapter directory (what ``PeftModel.save_pretrained`` and prime-rl's LoRA trainer write) holds
``adapter_config.json`` and ``adapter_model.safetensors`` with, per target module, ``<module>.lora_A.weight``
(``r x in_features``) and ``<module>.lora_B.weight`` (``out_features x r``) under a ``base_model.model.`` prefix.
A target ``nn.Linear`` then computes ``base(x) + scaling * (x @ A.T) @ B.T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), as peft's ``Linear`` does at inference (dropout off).

What is refused, naming the file, key or tensor: a missing or unreadable file, a target module the served model
lacks or that is not a linear layer, a rank above the engine's ``max_lora_rank``, a mis-shaped, non-float or
non-finite tensor, an A without its B, and the peft features whose arithmetic differs (DoRA, trained biases,
``modules_to_save``, per-module rank or alpha patterns, ``fan_in_fan_out``): loading them as plain LoRA would
sample from a model the trainer never had.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


class AdapterError(ValueError):
    """A LoRA adapter this engine cannot serve; the text names the file, key or tensor."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A: r x in, B: out x r)
    base_model: str | None = None  # the adapter_config's base_model_name_or_path, as written (informative)


_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]{0,9})")  # a canonical broadcasts/step_N (rollout/data/layout.py)


def adapter_step(path: str | Path) -> int | None:
    """N when ``path`` is a ``step_N`` directory (prime-rl's broadcasts/step_N/: the adapter is policy version N)."""
    m = _STEP_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m and int(m.group(1)) < 2**31 else None


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a peft adapter (its config file): a broadcast step with one is an adapter step."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class AdapterFiles:
    """An adapter directory read and checked without a model: its config and its A/B pairs by module name."""

    rank: int
    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A, B), as stored
    base_model: str | None


def read_adapter_files(name: str, path: str | Path, max_rank: int) -> AdapterFiles:
    """The checks that need no model (what the vLLM backend runs before vLLM reads the adapter): both files there
    and readable, a plain-LoRA config with a rank within ``max_rank``, every tensor an A or B weight with its pair,
    of rank ``r``, floating point and finite. Raises :class:`AdapterError` naming the first problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(root)!r} is not a directory")
    cfg_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"adapter {name!r}: {str(root)!r} holds no {f.name}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {cfg_file.name} does not parse: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {name!r}: {cfg_file.name} is not a JSON object")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: {cfg_file.name}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} exceeds this engine's max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {name!r}: {cfg_file.name}: lora_alpha must be a number, got {alpha!r}")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("modules_to_save", None),
                     ("rank_pattern", {}), ("alpha_pattern", {})):
        value = cfg.get(key, off)
        if value not in (off, None) and value != {} and value != []:
            raise AdapterError(f"adapter {name!r}: {cfg_file.name}: {key}={value!r} is not served (plain LoRA only: "
                               "its arithmetic differs)")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {weights_file.name} is unreadable (truncated?): {exc}") from None
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: {key}: not a LoRA A or B weight (only those are served)")
        sides.setdefault(m["module"], {})[m["side"]] = t
    if not sides:
        raise AdapterError(f"adapter {name!r}: {weights_file.name} holds no LoRA weights")
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(sides.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module}: lora_{'B' if 'A' in ab else 'A'} is missing")
        a, b = ab["A"], ab["B"]
        for side, t, dim in (("A", a, 0), ("B", b, 1)):
            if t.ndim != 2 or t.shape[dim] != rank:
                raise AdapterError(f"adapter {name!r}: {module}.lora_{side}.weight has shape {tuple(t.shape)}, "
                                   f"not rank {rank}")
            if not t.is_floating_point():
                raise AdapterError(f"adapter {name!r}: {module}.lora_{side}.weight is {t.dtype}, not a float tensor")
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise AdapterError(f"adapter {name!r}: {module}.lora_{side}.weight holds {bad} non-finite values "
                                   f"(of {t.numel()})")
        pairs[module] = (a, b)
    return AdapterFiles(rank, float(scaling), pairs, cfg.get("base_model_name_or_path"))


def read_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoraAdapter:
    """Read and check the adapter in ``path`` against ``model`` (the served base): each target a linear layer of
    it, of its in and out features; tensors in the model's dtype and device. Raises :class:`AdapterError` naming
    the first problem; nothing is applied."""
    files = read_adapter_files(name, path, max_rank)
    modules = dict(model.named_modules())
    param = next(model.parameters())
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in files.pairs.items():
        linear = modules.get(module)
        if not isinstance(linear, nn.Linear):
            what = "not in the served model" if linear is None else f"a {type(linear).__name__}, not a linear layer"
            raise AdapterError(f"adapter {name!r}: target module {module} is {what} (an adapter for another base?)")
        for side, t, want in (("A", a, (files.rank, linear.in_features)), ("B", b, (linear.out_features, files.rank))):
            if tuple(t.shape) != want:
                raise AdapterError(f"adapter {name!r}: {module}.lora_{side}.weight has shape {tuple(t.shape)}, "
                                   f"the served model needs {want} (rank {files.rank})")
        weights[module] = (a.to(param.device, param.dtype), b.to(param.device, param.dtype))
    return LoraAdapter(name, str(path), files.rank, files.scaling, weights, files.base_model)


class LoraSlots:
    """The adapters applied in the next forward: ``token_slot`` (one entry per packed token; -1: the base model)
    and, per slot, the adapter there. Shared by every hooked layer of one model."""

    def __init__(self) -> None:
        self.adapters: dict[int, LoraAdapter] = {}
        self.token_slot: torch.Tensor | None = None  # None: no token of this forward has an adapter


def _lora_hook(name: str, slots: LoraSlots):
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        token_slot = slots.token_slot
        if token_slot is None:
            return y
        x = inputs[0]
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, adapter in slots.adapters.items():
            ab = adapter.weights.get(name)
            if ab is None:
                continue
            rows = (token_slot == slot).nonzero()[:, 0]
            if rows.numel():
                a, b = ab
                flat_y.index_add_(0, rows, (flat_x[rows] @ a.T) @ b.T, alpha=adapter.scaling)
        return y

    return hook


def hook_targets(model: nn.Module, adapter: LoraAdapter, slots: LoraSlots, hooked: set[str]) -> None:
    """Hook every linear layer ``adapter`` targets that is not hooked yet (names in ``hooked``): its output gains,
    token by token, the delta of that token's adapter (peft's LoRA at inference). A forward hook, not a wrapping
    module, so the model's parameter names (what full checkpoints load by) stay as they are."""
    for module in adapter.weights:
        if module not in hooked:
            model.get_submodule(module).register_forward_hook(_lora_hook(module, slots))
            hooked.add(module)
