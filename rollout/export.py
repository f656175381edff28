"""Moved to rollout/data/export.py (the training data room). This path stays so that code importing
``rollout.export`` keeps working; new code imports ``rollout.data.export``."""

from .data.export import *  # noqa: F403
