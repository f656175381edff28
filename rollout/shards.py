"""Moved to rollout/data/shards.py (the training data room). This path stays so that code importing
``rollout.shards`` keeps working; new code imports ``rollout.data.shards``."""

from .data.shards import *  # noqa: F403
