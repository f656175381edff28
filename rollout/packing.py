"""Moved to rollout/data/packing.py (the training data room). This path stays so that code importing
``rollout.packing`` keeps working; new code imports ``rollout.data.packing``."""

from .data.packing import *  # noqa: F403
