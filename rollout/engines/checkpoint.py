"""Checkpoint validation: is this safetensors directory a set of weights the engine's model can load?

Run before any engine pauses or drains (``update_weights``, ``validate_weights``, ``tito serve``'s
``/update_weights``): a checkpoint refused here changes nothing, while one refused half-way through a load leaves
a fleet paused, or worse, loads. Without it transformers' ``from_pretrained`` fills a missing tensor with random
values and samples with it, takes NaN weights, and refuses a wrong shape with a message that names no tensor;
vLLM's engine core dies on a checkpoint it cannot read.

What a model expects is a mapping of tensor name -> :class:`TensorSpec` (shape, dtype, tied names):
:func:`expected_from_model` reads it from a loaded ``torch.nn.Module`` (the embedded engine),
:func:`expected_from_dir` from the safetensors headers of the model directory an engine loaded (vLLM).
:func:`validate_checkpoint` then checks, in this order, stopping at the first problem:

1. the path is a directory holding weight files (step 2); ``config.json`` is optional (prime-rl's trainer writes
   none: every engine builds the new weights on its own, served config); when present it is a JSON object and,
   given ``served_config``, agrees with the served model on every key of :data:`ARCH_KEYS` (a checkpoint of
   another architecture or tying is refused naming the key: loading it into the served model would leave a
   tensor at its initial value or use one another way);
2. the weight files: those a ``model.safetensors.index.json`` lists (what transformers and vLLM load), else every
   ``*.safetensors``; each header reads (safetensors checks that the offsets cover the file exactly, so a torn
   write is caught), no file is empty, no tensor is in two files, each tensor the index names is in its file;
3. against ``expected`` (skipped when None): no tensor is missing (a tied name such as ``lm_head.weight`` may
   be absent when a tensor it is tied to is present, and may be present), none is unknown, every shape is
   the model's, every dtype can be loaded into the model's (any of F64/F32/F16/BF16 into a float parameter;
   the same dtype for an integer buffer);
4. with ``check_values``: every floating tensor holds only finite values.

Cost: headers are milliseconds. Values are read once, tensor by tensor (``safe_open``, memory-mapped), with
one reduction each: ``torch.isfinite(t.sum())``, which is finite only if every element is (a NaN or inf in
any element makes the sum NaN or inf); only when it is not does ``torch.isfinite(t)`` count the bad values
exactly (the sum of finite values can overflow, so that case is never refused without the exact count).
On SmolLM2-135M (513 MB fp32, 2-core VM) that costs about one pass over the bytes, 3-7x less than
``torch.isfinite(t).all()`` on every tensor (measured: 48 ms against 338 ms on a quiet machine); figures in
docs/benchmarks.md (scripts/bench_checkpoint.py).

A problem raises :class:`CheckpointError` (an EngineError, ``param="weight_dir"``) with a one-line message
naming the path, the problem and the tensor; a pass returns a :class:`CheckpointReport`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .protocol import EngineError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# the dtypes a float parameter is loaded from (torch casts any of them to the model's float dtype); float8
# and narrower are quantized formats that need their scales, and integers are not weights of a float model
LOADABLE_FLOAT = ("F32", "BF16", "F16", "F64")
_FLOAT = frozenset(LOADABLE_FLOAT) | {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}
SHOWN = 4  # names listed in a message before "(+N more)"
# config keys that change the parameter set or how tensors are used; a checkpoint's config.json must agree on
# each with the served model (absent keys take the served model's class default, as transformers reads them)
ARCH_KEYS = ("model_type", "architectures", "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
             "rope_scaling", "rope_parameters", "hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias")


class TensorSpec(msgspec.Struct, frozen=True):
    """One tensor the model loads. ``dtype`` is the safetensors name (``F32``, ``BF16``, ``I64`` ...);
    ``tied``: the other names of the same tensor (tied embeddings), any one of which may stand for it;
    ``required``: False for a buffer the model rebuilds itself when a checkpoint omits it."""

    shape: tuple[int, ...]
    dtype: str
    tied: tuple[str, ...] = ()
    required: bool = True


Expected = Mapping[str, TensorSpec]


class CheckpointReport(msgspec.Struct, frozen=True):
    """A checkpoint that passed: its files, tensors and bytes (the weight files' sizes), how long the check
    took, whether values were read, and a fingerprint of the files' names, sizes and mtimes (see
    :class:`CheckpointValidator`)."""

    path: str
    files: int
    tensors: int
    bytes: int
    seconds: float
    values_checked: bool
    fingerprint: str

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class CheckpointError(EngineError):
    """A checkpoint refused before anything was loaded. ``problem`` says what is wrong without the path (a
    server quotes the path its client sent instead); ``tensor`` is the first tensor concerned, if any."""

    def __init__(self, path: str, problem: str, tensor: str | None = None, prefix: str = "") -> None:
        super().__init__(f"{prefix}checkpoint {path!r}: {problem}", "weight_dir")
        self.path = path
        self.problem = problem
        self.tensor = tensor
        self.prefix = prefix

    def __reduce__(self):  # keep the fields through pickling (Ray)
        return (type(self), (self.path, self.problem, self.tensor, self.prefix))

    def refused_by(self, what: str) -> CheckpointError:
        """The same problem as raised by ``what`` (e.g. ``update_weights``), saying nothing was changed."""
        return CheckpointError(self.path, f"{self.problem}; the weights were not changed", self.tensor,
                               f"{what}: ")


# ---- what a model expects ------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float32`` -> ``F32``)."""
    import torch

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
    if dtype not in names:
        raise ValueError(f"no safetensors dtype for {dtype}")
    return names[dtype]


