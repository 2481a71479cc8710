"""Drafter families: where a family plugs in (its checkpoint loading and offline scoring of block
roots). DFlash (``dflash``) is the one today; ``checkpoints`` reads which directories a
``--drafter`` value names. The interface a family implements is defined by the next issue."""
