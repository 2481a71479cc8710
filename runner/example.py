"""`dfcache run eval --example`: the whole pipeline on embedded tiny models, offline, on a CPU.

The first run builds, next to the store (``<store>/example/``), a tiny Qwen3.5-style target with
its tokenizer (from a config, random weights, fixed seed), a tiny DFlash drafter trained
briefly on the target's own greedy completions and hidden states, and an untrained drafter of
the same shape. Each model directory is built in a temporary directory and renamed into place,
so an interrupted build is redone, never half used. Later runs find them and import no torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from dfcache.errors import UsageError

from .options import EvalOptions

EXAMPLE_DEFAULTS = dict(prompts="builtin:coding", num_prompts=8, max_new_tokens=64, dtype="float32",
                        backend="torch", device="cpu", completions="local", tree_budgets=[4, 8])
DONE = ".dfcache-example-done"


def _build_once(path: Path, build: Callable[[Path], None]) -> None:
    if (path / DONE).exists():
        return
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        (tmp / DONE).write_text("ok\n")
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


def example_built(store) -> bool:
    """Whether the example's models are all there, so that a run with ``--example`` builds nothing."""
    where = store.local_dir("example")
    return where is not None and all((where / name / DONE).exists()
                                     for name in ("target", "drafter-trained", "drafter-untrained"))


def example_models(root: Path, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Build (once) and return the example's model directories."""
    target = root / "target"
    trained = root / "drafter-trained"
    untrained = root / "drafter-untrained"
    if not (target / DONE).exists():
        log(f"example: building the tiny target in {target} (once)")
        from .tiny import build_tiny_target

        _build_once(target, lambda d: build_tiny_target(d, seed=0))
    if not (trained / DONE).exists():
        log(f"example: training a tiny DFlash drafter on the target's own states in {trained} (once)")
        from .train_tiny import train_tiny_drafter

        _build_once(trained, lambda d: train_tiny_drafter(target, d, seed=0))
    if not (untrained / DONE).exists():
        from .train_tiny import make_untrained_drafter

        _build_once(untrained, lambda d: make_untrained_drafter(target, d, seed=1))
    return {"target": target, "trained": trained, "untrained": untrained}


def apply_example(store, opts: EvalOptions, log: Callable[[str], None] = print) -> None:
    """Point ``opts`` at the example models and fill in the example's defaults."""
    where = store.local_dir("example")
    if where is None:
        raise UsageError("--example needs a local store directory (--store PATH).")
    models = example_models(where, log=log)
    if opts.target is None:
        opts.target = str(models["target"])
    if not opts.drafters:
        opts.drafters = [str(models["trained"]), str(models["untrained"])]
    defaults = EvalOptions()
    for name, value in EXAMPLE_DEFAULTS.items():
        if getattr(opts, name) == getattr(defaults, name):
            setattr(opts, name, value)
