"""The command line: ``tito`` and its sub-commands, and what they print while they run.

- main.py: the parser and the small commands (render, template, pull, export); ``main`` is the entry point.
- run_cmd.py / run.py: ``tito run`` (and ``tito inspect``): its arguments, then the job — Ray, actors, the
  rollout driver, shards, the summary, signals and exit statuses (or the follow service with ``--follow``).
- serve_cmd.py: ``tito serve``'s arguments (the server itself is rollout/serve/).
- doctor.py, coexist.py: ``tito doctor``: versions, import locations, a conflict with PyPI ``renderers``.
- progress.py: the start-up line, the ready line, the progress bar.

It may import everything in rollout/ (it is the top floor of the package) and tito_renderers; nothing in
rollout/ imports it. actors/cli.py hands it Ray's placement."""

from .main import main

__all__ = ["main"]
