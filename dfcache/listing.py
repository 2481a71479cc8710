"""What `dfcache ls` prints, given the store's listing (:func:`dfcache.store.listing`).

Standard library only and no dataclasses: the ``dfcache`` executable prints a listing with
this module before anything else of dfcache is imported (``dfcache/__main__.py``). What one
artifact's entry holds is :func:`dfcache.maintenance.ls_entry`.
"""

from __future__ import annotations

import json
import re

LS_HEADER = f"{'KEY':<12}  {'STAGE':<14}  {'SIZE':>9}  {'CREATED':<19}  {'BACKEND':<18}  INPUTS"


def human_bytes(n: float) -> str:
    """Decimal units, as `dfcache ls` and transfer summaries print sizes."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def ls_footer(count: int, total_bytes: int, url: str, errors: int) -> str:
    """What `dfcache ls` prints after the lines: the count, the bytes, and invalid manifests."""
    text = f"{count} artifact(s), {human_bytes(total_bytes)} in {url}"
    if errors:
        text += (f"\nwarning: {errors} manifest(s) failed validation and are not listed; run "
                 "`dfcache verify` to see them.")
    return text


def ls_output(entries, *, json_out: bool, url: str, stage: str | None, errors: int) -> str:
    """`dfcache ls`'s whole output for ``entries`` (``ls_entry`` tuples, in order). The JSON form
    is byte for byte ``json.dumps([rows], separators=(",", ":"))``; compact, because indent=
    switches json to its pure-Python encoder, 3x slower on 10k artifacts."""
    if json_out:
        return "[" + ",".join(e[5] for e in entries) + "]\n"
    if not entries:
        lines = [f"no artifacts in {url}" + (f" (stage {stage})" if stage else "")]
    else:
        lines = [LS_HEADER, *(json.loads(e[4]) for e in entries)]
    lines.append(ls_footer(len(entries), sum(e[3] for e in entries), url, errors))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ `ls --by selection`

SELECTION_HEADER = (f"{'KEY':<12}  {'STAGE':<14}  {'SAMPLES':>7}  {'SEGS':>5}  {'SIZE':>9}  {'LATEST':<19}  "
                    f"{'BACKEND':<18}  SELECTION")
_COUNT = re.compile(r"^\d+ samples?: ")


def selection_groups(entries) -> list[dict]:
    """The artifacts of ``entries`` (``ls_entry`` tuples) grouped by what they were made for: the
    segments of one partition with the same summary (the stage's inputs, and the prompt set that
    the runner names in it) make one group, however many commits they took; any other artifact
    is a group of its own. In order of each group's latest artifact."""
    groups: dict = {}
    for e in entries:
        row = json.loads(e[5])
        samples = row.get("samples")
        summary = row.get("summary") or ""
        if samples:
            what = _COUNT.sub("", summary)
            gid = ("segments", row["stage"], samples["partition"], what)
        else:
            what = summary
            gid = ("artifact", row["key"])
        g = groups.get(gid)
        if g is None:
            g = groups[gid] = {"key": samples["partition"] if samples else row["key"], "stage": row["stage"],
                               "partition": samples["partition"] if samples else None,
                               "samples": 0 if samples else None, "segments": [], "size_bytes": 0,
                               "created": row["created"], "first_created": row["created"],
                               "backend": row.get("backend"), "summary": what, "_line": json.loads(e[4])}
        g["segments"].append(row["key"])
        g["size_bytes"] += int(row.get("size_bytes") or 0)
        if samples:
            g["samples"] += int(samples.get("count") or 0)
        g["created"] = max(g["created"], row["created"])
        g["first_created"] = min(g["first_created"], row["created"])
    out = sorted(groups.values(), key=lambda g: (g["created"], g["key"]))
    for g in out:
        if g["partition"] is None:
            g["segments"] = []  # an artifact of its own, not segments
    return out


def _backend_text(b) -> str:
    # as dfcache.maintenance.backend_summary spells it in `ls`
    if not b:
        return "-"
    return "/".join(str(b.get(k, "?")) for k in ("kernel", "device")) + f"/{b.get('states') or b.get('dtype', '?')}"


def selection_output(entries, *, json_out: bool, url: str, stage: str | None, errors: int) -> str:
    """`dfcache ls --by selection`: one line per group of :func:`selection_groups`."""
    groups = selection_groups(entries)
    if json_out:
        rows = [{k: v for k, v in g.items() if not k.startswith("_")} for g in groups]
        return json.dumps(rows, separators=(",", ":"), default=str) + "\n"
    if not groups:
        lines = [f"no artifacts in {url}" + (f" (stage {stage})" if stage else "")]
    else:
        lines = [SELECTION_HEADER]
        for g in groups:
            samples = "-" if g["samples"] is None else str(g["samples"])
            segs = str(len(g["segments"])) if g["partition"] else "-"
            lines.append(f"{g['key'][:12]}  {g['stage']:<14}  {samples:>7}  {segs:>5}  {human_bytes(g['size_bytes']):>9}  "
                         f"{g['created'][:19].replace('T', ' '):<19}  {_backend_text(g['backend']):<18}  {g['summary']}")
    lines.append(f"{len(groups)} selection(s) of " + ls_footer(len(entries), sum(e[3] for e in entries), url, errors))
    return "\n".join(lines) + "\n"
