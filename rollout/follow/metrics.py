"""Per-step metrics of ``tito run --follow``: one JSON line per sealed batch, and Weights & Biases when set up.

:class:`MetricsSink` appends each line to ``RUN_DIR/metrics.jsonl`` (the record the run directory keeps,
always) and, when wandb is installed *and* configured, logs the line's numeric leaves to a W&B run.

When W&B is used (checked once, when the sink is made; nothing here imports wandb unless it is used):

* never when ``WANDB_MODE=disabled`` or ``WANDB_DISABLED`` is set to anything but ``""``/``0``/``false``/
  ``no``/``off`` (the Hugging Face Trainer's switch; wandb itself ignores it);
* otherwise when ``WANDB_MODE`` is set (``online``, ``offline``, ``shared``), ``WANDB_API_KEY`` is set, or
  ``wandb login`` stored a key for the W&B host (``WANDB_BASE_URL``, default api.wandb.ai) in ``$NETRC``
  or ``~/.netrc``;
* otherwise not: a machine that never set W&B up gets ``metrics.jsonl`` only, silently. Configured but not
  installed (tito's ``wandb`` extra) is one line on stderr.

The W&B run: project ``$WANDB_PROJECT`` (default ``tito``; entity ``$WANDB_ENTITY`` as wandb reads it), name
the run directory's name, config the run config, files under ``RUN_DIR/wandb/``. Its id is kept in
``RUN_DIR/.wandb_run_id`` and the run is started with ``resume="allow"``, so a restarted service goes on
with the same W&B run (batch k is W&B step k, and restarts only ever log later steps). Each line is logged
flattened, ``/`` between keys and list indices (``reward/mean``, ``staleness/0``, ``tokens_per_version/3``,
``weight_updates/0/load_s``): numbers only, ``step`` itself as the step. wandb's console capture is off
(the service's stderr and progress bar stay as they are) and its own terminal output is silenced: the
sink prints one line naming the run instead. ``wandb.init`` runs in the constructor and takes seconds
(online, up to wandb's ``init_timeout``): make the sink once, at start-up; ``log`` only queues.

W&B is a side channel: a failure in wandb (import, init, log) never stops the rollout service. It is one
line on stderr naming the problem, and the sink goes on with ``metrics.jsonl`` only. A failure to append
to ``metrics.jsonl`` (a full disk) is raised, as the service's other writes are.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import secrets
import string
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..data import layout

RUN_ID_FILE = ".wandb_run_id"
DEFAULT_PROJECT = "tito"
_OFF = {"", "0", "false", "no", "off"}


def _stderr(line: str) -> None:
    print(f"tito run --follow: {line}", file=sys.stderr, flush=True)


def wandb_disabled(env: Mapping[str, str] | None = None) -> bool:
    """``WANDB_MODE=disabled`` or ``WANDB_DISABLED`` set (to anything but an off value)."""
    env = os.environ if env is None else env
    return (env.get("WANDB_MODE", "").strip().lower() == "disabled"
            or env.get("WANDB_DISABLED", "").strip().lower() not in _OFF)


def _netrc_has_key(env: Mapping[str, str]) -> bool:
    path = Path(env.get("NETRC") or "~/.netrc").expanduser()
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    if not host or not path.is_file():
        return False
    try:
        creds = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(creds and creds[2])


def wandb_configured(env: Mapping[str, str] | None = None) -> str | None:
    """Why W&B should be used (``"WANDB_MODE=offline"``, ``"WANDB_API_KEY"``, ``"~/.netrc"``), or None.

    Says nothing about whether wandb is installed: see the module doc for the rule."""
    env = os.environ if env is None else env
    if wandb_disabled(env):
        return None
    mode = env.get("WANDB_MODE", "").strip()
    if mode:
        return f"WANDB_MODE={mode}"
    if env.get("WANDB_API_KEY", "").strip():
        return "WANDB_API_KEY"
    if _netrc_has_key(env):
        return env.get("NETRC") or "~/.netrc"
    return None


def _wandb_installed() -> bool:
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["wandb"] is None or has no spec
        return False


def flatten(line: Mapping[str, Any], prefix: str = "") -> dict[str, int | float]:
    """The numeric leaves of a metrics line, keyed by their path (``reward/mean``, ``staleness/0``).

    Dicts by key and lists by index; booleans, strings and None are left out."""
    out: dict[str, int | float] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{key}/{k}" if key else str(k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{key}/{i}" if key else str(i))
        elif isinstance(value, int | float) and not isinstance(value, bool) and key:
            out[key] = value

    walk(line, prefix)
    return out


def _run_id(run_dir: Path) -> str:
    """The W&B run id kept in RUN_DIR (made and stored, atomically, the first time)."""
    path = run_dir / RUN_ID_FILE
    try:
        run_id = path.read_text().strip()
    except FileNotFoundError:
        run_id = ""
    if run_id:
        return run_id
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # wandb's form
    tmp = path.with_name(f"{RUN_ID_FILE}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class MetricsSink:
    """``log(line)`` per sealed batch: ``RUN_DIR/metrics.jsonl``, and W&B when configured (module doc).

    ``run_dir`` must exist. ``config`` is the run config (the W&B run's config). ``log`` takes the sink's
    own lines (the W&B run it logs to, a W&B failure); stderr by default. Use it as a context manager, or
    call :meth:`close` (which finishes the W&B run) when the service stops."""

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any] | None = None, *,
                 log: Callable[[str], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / layout.METRICS
        self.config = dict(config or {})
        self._log = log or _stderr
        self.wandb_run: Any = None  # the wandb Run while W&B is logged to; None otherwise
        why = wandb_configured()
        if why is None:
            return
        if not _wandb_installed():
            self._log(f"W&B is configured ({why}) but wandb is not installed (pip install 'wandb>=0.19'): "
                      f"metrics go to {self.path} only")
            return
        self._start_wandb(why)

    def _start_wandb(self, why: str) -> None:
        try:
            import wandb

            run_id = _run_id(self.run_dir)
            # wandb.init suggests Weave on stderr past `silent` when an LLM client (openai, ...) is
            # imported; the service has no LLM calls to trace, so that hint is noise on its stderr.
            user_set = "WANDB_DISABLE_WEAVE" in os.environ
            os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            try:
                self.wandb_run = wandb.init(
                    project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                    name=self.run_dir.resolve().name,
                    id=run_id,
                    resume="allow",
                    dir=str(self.run_dir),
                    config=self.config,
                    settings=wandb.Settings(console="off", silent=True),
                )
            finally:
                if not user_set:
                    os.environ.pop("WANDB_DISABLE_WEAVE", None)
        except Exception as exc:  # noqa: BLE001 - any wandb failure: named once, the rollouts go on
            self.wandb_run = None
            self._log(f"W&B run not started ({why}): {type(exc).__name__}: {exc}; metrics go to {self.path} only")
            return
        run = self.wandb_run
        try:  # (run.url warns in offline mode)
            where = Path(run.dir).parent if getattr(run, "offline", True) else run.url
            self._log(f"W&B run {run.project}/{run.id} ({why}): {where}")
        except Exception:  # noqa: BLE001 - only the line's detail
            self._log(f"W&B run started ({why}) under {self.run_dir / 'wandb'}")

    def log(self, line: Mapping[str, Any]) -> None:
        """Append ``line`` to metrics.jsonl (one line, flushed), then log it to W&B at ``step=line["step"]``."""
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
        if self.wandb_run is None:
            return
        try:
            data = {k: v for k, v in flatten(line).items() if k != "step"}
            self.wandb_run.log(data, step=int(line["step"]))
        except Exception as exc:  # noqa: BLE001 - see _start_wandb
            self.wandb_run = None  # broken: not finished either (that may block on the same problem)
            self._log(f"W&B logging stopped at step {line.get('step')}: {type(exc).__name__}: {exc}; "
                      f"metrics go to {self.path} only")

    def close(self, exit_code: int | None = None) -> None:
        """Finish the W&B run (``exit_code`` nonzero marks it failed). Idempotent; the jsonl needs no closing."""
        run, self.wandb_run = self.wandb_run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - see _start_wandb
            self._log(f"W&B run not finished cleanly: {type(exc).__name__}: {exc}")

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # an exception marks the W&B run failed; a signal (KeyboardInterrupt, CancelledError) is a stop
        self.close(exit_code=1 if exc_type is not None and issubclass(exc_type, Exception) else None)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of RUN_DIR/metrics.jsonl (a torn last line, from a kill mid-write, is left out)."""
    path = Path(run_dir) / layout.METRICS
    if not path.exists():
        return []
    lines = []
    with open(path) as f:
        for raw in f:
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return lines
