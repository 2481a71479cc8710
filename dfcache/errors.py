"""Every exception dfcache raises on purpose, and the exit code each one maps to.

The tree (exit code in brackets)::

    DfcacheError (Exception)                         [1]
    ├── InternalError (RuntimeError)                 [1]  a bug: an invariant of dfcache or a stage broke
    ├── UsageError (ValueError)                      [2]  wrong flags or arguments
    │   ├── KeyMaterialError                              a value that must not enter a key
    │   └── DependentsError                               gc would remove what kept artifacts need
    ├── OfflineMissingError (ConnectionError)        [3]  needs the network while offline
    │     (carries the list of missing nodes)
    ├── NetworkError (ConnectionError)               [4]
    │   ├── OfflineModeIsEnabled                     [3]  a URL or a network store was asked for
    │   │                                                  while offline (no socket was opened)
    │   ├── ServerUnreachable                             DNS failure or no route
    │   ├── ConnectionRefused                             nothing listens on the port
    │   ├── ServerTimeout                                 connect or read timed out
    │   ├── ServerNotReady                                answers, but not ready (503, loading)
    │   └── ServerHTTPError                               4xx/5xx, malformed body, wrong model
    ├── StoreWriteError (OSError)                    [2]  the store cannot take writes (disk full,
    │                                                      quota, read-only, permissions)
    ├── IntegrityError (OSError)                     [5]  digest mismatch, corrupt or partial artifact
    │   ├── UntrustedManifestError                        a manifest that fails validation
    │   │   └── UnknownCodecError                    [2]  arrays of a dtype or codec this dfcache does
    │   │                                                  not read (a newer one wrote them: upgrade)
    │   └── NotRegularFile                                a store file that is a directory, a FIFO,
    │                                                      a socket, a device (or a link where none may be)
    ├── BadInputError (ValueError)                   [6]  prompts, model, checkpoint, layer ids
    │   ├── ModelNotFoundError (FileNotFoundError)
    │   └── CompletionIdsRefused                          completions whose token ids are not the
    │         (carries the refused prompts)               generation's (text-only, failed check)
    └── ArtifactNotFoundError (KeyError, LookupError) [2] no artifact with that key or prefix
        ├── AmbiguousKeyError                              a prefix that matches several keys
        └── SamplesMissingError                            samples asked for are in no segment

Each exception also subclasses the stdlib class a caller would naturally catch. Messages name
the thing that is wrong and end with the fix. Where the fix depends on who called (a local read
says "delete and recompute", a pull says "push a good copy there", the runner names its own
flags), the raiser gives only ``problem`` and the caller adds the fix with :meth:`with_fix`;
``message`` (and ``str(err)``) is always ``problem`` followed by ``fix``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_OFFLINE_MISSING = 3
EXIT_NETWORK = 4
EXIT_INTEGRITY = 5
EXIT_BAD_INPUT = 6


class DfcacheError(Exception):
    """Base class of every error dfcache raises on purpose.

    ``problem``: what is wrong, naming the thing. ``fix``: what to do about it (may be None
    when ``problem`` already says it). ``message``: both, the line a user sees.
    """

    exit_code = EXIT_INTERNAL
    reason: str | None = None  # a short machine-readable cause where the raiser gives one (dfcache.http)

    def __init__(self, message: str = "", *args: object, fix: str | None = None) -> None:
        super().__init__(message, *args)
        self.problem = message
        self.fix = fix

    @property
    def message(self) -> str:
        return f"{self.problem} {self.fix}" if self.fix else self.problem

    def with_fix(self, fix: str | None):
        """A copy of this error (same class and fields) whose fix is ``fix``."""
        import copy

        new = copy.copy(self)
        new.fix = fix
        new.__traceback__ = None
        return new

    def __str__(self) -> str:  # first in every subclass's MRO: OSError, KeyError would print otherwise
        return self.message


class InternalError(DfcacheError, RuntimeError):
    """dfcache (or a stage) broke one of its own invariants: a bug to report, not a user error."""

    exit_code = EXIT_INTERNAL


class UsageError(DfcacheError, ValueError):
    """The command line or the call was wrong: a flag, a missing argument."""

    exit_code = EXIT_USAGE


class KeyMaterialError(UsageError):
    """A value that must not enter a key (absolute path, mtime, host, NaN) was given as key material."""


class OfflineMissingError(DfcacheError, ConnectionError):
    """Artifacts are missing and producing them needs the network, which offline mode forbids."""

    exit_code = EXIT_OFFLINE_MISSING

    def __init__(self, message: str, missing: list | None = None, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.missing = list(missing or [])


class NetworkError(DfcacheError, ConnectionError):
    """A network request failed."""

    exit_code = EXIT_NETWORK

    def __init__(self, message: str, url: str | None = None, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.url = url


class OfflineModeIsEnabled(NetworkError):
    """Code asked for a URL (or a store that needs the network) while offline mode is on; no
    socket was opened. Exit 3, as every refusal that offline mode makes: nothing failed on the
    network (4), the network was not used. A NetworkError still, for callers that treat every
    "could not reach it" alike (a run skips an unreachable remote)."""

    exit_code = EXIT_OFFLINE_MISSING


class ServerUnreachable(NetworkError):
    """The host could not be reached (name resolution or routing failed)."""


class ConnectionRefused(NetworkError):
    """The host answered that nothing listens on the port."""


class ServerTimeout(NetworkError):
    """Connecting or reading timed out."""


class ServerNotReady(NetworkError):
    """The server answers but is not ready yet (for example still loading the model)."""


class ServerHTTPError(NetworkError):
    """The server answered with an HTTP error, a malformed body or an unexpected model."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None,
                 server_message: str | None = None, *, fix: str | None = None) -> None:
        super().__init__(message, url, fix=fix)
        self.status = status
        self.server_message = server_message


