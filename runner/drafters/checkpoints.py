"""Training checkpoints: which directories a `--drafter` value names, their steps, and whether
one is completely written.

A `--drafter` value is one of

* a checkpoint directory (``config.json`` + ``*.safetensors``): itself, as before;
* a glob (``runs/x/checkpoint-*``): every matching directory that holds a ``config.json``;
* a training-output directory without a ``config.json`` of its own (``runs/x``): its direct
  subdirectories named like checkpoints (``checkpoint-500`` as the Hugging Face Trainer writes
  them, ``step_500``, ``step-500``, ``global_step500``, ``iter_0000500``, ``epoch_0_step_500``,
  ``ckpt-500``), or holding a ``trainer_state.json``.

The step comes from ``trainer_state.json``'s ``global_step`` when the checkpoint has one, else
from its directory name; expanded checkpoints are ordered by step. Nothing here imports torch.

Completeness (``incomplete_reason``) is what ``dfcache watch`` and glob expansion use to never
take a checkpoint that is still being written: ``config.json`` parses, every safetensors file's
header is readable and its tensors' data reaches exactly the end of the file, and every shard a
``*.safetensors.index.json`` names is present. ``Snapshot`` (names, sizes, mtimes) lets the
watcher wait until nothing changed over its interval as well.
"""

from __future__ import annotations

import glob as _glob
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from dfcache.errors import BadInputError

# Anchored: `tmp-checkpoint-500` (the Trainer's staging name) and `.checkpoint-500.tmp` never match.
_STEP_NAMES = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"^checkpoint[-_]?(\d+)$",
    r"^(?:global[-_]?)?step[-_]?(\d+)$",
    r"^iter(?:ation)?[-_]?(\d+)$",
    r"^epoch[-_]?\d+[-_]step[-_]?(\d+)$",
    r"^ckpt[-_]?(\d+)$",
))
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int | None

    @property
    def sort_key(self) -> tuple:
        return (self.step is None, self.step or 0, self.path.name)


def is_glob(value: str) -> bool:
    return bool(_GLOB_CHARS.search(value))


def step_from_name(name: str, *, loose: bool = False) -> int | None:
    """The training step a checkpoint directory's name carries; ``loose`` also takes the last
    number in any name (for directories the user picked with a glob)."""
    for pat in _STEP_NAMES:
        m = pat.match(name)
        if m:
            return int(m.group(1))
    if loose:
        m = _LAST_NUMBER.search(name)
        if m:
            return int(m.group(1))
    return None


def trainer_step(path: Path) -> int | None:
    """``global_step`` of a Hugging Face Trainer checkpoint's ``trainer_state.json``, if readable."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def checkpoint_step(path: Path, *, loose: bool = True) -> int | None:
    step = trainer_step(path)
    return step if step is not None else step_from_name(path.name, loose=loose)


def looks_like_checkpoint_dir(path: Path) -> bool:
    """A subdirectory of a training-output directory that is (or is becoming) a checkpoint."""
    if path.name.startswith(".") or not path.is_dir():
        return False
    return step_from_name(path.name) is not None or (path / "trainer_state.json").exists()


def training_checkpoints(directory: Path) -> list[Checkpoint]:
    """The checkpoint subdirectories of a training-output directory, by step (complete or not)."""
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return []
    found = [Checkpoint(p, checkpoint_step(p, loose=False)) for p in children if looks_like_checkpoint_dir(p)]
    return sorted(found, key=lambda c: c.sort_key)


def glob_checkpoints(pattern: str) -> list[Checkpoint]:
    """Directories a glob matches that hold a config.json (complete or not), by step."""
    matches = [Path(m) for m in _glob.glob(os.path.expanduser(pattern))]
    found = [Checkpoint(p, checkpoint_step(p)) for p in matches
             if p.is_dir() and not p.name.startswith(".") and (p / "config.json").exists()]
    return sorted(found, key=lambda c: c.sort_key)


def expand_drafter_arg(value: str) -> tuple[list[Checkpoint], bool]:
    """The checkpoints one ``--drafter`` value names, and whether it named several (a glob or a
    training directory). A plain checkpoint directory (or a path that does not exist) is returned
    as is; its problems are reported by the drafter reader."""
    if is_glob(value):
        found = glob_checkpoints(value)
        if not found:
            raise BadInputError(
                f"--drafter {value!r} matches no checkpoint directory (a directory holding config.json "
                "and *.safetensors); check the pattern, and quote it so the shell does not expand it.")
        return found, True
    path = Path(value).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        found = training_checkpoints(path)
        if found:
            return found, True
        raise BadInputError(
            f"--drafter {value} has no config.json and no checkpoint subdirectories (checkpoint-N, step_N, "
            "...); pass a DFlash checkpoint directory (config.json + *.safetensors), a training-output "
            "directory holding checkpoints, or a glob such as 'runs/x/checkpoint-*'.")
    return [Checkpoint(path, checkpoint_step(path, loose=False) if path.is_dir() else None)], False


# --------------------------------------------------------------------------------------------
# Completeness
# --------------------------------------------------------------------------------------------

def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not completely written, or None if its header and size agree."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path.name}'s header reaches past the end of the file"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return f"{path.name}'s header is not readable JSON"
    if not isinstance(header, dict):
        return f"{path.name}'s header is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{path.name}: tensor {name} has no data_offsets"
        end = max(end, offsets[1])
    if 8 + n + end != size:
        return f"{path.name} holds {size} bytes but its header describes {8 + n + end}"
    return None


def incomplete_reason(path: Path) -> str | None:
    """Why a checkpoint directory is not (yet) a complete checkpoint, or None."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        return "no config.json yet"
    except (OSError, ValueError):
        return "config.json is not readable JSON yet"
    if not isinstance(cfg, dict):
        return "config.json is not a JSON object"
    shards = sorted(path.glob("*.safetensors"))
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is not readable yet"
        absent = sorted(n for n in names if not (path / n).is_file())
        if absent:
            return f"shard {absent[0]} named by {index.name} is not there yet"
    if not shards and not (path / "pytorch_model.bin").is_file():  # .bin: the EAGLE repo's EAGLE-3 files
        return "no *.safetensors weights yet"
    for shard in shards:
        problem = safetensors_problem(shard)
        if problem:
            return problem
    if (path / "trainer_state.json").exists() and trainer_step(path) is None:
        return "trainer_state.json is not readable yet"
    return None


Snapshot = tuple  # ((relative name, size, mtime_ns), ...), sorted


def snapshot(path: Path) -> Snapshot:
    """Names, sizes and modification times of every file under a checkpoint directory."""
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(dirs)
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:  # removed between listing and stat: the next look sees the change
                continue
            out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return tuple(out)


def newest_mtime(snap: Snapshot) -> float | None:
    """Seconds since the epoch of the latest change in a snapshot (None when it has no file)."""
    return max(m for _, _, m in snap) / 1e9 if snap else None
