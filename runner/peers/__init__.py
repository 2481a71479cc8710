"""The peers' on-disk layouts (SpecForge, speculators, ModelOpt): export, import, the import's
layer check, and re-extraction of imported states (``dfcache verify --recompute``)."""
