"""The runner's commands on the ``dfcache`` command line (typer), each a few lines over the library.

Registered through the ``dfcache.commands`` entry point (pyproject.toml); a fully cached ``run``
is answered by ``fast_run`` before typer is imported, so this package's ``__init__`` imports nothing."""
