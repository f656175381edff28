"""What ``tito run`` shows while it runs: a start-up line, a ready line, then progress.

On a terminal the progress is a ``rich`` bar (rollouts done/total, ETA, rollouts written, tokens/s,
break rate, mean reward, errors). *Done* counts rollouts that finished sampling; *written* counts
those whose shard file is on disk (files are written per group, every ``output.flush_interval_s``),
so written trails done by up to a flush interval, and a run whose writes fail shows the gap. Anywhere else (a log file, CI, a pipe) it is a plain line every ``interval_s`` seconds
and at every ``percent_step`` percent, with no ANSI escape codes and no carriage returns, so a log
read later still shows how the run went. ``NO_COLOR`` (any non-empty value, https://no-color.org)
turns colour off everywhere; output that is not a terminal never gets colour or cursor codes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..loop import RolloutDriver, RolloutOutcome


def no_color() -> bool:
    """True when the user asked for no colour: ``NO_COLOR`` set to any non-empty value."""
    return bool(os.environ.get("NO_COLOR"))


def is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like object without a terminal behind it
        return False


def use_color(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR``."""
    return is_tty(stream) and not no_color()


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Counts finished rollouts (the driver's ``on_progress`` callback) and shows them.

    ``enabled=False`` shows nothing (``--quiet``, tests). ``note(text)`` prints a line (the start-up and
    ready lines) above the bar, or as is without a terminal. ``start()`` shows the bar; ``finish()``
    ends it with the final figures.
    """

    def __init__(self, total: int, enabled: bool = True, stream: IO[str] | None = None, *, label: str = "tito run",
                 interval_s: float = 10.0, percent_step: float = 10.0) -> None:
        self.total, self.done, self.tokens, self.reward_sum, self.turns, self.errors = total, 0, 0, 0.0, 0, 0
        self.start_time = time.perf_counter()
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.label = label
        self.interval_s, self.percent_step = interval_s, percent_step
        self.driver: RolloutDriver | None = None  # set once the driver exists: it counts the breaks
        self.tty = is_tty(self.stream)
        self._lock = threading.Lock()
        self._bar: Any = None  # the rich Progress while it is shown
        self._task: Any = None
        self._console: Any = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_print = 0.0
        self._last_printed: tuple[int, int] | None = None  # (done, written) on the last plain line
        self._last_step = 0
        self._watched: Path | None = None  # the shard folder whose new files count as written
        self._seen: dict[str, int] = {}  # shard file -> rollouts in it (None-free: files never change once named)
        self._before: set[str] = set()  # files already there when the run started (a resume's)
        self._last_scan = float("-inf")
        self.written = 0
        if enabled and self.tty:
            from rich.console import Console

            # force_terminal: the stream is a terminal (checked above) even where rich's own guess differs
            self._console = Console(file=self.stream, force_terminal=True, no_color=no_color(), highlight=False,
                                    soft_wrap=True)

    # ---- counting ---------------------------------------------------------------------------------

    def __call__(self, o: RolloutOutcome) -> None:
        with self._lock:
            self.done += 1
            self.tokens += o.completion_tokens
            self.turns += o.turns
            self.reward_sum += o.reward
            self.errors += o.error is not None
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, stats=self.stats())
        elif not self.tty:
            step = int(self.done * 100 / self.total // self.percent_step) if self.total and self.percent_step else 0
            if step > self._last_step or self.done == self.total:
                self._last_step = step
                self._print_line()

    def watch(self, folder: str | Path) -> None:
        """Count as *written* the rollouts in shard files that appear in ``folder`` from now on."""
        from ..data.shards import output_shards

        self._watched = Path(folder)
        self._before = {p.name for p in output_shards(self._watched)} if self._watched.is_dir() else set()

    def scan_written(self, min_interval_s: float = 1.0) -> int:
        """Rollouts in the shard files written since :meth:`watch` (at most one directory listing per
        ``min_interval_s``; each new file's ``segment_index`` column is read once)."""
        if self._watched is None or time.perf_counter() - self._last_scan < min_interval_s:
            return self.written
        from ..data.shards import ShardCorrupt, output_shards, read_table

        self._last_scan = time.perf_counter()
        try:
            for p in output_shards(self._watched) if self._watched.is_dir() else []:
                if p.name not in self._before and p.name not in self._seen:
                    self._seen[p.name] = read_table(p, columns=["segment_index"])["segment_index"].to_pylist().count(0)
        except (OSError, ShardCorrupt):  # a file renamed or removed while listed: counted on the next scan
            pass
        self.written = sum(self._seen.values())
        return self.written

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_time

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before the first rollout finishes."""
        if not self.done:
            return None
        return self.elapsed_s / self.done * max(self.total - self.done, 0)

    def stats(self) -> str:
        """tokens/s, break rate, mean reward and errors (the figures next to the bar)."""
        rate = self.tokens / max(self.elapsed_s, 1e-9)
        breaks = self.driver.breaks if self.driver is not None else 0
        break_rate = breaks / self.turns if self.turns else 0.0
        written = f"written {self.scan_written()}  " if self._watched is not None else ""
        return (f"{written}{rate:,.0f} tok/s  break rate {break_rate:.3f}  mean reward {self.reward_sum / max(self.done, 1):.3f}  "
                f"errors {self.errors}")

    def line(self) -> str:
        """The whole state as one plain line (what a log gets)."""
        pct = f" ({self.done * 100 / self.total:.0f}%)" if self.total else ""
        eta = self.eta_s()
        return (f"rollouts {self.done}/{self.total}{pct}  elapsed {_clock(self.elapsed_s)}  "
                f"ETA {_clock(eta) if eta is not None else '?'}  {self.stats()}")

    # ---- showing ----------------------------------------------------------------------------------

    def note(self, text: str) -> None:
        """A line of its own: ``"<label>: <text>"`` (the label bold and coloured on a terminal)."""
        if not self.enabled:
            return
        if self._console is not None:
            from rich.text import Text

            self._console.print(Text.assemble((f"{self.label}:", "bold cyan"), " ", text))
        else:
            with self._lock:
                self.stream.write(f"{self.label}: {text}\n")
                self.stream.flush()

    def start(self) -> None:
        """Show the bar (a terminal) or start the timed plain lines (anything else); rates count from here."""
        self.start_time = time.perf_counter()
        if not self.enabled:
            return
        atexit.register(self.finish)  # a run that raises must not leave the terminal's cursor hidden
        if self._console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            from rich.text import Text

            class TwoLines(RichProgress):
                # the figures on a line of their own under the bar: both fit an 80-column terminal
                def get_renderables(self):
                    yield self.make_tasks_table(self.tasks)
                    for task in self.tasks:
                        yield Text("  " + task.fields["stats"], style="dim")

            self._bar = TwoLines(
                TextColumn("[bold]rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), console=self._console, refresh_per_second=4,
            )
            self._task = self._bar.add_task("rollouts", total=self.total, completed=self.done, stats=self.stats())
            self._bar.start()
        self._last_print = time.perf_counter()
        self._ticker = threading.Thread(target=self._tick, name="tito-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        # a line every interval_s even when no rollout finishes (long rollouts must not look like a hang);
        # on a terminal, the bar's figures (the written count moves without a rollout finishing)
        while not self._stop.wait(min(self.interval_s, 1.0)):
            bar = self._bar
            if bar is not None:
                bar.update(self._task, stats=self.stats())
            elif time.perf_counter() - self._last_print >= self.interval_s:
                self._print_line()

    def _print_line(self) -> None:
        with self._lock:
            self._last_print = time.perf_counter()
            text = self.line()
            self._last_printed = (self.done, self.written)
            self.stream.write(f"{self.label}: {text}\n")
            self.stream.flush()

    def finish(self) -> None:
        """Stop the bar (it stays on screen with the final figures) or print the last plain line."""
        if not self.enabled:
            return
        atexit.unregister(self.finish)
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            self._ticker = None
        self._last_scan = float("-inf")  # the final figures count every file written, the last flush's included
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, stats=self.stats())
            self._bar.stop()
            self._bar = None
        elif not self.tty and self._last_printed != (self.done, self.scan_written()):
            self._print_line()


def startup_line(cfg: Any, model_path: str, rollouts: int) -> str:
    """What ``tito run`` is about to start: model, engines, renderer, output."""
    e = cfg.engine
    renderer = cfg.renderer.name or "auto (by template hash)"
    model = cfg.model if str(cfg.model) == model_path else f"{cfg.model} ({model_path})"
    return (f"starting {rollouts} rollouts of {cfg.env.name}: model {model}, {e.count} x {e.backend} engine, "
            f"renderer {renderer} x {cfg.renderer.actors}, output {cfg.output.dir} ({cfg.output.format})")


def ready_line(startup_s: float, engines: int, renderer_info: dict[str, Any]) -> str:
    """Engines and renderers are up: how long it took and which renderer was chosen."""
    sha = (renderer_info.get("template_sha256") or "")[:16]
    return (f"ready in {startup_s:.1f} s: {engines} engine{'s' if engines != 1 else ''} up, "
            f"renderer {renderer_info.get('renderer')} (template {sha or '?'})")
