"""Run the real `dfcache` command line in a subprocess (exit codes, stdout, stderr)."""

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    code: int
    out: str
    err: str


def hub_offline_env(home: Path) -> dict:
    """os.environ for CLI children of tests that never reach the Hub: no offline flag, store, debug
    or config file of this machine, ``home`` as DFCACHE_HOME, HF_HUB_OFFLINE=1, the repo importable."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("DFCACHE_OFFLINE", "DFCACHE_STORE", "DFCACHE_DEBUG", "DFCACHE_CONFIG")}
    e.update(DFCACHE_HOME=str(home), DFCACHE_CONFIG=str(home / "absent.toml"), HF_HUB_OFFLINE="1",
             HF_HUB_DISABLE_UPDATE_CHECK="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return e


# Set (for one test) by the ``forked_cli`` fixture (tests/conftest.py): a fork server whose children
# run ``python -m dfcache`` as the interpreter would, without its start-up (see FORK_PRELOAD).
_FORK = None

# What `dfcache` imports for its light commands (ls, show, verify, gc, push/pull, --help), loaded once
# by the fork server: a fresh `python -m dfcache --help` took 0.8 to 1.8 s of CPU, a fork ~0.05 s.
FORK_PRELOAD = ["dfcache.cli", "dfcache.cli._ls", "dfcache.cli._show", "dfcache.cli._verify", "dfcache.cli._gc",
                "dfcache.cli._transfer", "dfcache.store", "dfcache.maintenance", "dfcache.transfer",
                "runner.commands.run", "runner.core.graph", "runner.core.pipeline", "numpy", "ml_dtypes", "zarr",
                "numcodecs", "typer", "tqdm", "pydantic", "importlib.metadata", "typer._adapters", "email.message",
                "zipfile", "tempfile", "csv", "runpy", "cli_util"]


# Variables the interpreter reads at start-up, before any code of ours: a forked child of an
# interpreter started without them would not have them applied (PYTHONFAULTHANDLER is applied by
# the child itself, _start_like_the_interpreter; PYTHONPATH decides sys.path).
_STARTUP_PREFIXES = ("PYTHON", "LC_", "LANG")


def fork_is_faithful(full_env: dict, base: dict) -> bool:
    """Whether a child forked from a fork server started with the environment ``base`` starts as a
    fresh interpreter with ``full_env`` would: their start-up variables are the same."""
    names = {k for k in (*full_env, *base) if k.startswith(_STARTUP_PREFIXES) and k != "PYTHONFAULTHANDLER"}
    return all(full_env.get(k) == base.get(k) for k in names)


def forked(zygote, func: str, *args, env: dict, cwd, timeout: float) -> Result:
    """``func(*args)`` in a child of ``zygote`` (tests/reliability/zygote.py) whose environment is
    exactly ``env`` and whose working directory is ``cwd``."""
    child = zygote.run(func, *args, timeout=timeout, env=env, unset=tuple(k for k in zygote.env if k not in env),
                       cwd=str(cwd), name="cli")
    return Result(child.code, child.out, child.err)


def python_c(zygote, code: str, *args, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS...`` with exactly ``env`` in ``cwd``: a child of ``zygote`` (see
    :func:`fork_server`) where that starts as a new interpreter would, else a new interpreter."""
    cmd = [sys.executable, "-c", code, *map(str, args)]
    if zygote is not None and fork_is_faithful(env, zygote.session_env):
        r = forked(zygote, "cli_util:run_python_code", *cmd[2:], env=env, cwd=cwd, timeout=timeout)
        return subprocess.CompletedProcess(cmd, r.code, r.out, r.err)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(cwd))


# What a command that loads the tiny target imports besides FORK_PRELOAD (for a fork server whose
# children may load a model; tests/reliability/conftest.py's HEAVY): torch and transformers, and
# what transformers imports at the first from_pretrained. A `run tokens --completions local` child
# cost 6.8 s of CPU forked from the light server, ~2 s from this one.
MODEL_PRELOAD = ["torch", "transformers", "runner.models.target", "transformers.models.qwen3_5.modeling_qwen3_5",
                 "transformers.models.auto.modeling_auto", "transformers.tokenization_utils_fast", "safetensors.torch",
                 "runner.stages.completions.sources", "runner.stages.hidden_states",
                 "runner.stages.hidden_states.extract", "runner.stages.drafter_eval", "runner.drafters.dflash"]


