"""verifiers environments in tito (``env.name: verifiers``): env.py plays their episodes through tito's loop,
endpoint.py is the model their harnesses call, worker.py runs them in the interpreter that has verifiers."""

from .env import VerifiersEnv, VerifiersOptions

__all__ = ["VerifiersEnv", "VerifiersOptions"]
