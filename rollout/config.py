"""Run configuration: a YAML file validated by pydantic, with ``--set key.path=value`` overrides.

Every model forbids unknown keys, so a typo is an error that names it instead of a silently
ignored setting.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# what every engine accepts per request; the seed range is also the shards' int64 seed column's
from .engines.protocol import INT64_MAX, INT64_MIN, MIN_TEMPERATURE


class ConfigError(ValueError):
    """A configuration problem; the text names the key."""


def _is_number(annotation: Any) -> bool:
    """``int`` or ``float``, optionally ``| None``: a field where YAML ``true``/``false`` is a mistake."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(rest) and all(_is_number(a) for a in rest)
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0: `group_size: true` would quietly run groups of 1
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"must be a number, got {str(value).lower()}")
        return value


Backend = Literal["embedded", "vllm", "replay"]


class EngineConfig(_Strict):
    backend: Backend = "embedded"
    count: int = Field(1, ge=1, description="engine actors to start")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the backend")
    backend_options: dict[Backend, dict[str, Any]] = Field(default_factory=dict, description=(
        "keyword arguments for one backend only, e.g. {embedded: {threads: 1}}: used when it is engine.backend "
        "(under engine.options, which win), so --set engine.backend=... switches with no other change"))
    max_concurrency: int = Field(64, ge=1, description="requests one engine actor serves at once")
    num_cpus: float | None = Field(None, ge=0, allow_inf_nan=False, description=(
        "Ray CPUs per engine actor (default: embedded 1, vllm 1, replay 0; a local run that cannot fit them "
        "gives each engine an equal share of the CPUs left by the renderer actors)"))
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False,
                                   description="Ray GPUs per engine actor (default: vllm 1, others 0)")
    overload_factor: float = Field(1.5, gt=1, description="sticky routing leaves an engine busier than this x the least loaded")
    placement: Literal["spread", "pack"] = Field(
        "spread", description="spread: engine actors over as many Ray nodes as fit; pack: Ray's default placement")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per engine actor "
                                                                         "(pins engines to the nodes offering them)")
    max_restarts: int = Field(3, ge=0, description=(
        "times a lost engine actor (killed, OOM, hung) is restarted and brought back with the current weights; "
        "0: a lost engine stays lost and the others serve on"))
    heartbeat_interval_s: float = Field(2.0, gt=0, allow_inf_nan=False, description="seconds between engine health probes")
    heartbeat_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False, description=(
        "an engine whose probe does not answer this long, or that makes no progress this long with requests in "
        "flight, is hung: it is killed and restarted"))
    restart_timeout_s: float = Field(900.0, gt=0, allow_inf_nan=False, description=(
        "seconds a restarted engine may take to come back (build its backend, load the current weights)"))
    weight_transfer: Literal["none", "gloo", "nccl"] = Field("none", description=(
        "weights sent by the trainer over vLLM's weight-transfer routes (/init_weight_transfer_engine ...): gloo "
        "(CPU, the embedded engine), nccl (vLLM's own engine, CUDA GPUs); none: nothing listens"))
    weight_transfer_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False, description=(
        "the longest any weight-transfer wait on the trainer may take (joining its group, each tensor): past it the "
        "call fails and the engines keep the weights they served"))

    @property
    def backend_kwargs(self) -> dict[str, Any]:
        """What the chosen backend is constructed with: its own section of backend_options, then options."""
        return {**self.backend_options.get(self.backend, {}), **self.options}


class RendererConfig(_Strict):
    name: str | None = Field(None, description="force a renderer family instead of choosing by template hash")
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    thinking_retention: Literal["keep", "template"] = "keep"
    actors: int = Field(1, ge=1, description="renderer actors side by side")
    num_cpus: float = Field(0.25, ge=0, description="Ray CPUs per renderer actor")
    call_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False, description=(
        "a renderer call (a render, a bridge, a group's rows written) that takes longer stops the run with one line "
        "naming the renderer: its rollouts' state lives there"))
    start_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False, description=(
        "the renderer actors must be placed and have loaded the tokenizer within this, else the run stops in one "
        "line (no node has the resources asked for, or the actor is stopped or wedged)"))
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per renderer actor "
                                                                         "(places the shard writers on those nodes)")


