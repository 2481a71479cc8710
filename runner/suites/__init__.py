"""Prompt sets beyond one JSONL file: sources (the local datasets cache, Parquet/JSON/JSONL with a
field mapping), the named benchmark suites of the DFlash and DDTree papers, and the per-suite,
traffic-mix and published-reference tables of a run over several of them (docs/cli.md
"Prompt sets and suites")."""
