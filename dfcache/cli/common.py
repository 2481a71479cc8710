"""What every command of the `dfcache` command line shares: the global options, the store they
name, the options and arguments several commands take (typed aliases, declared once), their
examples, and output helpers.

Public: command modules outside this package (the runner's ``run``/``plan``) use it too, so that
``--store``, ``--json``, ``--debug`` and ``--offline`` mean the same everywhere and JSON output
has one shape.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Annotated, List, Optional

import typer

from ..console import emit_json, err  # noqa: F401  (re-exported for the commands)
from ..maintenance import human_bytes  # noqa: F401  (re-exported for the commands)


@dataclass
class GlobalState:
    store_location: str | None = None
    json: bool = False
    debug: bool = False
    offline: bool = False
    no_progress: bool = False
    # Global options given on this command line (wherever they stood), as {option: value}; `run`
    # rebuilds fix messages ("produce it with: dfcache ...") from them.
    given: dict = field(default_factory=dict)
    # Values `ls --stage` and `ls --backend` accept beyond what the store holds, registered by
    # command plugins (dfcache itself knows no stage names).
    known_stages: set = field(default_factory=set)
    known_kernels: set = field(default_factory=set)
    # `verify --recompute N`: stage -> fn(store, keys, n, *, target, progress, log) -> {"sets", "lines",
    # "disagree", "fix"}, registered by the plugin that knows how to remake that stage's artifacts.
    recomputers: dict = field(default_factory=dict)


state = GlobalState()

# The fields command plugins fill when they are registered (once per process): main() resets the others.
REGISTERED_FIELDS = ("known_stages", "known_kernels", "recomputers")


# The global options: accepted before the command (`dfcache --store S ls`) and after it
# (`dfcache ls --store S`), on every command. Declared once here; the app callback and
# :func:`with_global_options` both use this table.
GLOBAL_OPTIONS = {
    "store": (Optional[str], lambda: typer.Option(None, "--store", metavar="PATH", help="The store: a directory, file:///path or s3://bucket/prefix (else $DFCACHE_STORE, else ./store).")),
    "json": (bool, lambda: typer.Option(False, "--json", help="Machine-readable output on stdout (errors too).")),
    "debug": (bool, lambda: typer.Option(False, "--debug", help="Show tracebacks.")),
    "offline": (bool, lambda: typer.Option(False, "--offline", help="Never touch the network (--offline or DFCACHE_OFFLINE=1).")),
    "no_progress": (bool, lambda: typer.Option(False, "--no-progress", help="No progress bars and no library progress output.")),
}
_PREFIX = "_global_"


def apply_global(name: str, value) -> None:
    """Record one global option's value (the later of two places wins for --store)."""
    if name == "store":
        if value is not None:
            state.store_location = value
            state.given["--store"] = value
    elif value:
        setattr(state, name, True)
        state.given["--" + name.replace("_", "-")] = True


def with_global_options(func):
    """``func`` with every global option it does not declare added as a keyword option."""
    sig = inspect.signature(func, eval_str=True)
    if any(p.name.startswith(_PREFIX) for p in sig.parameters.values()):
        return func  # already wrapped
    # A plugin command that declares one of them itself keeps its own (two --json options would
    # clash in the parser); main() has read --json and --debug from the whole line already.
    declared = {d for p in sig.parameters.values() for d in (getattr(p.default, "param_decls", None) or ())}
    extra = [inspect.Parameter(_PREFIX + name, inspect.Parameter.KEYWORD_ONLY, default=make(), annotation=ann)
             for name, (ann, make) in GLOBAL_OPTIONS.items()
             if "--" + name.replace("_", "-") not in declared]

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        for name in GLOBAL_OPTIONS:
            apply_global(name, kwargs.pop(_PREFIX + name, None))
        return func(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in sig.parameters.values()},
                               **{p.name: p.annotation for p in extra}}
    return wrapper


def progress_enabled(stream=None) -> bool:
    """Progress bars only on a terminal, and never with --no-progress or --json."""
    stream = stream or sys.stderr
    return not (state.no_progress or state.json) and stream.isatty()


def get_store(create: bool = True):
    """Open the store named by --store, $DFCACHE_STORE or ./store."""
    from ..store import open_store

    return open_store(state.store_location, create=create)


def check_stage(stage: str | None, manifests_of) -> str | None:
    """``--stage`` as the store spells it (:func:`dfcache.maintenance.stage_name`), the stages
    command plugins define counting as known."""
    from ..maintenance import stage_name

    return stage_name(stage, manifests_of, state.known_stages)


def examples(*lines: str) -> str:
    """A command's epilog: a few command lines that show its use, as `hf` and DVC print them."""
    return "Examples:\n\n\b\n" + "\n".join(f"  $ {line}" for line in lines)


# Options and arguments that several commands take, declared once (as huggingface_hub's CLI
# declares RepoIdArg, TokenOpt...): the same name, metavar and help wherever they appear.
KeyArg = Annotated[str, typer.Argument(metavar="KEY", show_default=False,
                                       help="An artifact's key, or a unique prefix of it (as git takes a commit).")]
KeysArg = Annotated[Optional[List[str]], typer.Argument(metavar="[KEY]...", show_default=False,
                                                        help="Artifacts' keys or unique key prefixes.")]
RemoteArg = Annotated[str, typer.Argument(metavar="URL", show_default=False,
                                          help="The remote store: s3://bucket/prefix, file:///path, or the name of a "
                                               "[remote.NAME] in dfcache.toml.")]
StageOpt = Annotated[Optional[str], typer.Option("--stage", metavar="STAGE", show_default=False,
                                                 help="Artifacts of this stage (hidden-states and hidden_states alike).")]
WhereOpt = Annotated[Optional[List[str]], typer.Option("--where", metavar="COND", show_default=False,
                                                       help="A provenance condition, e.g. 'fla<0.7' or 'gpu~H100' "
                                                            "(repeatable; all must hold).")]
EndpointOpt = Annotated[Optional[str], typer.Option("--endpoint-url", metavar="URL", show_default=False,
                                                    help="The S3 endpoint (else the remote's [remote.NAME] "
                                                         "endpoint_url, else AWS_ENDPOINT_URL).")]