class EnvConfig(_Strict):
    name: str = Field("arithmetic", description="a built-in, 'package.module:Class' or a tito.environments entry "
                                                "point (`tito envs` lists them)")
    options: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False, description=(
        "the longest one reset, step or score may take: past it the rollout ends with env_error"))
    max_message_chars: int = Field(1_000_000, ge=1, description=(
        "the most characters one step's messages may hold together (a tool that prints 100 MB): more is env_error"))
    max_error_rate: float = Field(0.5, ge=0, le=1, description=(
        "env_error rollouts / finished rollouts above this (once env.error_rate_after finished) stop the run; "
        "1: never"))
    error_rate_after: int = Field(20, ge=1, description="finished rollouts before env.max_error_rate applies")


class TasksConfig(_Strict):
    path: str | None = Field(None, description="a JSONL or Parquet task file; none = the environment's generator")
    count: int | None = Field(None, ge=1, description="tasks to run (generated, or the first N of the file)")
    seed: int = 0


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False,
                               description=f"0 (greedy) or at least {MIN_TEMPERATURE}, as every engine accepts")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1: off; k >= 1: sample from the k likeliest tokens")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="none, or a signed 64-bit integer (the shards' seed column): each turn's seed derives from it")

    @field_validator("temperature")
    @classmethod
    def _not_too_small(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value}")
        return value


class AdvantageConfig(_Strict):
    normalize_std: bool = Field(False, description="divide reward - group mean by the group's std")


class OutputConfig(_Strict):
    dir: str = "out/run"
    format: Literal["arrow", "parquet"] = "arrow"
    rows_per_file: int = Field(1024, ge=1, description="a file is written once pending whole groups hold this many rows")
    flush_interval_s: float = Field(10.0, ge=0, description="... or once the oldest pending group waited this long "
                                                          "(0: a file per group); groups never straddle files")

    @field_validator("dir")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():  # Path("") is the current directory: never what an empty setting meant
            raise ValueError(f"must name a directory, got {value!r}")
        return value


class PrimeRLConfig(_Strict):
    """The prime-rl orchestrator settings its trainer's rank files are packed with (``follow.output_format:
    prime-rl``); named and bounded as prime-rl's orchestrator config names them, so they are copied from it."""

    seq_len: int = Field(2048, ge=1, description=(
        "the trainer's sequence length: each micro batch holds at most this many tokens; a longer sample is "
        "truncated to its first seq_len tokens, as prime-rl does"))
    num_train_workers: int = Field(1, ge=1, description=(
        "the trainer's data-parallel world size: one rollouts/step_k/rank_<r>.bin per rank"))
    pad_to_multiple_of: int = Field(1, ge=1, description="pad each micro batch to a multiple of this (the trainer's cp)")


class EvalTasksConfig(_Strict):
    count: int = Field(64, ge=1, description="held-out tasks evaluated at each evaluated version")
    seed: int | None = Field(None, description="the generator's seed; none: tasks.seed + 1 (tasks that also appear "
                                               "in the training pool are dropped either way)")
    path: str | None = Field(None, description="a JSONL or Parquet task file instead of the generator")


class EvalConfig(_Strict):
    """``follow.eval``: held-out evaluation while training (docs/follow.md "Evaluation")."""

    every: int = Field(10, ge=1, description="evaluate version 0, then every version that is a multiple of this")
    env: EnvConfig | None = Field(None, description="none: the run's env")
    tasks: EvalTasksConfig = Field(default_factory=EvalTasksConfig)
    sampling: SamplingConfig | None = Field(None, description="none: the run's sampling")
    group_size: int = Field(1, ge=1, description="rollouts per eval task (pass@k is over these)")
    correct_at: float = Field(1.0, allow_inf_nan=False, description="a rollout counts as correct at this reward")


class FollowConfig(_Strict):
    """``tito run --follow RUN_DIR`` (continuous RL, docs/follow.md): batches of groups written while a trainer
    trains, the trainer's weights loaded as they are published."""

    groups_per_step: int = Field(8, ge=1, description="groups (tasks x group_size rollouts) in each batch")
    max_steps: int | None = Field(None, ge=1, description="seal this many batches, then stop; none = until a signal")
    max_off_policy_steps: int = Field(1, ge=0, description=(
        "S: every sampled token of batch k comes from a version >= k - 1 - S (0 = on-policy). It also bounds the "
        "lead: with no new weights the service seals at most S + 1 batches ahead of the trainer, then waits"))
    inflight: Literal["abort_resume", "drain", "keep"] = Field("abort_resume", description=(
        "rollouts running when new weights arrive: abort_resume (stop them, keep their sampled tokens stamped with "
        "the old version, continue under the new weights: exact), drain (finish them on the old weights first), "
        "keep (continue in place under the new weights on the KV the old ones computed, each token stamped with "
        "the version that sampled it; embedded and replay engines only, see docs/follow.md)"))
    poll_interval_s: float = Field(0.5, gt=0, le=60, description="how often broadcasts/ is scanned for new weights")
    status_interval_s: float = Field(2.0, gt=0, le=5, description=(
        "how often RUN_DIR/status.json is rewritten, idle included (`tito status` calls it gone after 3 intervals)"))
    stall_after_s: float = Field(300.0, gt=0, description=(
        "`tito status` reports the service stalled when nothing progressed (a rollout finished, a batch was admitted "
        "or sealed, new weights loaded) for this long"))
    load_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False, description=(
        "an engine that does not validate or load a checkpoint within this is hung: killed and restarted on the "
        "weights the others hold (a checkpoint whose validation timed out is refused)"))
    keep_broadcasts: int | None = Field(None, ge=1, description=(
        "remove broadcasts/step_N older than the newest N the service has seen once it no longer needs them (it "
        "keeps what the engines hold); none (default): the trainer owns broadcasts/ and the service removes nothing"))
    output_format: Literal["shards", "prime-rl"] = Field("shards", description=(
        "shards: each batch as Arrow shards (read_step); prime-rl: also as prime-rl's trainer reads it, "
        "rollouts/step_k/rank_<r>.bin (msgspec micro batches, packed by follow.prime_rl), before the batch seals"))
    prime_rl: PrimeRLConfig = Field(default_factory=PrimeRLConfig)
    eval: EvalConfig | None = Field(None, description="held-out evaluation at every eval.every-th version; none: off")
    weights: Literal["files", "wire"] = Field("files", description=(
        "files: load the checkpoints the trainer writes to RUN_DIR/broadcasts/step_N (STABLE last); wire: the "
        "trainer pushes tensors over vLLM's weight-transfer routes, served on follow.listen (needs "
        "engine.weight_transfer: gloo; docs/follow.md \"Weights over the wire\")"))
    listen: str = Field("127.0.0.1:8011", description=(
        "follow.weights: wire: HOST:PORT of the weight-transfer routes (loopback by default; port 0: any free one, "
        "named in the log and status.json); their admin routes take TITO_ADMIN_API_KEY when it is set"))

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"follow.listen must be HOST:PORT (e.g. 127.0.0.1:8011; port 0: any free one), got "
                             f"{value!r}")
        return value


