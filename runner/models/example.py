"""`dfcache run eval --example`: the whole pipeline on embedded tiny models, offline, on a CPU.

The first run builds, next to the store (``<store>/example/``), a tiny Qwen3.5-style target with
its tokenizer (from a config, random weights, fixed seed), a tiny DFlash drafter trained
briefly on the target's own greedy completions and hidden states, an untrained drafter of
the same shape, and a tiny EAGLE-3 drafter trained on the same states (two families side by side). Each model directory is built in a temporary directory and renamed into place,
so an interrupted build is redone, never half used; the temporary directory a killed build left
is removed by the next build (each build holds a lock on its own). Later runs find them and
import no torch.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from dfcache.errors import StoreWriteError, UsageError

from ..core.options import EvalOptions

EXAMPLE_DEFAULTS = dict(prompts="builtin:coding", num_prompts=8, max_new_tokens=64, dtype="float32",
                        backend="torch", device="cpu", completions="local", tree_budgets=[4, 8])
DONE = ".dfcache-example-done"


def _build_once(path: Path, build: Callable[[Path], None]) -> None:
    if (path / DONE).exists():
        return
    remove_stale_builds(path.parent)
    tmp, fd = _new_build_dir(path)
    try:
        try:
            build(tmp)
            (tmp / DONE).write_text("ok\n")
        except Exception as e:
            raise _unwritable(e, path.parent) or e
        # Several workers of one distributed run may build at once: the first finished copy stays
        # (another may be reading it; the builds are deterministic), a half-built leftover goes.
        if (path / DONE).exists():
            return
        if path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def _new_build_dir(path: Path) -> tuple[Path, int]:
    """A fresh temporary directory beside ``path``, locked (flock) for as long as this process builds
    in it: :func:`remove_stale_builds` removes only directories nobody holds."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise _unwritable(e, path.parent) or e
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed by another build's clean-up between mkdir and open: not ours any more
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd  # still the directory we locked
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale_builds(root: Path) -> list[Path]:
    """Remove the temporary build directories (``.NAME.*.tmp``) that a killed build left under
    ``root``; one whose lock a live build holds is left alone. Returns what was removed."""
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(".") and n.endswith((".tmp", ".deleted"))]
    except OSError:
        return removed
    for name in names:
        p = root / name
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not a directory of ours
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live build holds it
            # Out of sight first (one rename), then deleted: a removal cut short leaves a
            # .deleted directory, which the next build removes, never a half-emptied build.
            grave = p if name.endswith(".deleted") else root / f"{name[:-4]}.deleted"
            try:
                if grave != p:
                    os.rename(p, grave)
                shutil.rmtree(grave)
            except OSError:
                continue
            removed.append(p)
        finally:
            os.close(fd)
    return removed


# errnos that mean "this disk cannot take the write", as for the store (dfcache/store/_local.py)
_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def _unwritable(e: BaseException, where: Path) -> StoreWriteError | None:
    """A full or read-only disk met while building, as one StoreWriteError (exit 2); else None.
    safetensors reports it as ``SafetensorError: Error while serializing: I/O error: File too large
    (os error 27)`` (older versions: ``IoError(Os { code: 28, ... })``), with no errno of its own."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if code is None and type(e).__name__ == "SafetensorError":
        m = re.search(r"\(os error (\d+)\)|\bcode: (\d+)", str(e))
        code = int(m.group(1) or m.group(2)) if m else None
    if code not in _UNWRITABLE:
        return None
    return StoreWriteError(f"cannot build the --example models under {where}: {os.strerror(code)}. Free space "
                           "(`dfcache gc --dry-run` lists what can go) or fix its permissions, or pass another "
                           "--store; then run again.", path=str(where))


EXAMPLE_DIRS = ("target", "drafter-trained", "drafter-untrained", "drafter-eagle3")


def example_built(store) -> bool:
    """Whether the example's models are all there, so that a run with ``--example`` builds nothing."""
    where = store.local_dir("example")
    return where is not None and all((where / name / DONE).exists() for name in EXAMPLE_DIRS)


def example_models(root: Path, log: Callable[[str], None] = print, *, eagle3: bool = True) -> dict[str, Path]:
    """Build (once) and return the example's model directories: the target, a trained and an
    untrained DFlash drafter, and (``eagle3``) a tiny EAGLE-3 drafter trained on the same greedy
    completions and states as the DFlash one (computed once for both: most of the build's time)."""
    target = root / "target"
    trained = root / "drafter-trained"
    untrained = root / "drafter-untrained"
    eagle = root / "drafter-eagle3"
    if not (target / DONE).exists():
        log(f"example: building the tiny target in {target} (once)")
        from .tiny import build_tiny_target

        _build_once(target, lambda d: build_tiny_target(d, seed=0))
    shared: dict = {}

    def data():
        if "data" not in shared:
            from .train_tiny import DEFAULT_LAYER_IDS, build_training_data, single_thread

            with single_thread():  # as train_tiny_drafter computed it: the same bits, the same drafter
                shared["data"] = build_training_data(target, DEFAULT_LAYER_IDS)
        return shared["data"]

    if not (trained / DONE).exists():
        log(f"example: training a tiny DFlash drafter on the target's own states in {trained} (once)")
        from .train_tiny import train_tiny_drafter

        _build_once(trained, lambda d: train_tiny_drafter(target, d, seed=0, data=data()))
    if not (untrained / DONE).exists():
        from .train_tiny import make_untrained_drafter

        _build_once(untrained, lambda d: make_untrained_drafter(target, d, seed=1))
    out = {"target": target, "trained": trained, "untrained": untrained}
    if eagle3:
        if not (eagle / DONE).exists():
            log(f"example: training a tiny EAGLE-3 drafter on the same states in {eagle} (once)")
            from ..drafters.train_eagle3 import train_tiny_eagle3

            _build_once(eagle, lambda d: train_tiny_eagle3(target, d, seed=0, data=data()))
        out["eagle3"] = eagle
    return out


def apply_example(store, opts: EvalOptions, log: Callable[[str], None] = print) -> None:
    """Point ``opts`` at the example models and fill in the example's defaults."""
    where = store.local_dir("example")
    if where is None:
        raise UsageError("--example needs a local store directory (--store PATH).")
    models = example_models(where, log=log)
    if opts.target is None:
        opts.target = str(models["target"])
    if not opts.drafters:
        opts.drafters = [str(models["trained"]), str(models["untrained"]), str(models["eagle3"])]
    note = fill_example_defaults(opts)
    if note:
        log(note)


def fill_example_defaults(opts: EvalOptions) -> str | None:
    """The example's defaults for every option left at its general default. The example runs in
    float32 on the CPU (exact, comparable on any machine), but a run that asks for the GPU path
    (``--backend fla`` or ``--device cuda``) keeps bfloat16, the dtype that path runs for users
    (issue 36: the "fla example" in float32 said nothing about it); ``--dtype float32`` still
    gives float32 there. Returns a line saying so, or None."""
    defaults = EvalOptions()
    gpu = opts.backend == "fla" or opts.device == "cuda"
    for name, value in EXAMPLE_DEFAULTS.items():
        if name == "dtype" and (gpu or opts.compression.startswith("fp8-")):
            continue  # the GPU path's bf16; FP8 states are quantized bf16 ones (the example's float32 would refuse them)
        if getattr(opts, name) == getattr(defaults, name):
            setattr(opts, name, value)
    if gpu and opts.dtype == "bfloat16":
        return (f"example: --backend {opts.backend} --device {opts.device} runs in bfloat16, as that path runs "
                "for users (the CPU example's float32: pass --dtype float32)")
    return None