def expected_from_model(model: torch.nn.Module) -> dict[str, TensorSpec]:
    """Every tensor of ``model.state_dict()``: its shape and dtype; parameters are required, persistent buffers
    not (the model computes them when a checkpoint omits them). Names of one tensor (tied embeddings:
    ``lm_head.weight`` is ``model.embed_tokens.weight``) list each other in ``tied``, so a checkpoint may hold
    either or both. Works on a model whose weights are on the ``meta`` device (an asleep engine)."""
    state = model.state_dict(keep_vars=True)  # keep_vars: tied names map to the same Parameter object
    params = {id(p) for p in model.parameters()}
    names_of: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names_of.setdefault(id(tensor), []).append(name)
    return {
        name: TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype),
                         tuple(n for n in names_of[id(tensor)] if n != name), id(tensor) in params)
        for name, tensor in state.items()
    }


def expected_from_dir(model_dir: str | Path) -> dict[str, TensorSpec]:
    """What the model in a safetensors directory expects: the tensors its headers list. When its config ties
    the word embeddings (``tie_word_embeddings``, or an ``lm_head.weight``-less directory with an
    ``*embed_tokens.weight``), ``lm_head.weight`` and the embedding are tied names of one tensor. Raises
    CheckpointError when the directory itself is not a readable checkpoint."""
    path = str(model_dir)
    config = _read_config(Path(model_dir), path, required=False) or {}
    headers = _read_headers(Path(model_dir), path)
    spec = {name: TensorSpec(h.shape, h.dtype) for name, h in headers.items()}
    embed = next((n for n in spec if n.endswith("embed_tokens.weight")), None)
    if embed is not None and (config.get("tie_word_embeddings") or "lm_head.weight" not in spec):
        spec[embed] = msgspec.structs.replace(spec[embed], tied=("lm_head.weight",))
        spec["lm_head.weight"] = TensorSpec(spec[embed].shape, spec[embed].dtype, (embed,))
    return spec


# ---- the check -----------------------------------------------------------------------------------------------


class _Header(msgspec.Struct, frozen=True):
    shape: tuple[int, ...]
    dtype: str
    file: str


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else "")


def _read_config(d: Path, path: str, *, required: bool) -> dict | None:
    f = d / CONFIG_FILE
    if not f.is_file():
        if required:
            raise CheckpointError(path, f"holds no {CONFIG_FILE} (the model is built from it: write the checkpoint "
                                        f"with save_pretrained, or put the model's {CONFIG_FILE} beside the weights)")
        return None
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"{CONFIG_FILE} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(path, f"{CONFIG_FILE} is not a JSON object (it holds a {type(config).__name__})")
    return config


