"""The runner's commands on the ``dfcache`` command line (typer), each a few lines over the library.

:func:`register` is the ``dfcache.commands`` entry point (pyproject.toml): it adds every module's
commands (a new command is a new module here, and its name below). A
fully cached ``run`` is answered by ``fast_run`` before typer is imported, so nothing is imported
here until ``register`` is called.
"""

from __future__ import annotations


def register(app) -> None:
    """Add the runner's commands to the ``dfcache`` typer app: each module's ``register(app)``,
    in the order ``dfcache --help`` lists them."""
    from . import compare_backends, doctor, explain, parity, peers, run, watch

    for module in (run, peers, doctor, explain, parity, compare_backends, watch):
        module.register(app)
