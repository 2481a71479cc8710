"""Drafter families: what each needs from the target, how it drafts from cached features, how its checkpoints are recognised, and its reference online loop (family.py)."""
