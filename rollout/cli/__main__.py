"""``python -m rollout.cli``: the command line without Ray's placement (render, template, inspect, ...)."""

import sys

from .main import main

sys.exit(main())
