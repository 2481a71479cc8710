"""What `dfcache ls` prints, given the store's listing (:func:`dfcache.store.listing`).

Standard library only and no dataclasses: the ``dfcache`` executable prints a listing with
this module before anything else of dfcache is imported (``dfcache/__main__.py``). What one
artifact's entry holds is :func:`dfcache.maintenance.ls_entry`.
"""

from __future__ import annotations

import json

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