@contextmanager
def fork_server(env: dict, workdir, preload: list[str] | None = None):
    """A fork server (tests/reliability/zygote.py) started with ``env`` that imported ``preload``
    (FORK_PRELOAD by default), for :func:`python_c`: the default imports neither torch nor
    transformers, so a child still shows whether a command imported them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
    from zygote import Zygote

    z = Zygote(preload or FORK_PRELOAD, workdir, env=env)
    z.session_env = env
    try:
        yield z
    finally:
        z.close()


# One intra-op thread for torch in a command's process (unless the environment says otherwise), as
# the reliability suite's children (rel_helpers.clean_env) and the torchrun workers have: the
# models are tiny, and on the 2-core CI box the second thread spins. The `run eval` commands of
# test_dspark_family and test_eagle3_eval (-k side_by_side) took 41 s of CPU with two, 28 s with one.
_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def dfcache(*args, store=None, env=None, timeout=600, cwd=None) -> Result:
    cmd = [sys.executable, "-m", "dfcache"]
    if store is not None:
        cmd += ["--store", str(store)]
    full_env = {**_ONE_THREAD, **os.environ, **(env or {})}
    if _FORK is not None and fork_is_faithful(full_env, _FORK.session_env):  # the same command line,
        # environment and directory, in a forked child
        return forked(_FORK, "cli_util:run_dfcache_module", *cmd[3:], *map(str, args), env=full_env,
                      cwd=cwd or os.getcwd(), timeout=timeout)
    p = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=full_env, cwd=cwd)
    return Result(p.returncode, p.stdout, p.stderr)


def run_side_by_side(code: str, *argsets, timeout: int = 120) -> None:
    """Run ``python -c code REPO *args`` once per argument set, all at once (the repo importable),
    and check that each exits 0 having printed ``done``."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    procs = [subprocess.Popen([sys.executable, "-c", code, repo, *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in argsets]
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0 and "done" in out, err


# What a forked child does that a fresh interpreter would do differently: the children of the fork
# server (tests/reliability/zygote.py) run these functions with the call's environment, directory
# and arguments; the start-up variables other than PYTHONFAULTHANDLER are checked beforehand
# (fork_is_faithful), and sys.path keeps the fork server's entries after the first.


def _start_like_the_interpreter(path0: str) -> None:
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.path.insert(0, path0)


def _run_like_the_interpreter(run) -> None:
    """Run ``run()`` and end as the interpreter ends a program: an exception's traceback and
    status 1, a SystemExit's status (its message printed, and 1, if it is not a number); then the
    non-daemon threads are joined and the exit functions run (the fork server's child itself ends
    with ``os._exit``, which does neither; dfcache's last exit function, dfcache.interrupts._end_late,
    ends the process with the command's status as in the real executable)."""
    import atexit
    import threading

    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what Py_FinalizeEx does first: wait for the non-daemon threads
    atexit._run_exitfuncs()
    raise SystemExit(code)


def run_dfcache_module(*argv) -> None:
    """``python -m dfcache ARGV...`` in this process, as the interpreter runs it (``dfcache/__main__.py``
    executed as ``__main__``, the working directory first on sys.path): the function a fork server
    runs in each forked child, so that a test gets the real executable's path without an
    interpreter start-up."""
    import runpy

    _start_like_the_interpreter(os.getcwd())
    sys.argv = ["dfcache", *map(str, argv)]
    _run_like_the_interpreter(lambda: runpy.run_module("dfcache", run_name="__main__", alter_sys=True))


def run_python_code(code: str, *argv) -> None:
    """``python -c CODE ARGV...`` in this process, as the interpreter runs it (``sys.argv[0]`` is
    ``-c``, the working directory, as '', first on sys.path)."""
    _start_like_the_interpreter("")
    sys.argv = ["-c", *map(str, argv)]
    import builtins

    _run_like_the_interpreter(lambda: exec(compile(code, "<string>", "exec"),
                                           {"__name__": "__main__", "__builtins__": builtins}))
