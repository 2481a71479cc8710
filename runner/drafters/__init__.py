"""Drafter families: where a family plugs in. ``family`` is the interface (what a family needs from
the target, how its checkpoints are recognised and planned, how it loads); ``dflash`` and
``eagle3`` (with ``eagle3_config``, JSON only) are the families' models and batched offline
scoring; ``rope`` reads the RoPE scaling a config declares (JSON only); ``checkpoints`` reads which
directories a ``--drafter`` value names."""
