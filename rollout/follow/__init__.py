"""Continuous RL: ``tito run CONFIG --follow RUN_DIR`` samples while a trainer trains.

The trainer and tito meet in one run directory (prime-rl's layout, see :mod:`rollout.data.layout`):
the trainer publishes weights as ``broadcasts/step_N/`` (``STABLE`` last), tito writes batch k to
``rollouts/step_k/`` (``_manifest.json`` last). One rule bounds off-policyness: every sampled token of
batch k comes from a version >= k - 1 - ``follow.max_off_policy_steps``.

Modules: ``publish`` (the trainer's side: publish weights), ``service`` (the rollout side: admission,
weight following, sealing), ``metrics`` (metrics.jsonl and W&B), ``status`` (status.json). The directory protocol both sides share
is rollout/data/layout.py; the trainer reads batches with ``rollout.data.read_step``.

It may import the loop core (rollout/loop.py, handles, config), rollout/data, rollout/engines (checkpoint
validation) and rollout/envs; never the command line, serve or actors.
"""