def _normalized(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict as transformers reads it (defaults filled, rope_theta/rope_scaling folded into
    rope_parameters in transformers 5); the dict itself when transformers cannot build it."""
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(**dict(config)).to_dict()
    except Exception:  # noqa: BLE001 - an unknown model_type: compared as written
        return dict(config)


def _check_config(path: str, given: Mapping[str, Any], served: Mapping[str, Any]) -> None:
    """Refuse a config.json that differs from the served model's on an :data:`ARCH_KEYS` key, naming it."""
    if given.get("model_type") != served.get("model_type"):
        raise CheckpointError(path, f"{CONFIG_FILE} sets model_type to {given.get('model_type')!r}, the served "
                                    f"model's is {served.get('model_type')!r} (a checkpoint of another architecture)")
    a, b = _normalized(given), _normalized(served)
    for key in ARCH_KEYS:
        if key == "architectures" and not given.get(key):
            continue  # unnamed: the engine builds its own class anyway
        if a.get(key) != b.get(key):
            raise CheckpointError(path, f"{CONFIG_FILE} sets {key} to {a.get(key)!r}, the served model's is "
                                        f"{b.get(key)!r}: it describes another model, which this engine cannot "
                                        f"load into the one it serves (write the served model's {CONFIG_FILE}, "
                                        "or none)")


def _weight_files(d: Path, path: str) -> tuple[list[Path], dict[str, str] | None]:
    """The files a loader reads: those the index lists (with its name -> file map), else every *.safetensors."""
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(path, f"{INDEX_FILE} is not a readable index ({type(exc).__name__}: {exc})") from None
        files = [d / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(path, f"{INDEX_FILE} lists {_names(absent)}, which "
                                        f"{'is' if len(absent) == 1 else 'are'} missing (an unfinished save?)")
        if not files:
            raise CheckpointError(path, f"{INDEX_FILE} lists no weight files")
        return files, weight_map
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(path, "holds no *.safetensors files")
    return files, None


TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def same_tensors(path: str | Path, served: str | Path, dtype: torch.dtype) -> bool:
    """Whether every tensor of checkpoint ``path`` equals the same tensor of the weights in ``served``, both in
    ``dtype`` (what the engine holds): prime-rl's ``step_0`` republishes the starting model, in bf16 and with a
    copy of a tied head (compared with the embedding it is tied to). Stops at the first tensor that differs;
    a name ``served`` lacks is a difference. Run on a checkpoint that passed validation."""
    import torch
    from safetensors import safe_open

    ref_dir = Path(served)
    ref_files, ref_map = _weight_files(ref_dir, str(served))
    where: dict[str, Path] = {}
    if ref_map is not None:
        where = {k: ref_dir / f for k, f in ref_map.items()}
    else:
        for f in ref_files:
            with safe_open(str(f), framework="pt") as h:
                where.update(dict.fromkeys(h.keys(), f))
    files, _ = _weight_files(Path(path), str(path))
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                ref_key = key if key in where else EMBEDDING if key == TIED_HEAD and EMBEDDING in where else None
                if ref_key is None:
                    return False
                with safe_open(str(where[ref_key]), framework="pt") as ref:
                    if not torch.equal(handle.get_tensor(key).to(dtype), ref.get_tensor(ref_key).to(dtype)):
                        return False
    return True


def _read_headers(d: Path, path: str) -> dict[str, _Header]:
    """Every tensor's shape, dtype and file, from the headers alone (milliseconds for any size)."""
    from safetensors import safe_open

    files, weight_map = _weight_files(d, path)
    found: dict[str, _Header] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                names = list(handle.keys())
                headers = [(n, handle.get_slice(n)) for n in names]
                headers = [(n, _Header(tuple(s.get_shape()), s.get_dtype(), f.name)) for n, s in headers]
        except Exception as exc:  # noqa: BLE001 - any unreadable header is a bad checkpoint
            raise CheckpointError(path, f"cannot read the safetensors header of {f.name} "
                                        f"({type(exc).__name__}: {exc})") from None
        if not names:
            raise CheckpointError(path, f"{f.name} holds no tensors")
        for name, header in headers:
            if name in found:
                raise CheckpointError(path, f"{name} is in both {found[name].file} and {f.name}", name)
            found[name] = header
    if weight_map is not None:
        misplaced = [n for n, file in weight_map.items() if n not in found or found[n].file != file]
        if misplaced:
            n = misplaced[0]
            raise CheckpointError(path, f"{INDEX_FILE} puts {n} in {weight_map[n]}, which does not hold it"
                                        + (f" (+{len(misplaced) - 1} more such tensors)" if len(misplaced) > 1 else ""),
                                  n)
    return found


def _check_against(path: str, found: Mapping[str, _Header], expected: Expected) -> None:
    missing: list[str] = []
    for n, s in expected.items():  # a tied tensor is missing when none of its names is there; it is listed once
        if s.required and n not in found and not any(t in found or t in missing for t in s.tied):
            missing.append(n)
    if missing:
        seen: set[str] = set()
        distinct = 0  # tensors, a tied one counted once
        for n, s in expected.items():
            distinct += not seen.intersection(s.tied)
            seen.add(n)
        raise CheckpointError(path, f"lacks {len(missing)} of the model's {distinct} tensors: {_names(missing)} "
                                    "(an incomplete save? loading it would leave them randomly initialised)",
                              missing[0])
    unknown = [n for n in found if n not in expected]
    if unknown:
        raise CheckpointError(path, f"holds {len(unknown)} tensor(s) the model does not have: {_names(unknown)} "
                                    "(a checkpoint of another architecture?)", unknown[0])
    shapes = [n for n, h in found.items() if h.shape != expected[n].shape]
    if shapes:
        n = shapes[0]
        more = f" (+{len(shapes) - 1} more tensors of another shape)" if len(shapes) > 1 else ""
        raise CheckpointError(path, f"{n} has shape {list(found[n].shape)}, the model's is "
                                    f"{list(expected[n].shape)}{more} (a checkpoint of another model size?)", n)
    for n, h in found.items():
        want = expected[n].dtype
        if not loadable_dtype(h.dtype, want):
            need = "/".join(LOADABLE_FLOAT) if want in _FLOAT else want
            raise CheckpointError(path, f"{n} has dtype {h.dtype}, which cannot be loaded into the model's {want} "
                                        f"(save it as {need})", n)


def loadable_dtype(have: str, want: str) -> bool:
    """Whether a tensor of safetensors dtype ``have`` loads into a model tensor of dtype ``want``: any float into a
    float (converted on load), else only the same dtype."""
    return have in LOADABLE_FLOAT if want in _FLOAT else have == want


def _nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, inf count) of a floating tensor; one reduction when all are finite (see the module doc)."""
    import torch

    if t.numel() == 0:
        return 0, 0
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()  # half types and float8: sum and count in float32 (F16 sums overflow early)
    if bool(torch.isfinite(t.sum())):
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _check_values(d: Path, path: str, found: Mapping[str, _Header]) -> None:
    from safetensors import safe_open

    bad: list[tuple[str, int, int, int]] = []
    by_file: dict[str, list[str]] = {}
    for name, h in found.items():
        if h.dtype in _FLOAT:
            by_file.setdefault(h.file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(d / file), framework="pt") as handle:
            for name in names:
                try:
                    t = handle.get_tensor(name)
                except Exception as exc:  # noqa: BLE001 - e.g. a dtype this torch cannot represent
                    raise CheckpointError(path, f"cannot read {name} from {file} ({type(exc).__name__}: {exc})",
                                          name) from None
                nan, inf = _nonfinite(t)
                if nan or inf:
                    bad.append((name, nan, inf, t.numel()))
    if bad:
        name, nan, inf, numel = bad[0]
        more = f"; {len(bad) - 1} more tensors hold non-finite values" if len(bad) > 1 else ""
        raise CheckpointError(path, f"{name} holds {nan} NaN and {inf} inf values (of {numel}){more} "
                                    "(a diverged training step?)", name)


def fingerprint(path: str | Path) -> str:
    """A digest of the names, sizes and mtimes of a directory's weight files, index and config: it changes when
    any of them is rewritten. Empty for a path that is not a directory."""
    d = Path(path)
    if not d.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted([*d.glob("*.safetensors"), d / INDEX_FILE, d / CONFIG_FILE]):
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def validate_checkpoint(path: str | Path, expected: Expected | None, *, check_values: bool = True,
                        require_config: bool = False,
                        served_config: Mapping[str, Any] | None = None) -> CheckpointReport:
    """Check the checkpoint directory ``path`` against ``expected`` (None: layout and values only, for a
    backend without a model) as the module doc lists; raise :class:`CheckpointError` at the first problem,
    else return the report. Reads each tensor once when ``check_values``; never builds a model."""
    t0 = time.perf_counter()
    p = str(path)
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(p, "not a directory" + (" (it is a file)" if d.exists() else " (nothing is there)"))
    digest = fingerprint(d)
    _weight_files(d, p)  # "no weights" says more about an empty directory than "no config.json"
    config = _read_config(d, p, required=require_config)
    if config is not None and served_config is not None:
        _check_config(p, config, served_config)
    found = _read_headers(d, p)
    if expected is not None:
        _check_against(p, found, expected)
    if check_values:
        _check_values(d, p, found)
    files = {h.file for h in found.values()}
    size = sum((d / f).stat().st_size for f in files)
    return CheckpointReport(p, len(files), len(found), size, time.perf_counter() - t0, check_values, digest)


class CheckpointValidator:
    """:func:`validate_checkpoint` against one model, remembering the last checkpoint that passed: the same
    path with the same :func:`fingerprint` (no file rewritten since) passes again without reading it. So the
    check a caller ran before pausing (``validate_weights``) is not repeated inside ``update_weights`` while the
    engine is paused. Thread-safe enough for its use: a lost race only re-reads a checkpoint."""

    def __init__(self, expected: Expected | None, *, require_config: bool = False,
                 served_config: Mapping[str, Any] | None = None) -> None:
        self.expected = expected
        self.require_config = require_config
        self.served_config = served_config
        self._last: CheckpointReport | None = None

    def __call__(self, path: str | Path) -> CheckpointReport:
        last = self._last
        if last is not None and last.path == str(path) and last.fingerprint and last.fingerprint == fingerprint(path):
            return last
        report = validate_checkpoint(path, self.expected, require_config=self.require_config,
                                     served_config=self.served_config)
        self._last = report
        return report



def backend_free_check(path: str | Path) -> dict[str, Any]:
    """The check for a backend that has no ``validate_weights`` of its own (a "module:Class" backend): what needs
    no model (layout, headers, finite values; ``config.json`` not required). The report as a dict."""
    return validate_checkpoint(path, None, require_config=False).as_dict()
