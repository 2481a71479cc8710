"""Ctrl-C for the ``dfcache`` executable: whenever SIGINT arrives, the command ends with the
interrupted message and exit status 130, and nothing it left is partial.

Standard library only: :mod:`dfcache.__main__` installs it before anything else is imported.
Python's own handling (``KeyboardInterrupt`` raised wherever the main thread happens to be)
failed in three ways, measured on `run eval` with SIGINT sent at random instants (50 trials,
docs/reliability.md):

* raised inside native code that calls back into Python, it aborted the process (SIGABRT,
  ``terminate called after throwing an instance of 'pybind11::error_already_set'``) or left torch
  half-initialised (``ImportError: cannot load module more than once per process``, exit 1);
* raised inside ``exec()`` or ``eval()`` of a string (every ``@dataclass`` and ``namedtuple`` made
  while a module is imported), CPython 3.11 marks the interrupt "unhandled" even when the CLI
  catches it, and the interpreter then kills itself with SIGINT after exiting 130: status -2;
* arriving while the interpreter shuts down (after the command printed its result), it was lost
  (exit 0) or, once Python's handler is removed late in finalization, killed the process with
  status -2 and no message.

So: :func:`install` sets a handler that records the interrupt and raises ``KeyboardInterrupt``,
except while the main thread is importing a module, where it is raised once the outermost import
has finished (a second Ctrl-C in that window raises at once); and :func:`finish` ends the
process with exit 130 and the message when an interrupt was seen at any point, without
finalizing the interpreter, and otherwise lets it finalize with Ctrl-C handled to the end. The
stores' crash guarantees make ending early safe: a process may die at any instant and leave
nothing partial visible (docs/reliability.md).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys

from .console import INTERRUPTED as MESSAGE

_state = {"installed": False, "main": None, "received": 0, "deferring": 0, "pending": False, "told": False}


def received() -> bool:
    """Whether SIGINT has arrived since :func:`install` (always False if it was not installed)."""
    return _state["received"] > 0


def _on_sigint(signum, frame) -> None:
    _state["received"] += 1
    if _state["deferring"] and _state["received"] == 1:
        _state["pending"] = True  # raised when the import in progress has finished
        return
    raise KeyboardInterrupt


class _Deferred:
    """While the main thread executes a module being imported, an interrupt waits for its end."""

    def __enter__(self):
        if _thread.get_ident() == _state["main"]:
            _state["deferring"] += 1
            self.counted = True
        else:
            self.counted = False
        return self

    def __exit__(self, *exc) -> None:
        if not self.counted:
            return
        _state["deferring"] -= 1
        if _state["deferring"] == 0 and _state["pending"]:
            _state["pending"] = False
            if exc[0] is None:
                raise KeyboardInterrupt


class _DeferDuringImport:
    """A meta path finder in front of the others: it finds a module's spec through them and wraps
    the loader's ``exec_module`` so that executing the module defers an interrupt (the loader and
    its type are kept: ``module.__loader__`` is what it always was)."""

    def __init__(self) -> None:
        self._searching = set()

    def find_spec(self, name, path=None, target=None):
        me = _thread.get_ident()
        if me != _state["main"] or me in self._searching:
            return None
        self._searching.add(me)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
        finally:
            self._searching.discard(me)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or getattr(loader, "_dfcache_deferred", False):
            return spec  # builtin and frozen modules (their loader is a class) run no Python code
        try:
            exec_module = loader.exec_module

            def deferred_exec(module, _exec=exec_module):
                with _Deferred():
                    _exec(module)

            loader.exec_module = deferred_exec
            loader._dfcache_deferred = True
        except (AttributeError, TypeError):
            pass  # a loader that takes no attributes: imported as it is
        return spec

    def invalidate_caches(self) -> None:
        pass


def install() -> None:
    """Take over SIGINT for this process (the executable's main thread only). Where SIGINT is
    ignored (a background job of a shell without job control, ``nohup``) it stays ignored, as
    Python itself leaves it."""
    if _state["installed"] or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread of the main interpreter: Python's own handling stays
        return
    _state["main"] = _thread.get_ident()
    sys.meta_path.insert(0, _DeferDuringImport())
    _state["installed"] = True
    import atexit

    atexit.register(_end_late)  # registered first, so it runs last


def _say_interrupted() -> None:
    if not _state["told"]:
        _state["told"] = True
        try:
            sys.stderr.write(MESSAGE + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stream: the exit status still says it
            pass


def _exit_now(signum, frame) -> None:
    _state["received"] += 1
    _say_interrupted()
    _flush()
    os._exit(130)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more can be said
            pass


def finish(rc: int) -> None:
    """End the process with ``rc``, or with 130 and the message if an interrupt arrived at any point.

    From here on a Ctrl-C ends the process at once (130 and the message), while the non-daemon
    threads are joined and the exit functions run; the last exit function (registered first, by
    :func:`install`) then ends the process, so that no Ctrl-C can land after the interpreter has
    removed its handler (status -2, no message). After an interrupt the interpreter is not
    finalized at all: it could still end with -2 (the "unhandled" mark of an interrupt raised in
    ``exec``) or wait for threads stuck in requests the interrupt abandoned."""
    if _state["installed"]:
        signal.signal(signal.SIGINT, _exit_now)
    if received():
        if rc != 130:  # 130: the command said it already (dfcache.cli, runner.commands.fast_run)
            _say_interrupted()
        _flush()
        os._exit(130)
    _state["rc"] = rc
    if "obstore" not in sys.modules:
        sys.exit(rc)  # joins the threads and runs the exit functions, the last of them _end_late
    # obstore's tokio threads release Python objects on their own schedule, and one that does so
    # during finalization aborts the process (dfcache/store/_s3.py): run the exit functions and end.
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(rc)


def _end_late() -> None:
    """The last exit function: the process ends here, with the command's status, once the threads
    are joined and the other exit functions ran. What the interpreter would still do (tear the
    modules down, then exit) is where a Ctrl-C was lost (exit 0) or, once it had removed its
    handler, killed the process with status -2 and no message."""
    if not _state["installed"]:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "rc" in _state:  # ended through finish(): its status (else a caller of ours goes on exiting)
        _flush()
        os._exit(_state["rc"])