class RayConfig(_Strict):
    address: str | None = Field(None, description="join this cluster; none = start a local Ray")
    num_cpus: int | None = None


class RunConfig(_Strict):
    model: str = Field("smollm2-135m", description="model directory, GGUF file or alias")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    renderer: RendererConfig = Field(default_factory=RendererConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    group_size: int = Field(4, ge=1, description="rollouts per task (GRPO group)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    max_turns: int = Field(4, ge=1)
    max_tokens_per_turn: int = Field(256, ge=1)
    max_tokens_per_rollout: int = Field(2048, ge=1, description="sampled tokens over all turns of a rollout")
    rollout_timeout_s: float = Field(600.0, gt=0)
    max_concurrent_rollouts: int = Field(64, ge=1)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    follow: FollowConfig = Field(default_factory=FollowConfig)

    @model_validator(mode="after")
    def _budgets(self) -> RunConfig:
        if self.max_tokens_per_turn > self.max_tokens_per_rollout:
            raise ValueError("max_tokens_per_turn must not exceed max_tokens_per_rollout")
        if self.follow.weights == "wire" and self.engine.weight_transfer == "none":
            raise ValueError("follow.weights: wire needs the engines to receive tensors: set engine.weight_transfer: "
                             "gloo (the trainer then sends with rollout.engines.gloo_sender.GlooWeightSender)")
        return self


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="address to listen on (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="0 = any free port")
    log_level: str = "warning"
    # SecretStr: the key never shows in a repr, a dump or an error message
    api_key: SecretStr | None = Field(
        None, description="clients must send 'Authorization: Bearer <key>' on every route but /health and "
                          "/liveness (401 otherwise); none = the TITO_API_KEY environment variable, else no key")
    admin_api_key: SecretStr | None = Field(
        None, description="the admin routes (weights, pause/resume, sleep/wake_up, prefix cache) take only this "
                          "key; none = TITO_ADMIN_API_KEY, else api_key")
    weights_root: str | None = Field(
        None, description="/update_weights loads only directories under this one (403 otherwise); none = "
                          "every weight update is refused")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body not received in full this long after "
                                                          "the request started is refused with 408")


class SessionsConfig(_Strict):
    idle_timeout_s: float = Field(900.0, gt=0, description="a session unused this long is finished and dropped")
    max_sessions: int = Field(100_000, ge=1, description="sessions held at once; a new one beyond is refused (429)")
    max_idle_bytes: int | None = Field(
        1 << 30, ge=0, description="payload bytes (token ids + samples) all sessions may hold; over it the least "
                                   "recently used idle sessions are ended first; none = no bound")


class ServeOutputConfig(_Strict):
    dir: str | None = Field(None, description="write finished sessions' samples as shards here; none = keep nothing")
    format: Literal["arrow", "parquet"] = "arrow"
    rows_per_file: int = Field(1024, ge=1)


class ServeConfig(_Strict):
    """``tito serve``: the engines and renderers of ``tito run`` behind an HTTP API."""

    model: str = Field("smollm2-135m", description="model directory, GGUF file or alias")
    served_model_name: str | None = Field(None, description="the name clients send as `model` (default: model)")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    renderer: RendererConfig = Field(default_factory=RendererConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request has none; none = the room left in max_model_len")
    engine_in_process: bool = Field(
        False, description="run replay/embedded engines inside the server process instead of as Ray actors "
                           "(one node; saves the Ray round trip per request)")
    output: ServeOutputConfig = Field(default_factory=ServeOutputConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _in_process(self) -> ServeConfig:
        if self.engine_in_process and self.engine.backend == "vllm":
            raise ValueError("engine_in_process supports the replay and embedded backends, not vllm")
        return self


class StartupConfig(Protocol):
    """What RunConfig and ServeConfig share, and all that the start-up common to ``tito run`` and ``tito serve``
    reads (rollout/startup.py)."""

    @property
    def model(self) -> str: ...

    @property
    def engine(self) -> EngineConfig: ...

    @property
    def renderer(self) -> RendererConfig: ...

    @property
    def ray(self) -> RayConfig: ...


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def _description(schema: type[BaseModel], loc: tuple) -> str | None:
    """The description of the field at ``loc`` (what it means and accepts), if it has one."""
    field = None
    for part in loc:
        field = schema.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        inner = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type)]
        schema = next((a for a in inner if issubclass(a, BaseModel)), BaseModel)
    return field.description if field is not None else None


def _format_error(exc: ValidationError, schema: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        about = _description(schema, err["loc"]) if err["type"] != "extra_forbidden" else None
        lines.append(f"{key}: {msg}" + (f" — {about}" if about else ""))
    if len(lines) == 1:  # the usual case: one line, the key and what it accepts
        return f"invalid configuration: {lines[0]}"
    return "invalid configuration:\n" + "\n".join(f"  {line}" for line in lines)


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type[_Strict] = RunConfig) -> Any:
    """Read a YAML config (or none: all defaults) and apply ``key.path=value`` overrides, whose values
    are parsed as YAML (``--set group_size=8``, ``--set engine.options.threads=2``); validated as
    ``schema`` (RunConfig, or ServeConfig for ``tito serve``)."""
    data: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key.path=value, got {item!r}")
        _set_path(data, key.strip(), yaml.safe_load(raw))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, schema)) from None
