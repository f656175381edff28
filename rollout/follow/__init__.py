"""Continuous RL: ``tito run CONFIG --follow RUN_DIR`` samples while a trainer trains.

The trainer and tito meet in one run directory (prime-rl's layout, see :mod:`rollout.follow.layout`):
the trainer publishes weights as ``broadcasts/step_N/`` (``STABLE`` last), tito writes batch k to
``rollouts/step_k/`` (``_manifest.json`` last). One rule bounds off-policyness: every sampled token of
batch k comes from a version >= k - 1 - ``follow.max_off_policy_steps``.

Modules: ``layout`` (the directory protocol, shared by both sides), ``publish`` (the trainer's side:
publish weights), ``service`` (the rollout side: admission, weight following, sealing).
"""