class StoreWriteError(DfcacheError, OSError):
    """The store refused a write: its filesystem is full, over quota, read-only or not ours.

    Exit 2, like a --store that cannot be created: the store given is not usable as it is. The
    partial artifact is dropped (a resumable stage keeps its checkpointed progress)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, path: str | None = None, *, fix: str | None = None) -> None:
        DfcacheError.__init__(self, message, fix=fix)
        self.path = path


class IntegrityError(DfcacheError, OSError):
    """An artifact's bytes do not match its manifest, or the artifact is incomplete."""

    exit_code = EXIT_INTEGRITY

    def __init__(self, message: str, key: str | None = None, *, fix: str | None = None) -> None:
        DfcacheError.__init__(self, message, fix=fix)
        self.key = key


class UntrustedManifestError(IntegrityError):
    """A manifest (usually from a remote) failed validation and was not used."""


class UnknownCodecError(UntrustedManifestError):
    """An artifact whose arrays use a dtype or codec this dfcache does not read (FP8 states read
    by an older dfcache): exit 2 naming it, never its bytes taken for numbers. A manifest still,
    so listings that skip refused manifests skip it too. Its fix (upgrade) is its own whoever
    catches it: ``with_fix`` keeps it."""

    exit_code = EXIT_USAGE

    def with_fix(self, fix: str | None):
        return self


class NotRegularFile(IntegrityError):
    """A file of a store that is not a regular file: a directory, a FIFO (whose open would wait
    forever), a socket, a device, or a symbolic link where none may be followed. Never read."""


class BadInputError(DfcacheError, ValueError):
    """Input the user gave is wrong: a prompt file, a model directory, a checkpoint, layer ids."""

    exit_code = EXIT_BAD_INPUT


class ModelNotFoundError(BadInputError, FileNotFoundError):
    """A model or checkpoint was not found where dfcache looked."""


class ArtifactNotFoundError(DfcacheError, KeyError):
    """No artifact with that key (or key prefix) is in the store."""

    exit_code = EXIT_USAGE


class AmbiguousKeyError(ArtifactNotFoundError):
    """A key prefix matches more than one artifact."""


class DependentsError(UsageError):
    """gc was asked to remove artifacts that kept artifacts depend on (``dependents``: key -> keys)."""

    def __init__(self, message: str, *, dependents: dict | None = None) -> None:
        super().__init__(message)
        self.dependents = dict(dependents or {})


class SamplesMissingError(ArtifactNotFoundError):
    """Samples asked for are in no segment of the store (``missing``: their keys)."""

    def __init__(self, message: str, *, missing: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


class CompletionIdsRefused(BadInputError):
    """Completions whose token ids cannot be shown to be the ones the target generated: text-only
    answers whose rebuilt ids fail their check, ids that disagree with the server's own text, a
    reasoning split the chat template cannot put back. ``refused``: one dict per prompt
    (``id``, ``problem``, ``acceptable``: whether ``--accept-retokenized`` may keep it)."""

    def __init__(self, message: str, refused: list[dict] | None = None, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.refused = list(refused or [])
