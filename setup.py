"""Which import names tito installs (everything else is in pyproject.toml).

The renderer library lives in ``renderers/`` but is installed as ``tito_renderers``: the top-level name
``renderers`` belongs to the PyPI distribution of that name (verifiers depends on it), and two distributions
sharing one import name share one folder in site-packages, where each overwrites the other's files. pyproject's
``packages.find`` cannot rename a package, hence this file; the subpackages are found at build time so a new one
needs no edit here. See docs/renderers.md ("Installing next to PyPI renderers").
"""

from setuptools import find_packages, setup

SOURCE, IMPORT_NAME = "renderers", "tito_renderers"

renderer_packages = [IMPORT_NAME + name[len(SOURCE):] for name in find_packages(include=[SOURCE, SOURCE + ".*"])]

setup(
    packages=[*renderer_packages, *find_packages(include=["rollout", "rollout.*", "actors", "actors.*"])],
    package_dir={IMPORT_NAME: SOURCE},
    package_data={IMPORT_NAME: ["templates/*.jinja"]},
)
