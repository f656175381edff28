"""tito's rollout runtime: configs, engines, environments, the loop, shards, serving and the ``tito`` command."""
