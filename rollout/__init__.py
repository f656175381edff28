"""tito's rollout runtime: the loop core here, and one room per job.

At the top, the loop core: config.py (run and serve configs), startup.py (what run and serve share),
loop.py (the multi-turn rollout driver), turns.py (the typed renderer boundary), handles.py (engine and
renderer handles), renderer_service.py, routing.py, models.py. The rooms: engines/ (backends, checkpoints),
envs/ (environments), data/ (shards and what reads them), follow/ (continuous RL beside a trainer),
serve/ (the HTTP server), cli/ (the ``tito`` command). docs/architecture.md draws how they connect.
packing.py, export.py and shards.py are faces kept for old imports (rollout/data/ holds them)."""
