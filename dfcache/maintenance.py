"""Listing and cleaning a store as plain data: what `dfcache ls` and `dfcache gc` print.

``gc`` is two-phase, like huggingface_hub's ``DeleteCacheStrategy``: :func:`gc_plan` lists what
would go and how many bytes; :meth:`GcPlan.execute` removes it.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

from .errors import UsageError
from .listing import LS_HEADER, human_bytes, ls_footer, ls_output  # noqa: F401  (the ls text; re-exported)
from .manifest import Manifest
from .store.layout import GRAVE_SUFFIX


def backend_summary(m: Manifest) -> str:
    b = m.backend
    if not b:
        return "-"
    # lossy states show their codec where the dtype is (fp8-e4m3 states are quantized bf16 ones)
    parts = [str(b.get("kernel", "?")), str(b.get("device", "?")), str(b.get("states") or b.get("dtype", "?"))]
    return "/".join(parts)


def input_summary(m: Manifest, width: int = 72) -> str:
    if m.summary:
        text = m.summary
    else:
        skip = {"backend"}
        text = " ".join(f"{k}={_short(v)}" for k, v in sorted(m.inputs.items()) if k not in skip)
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    # Cut between words, never inside one (a half "float32" reads as another dtype).
    space = max(cut.rfind(" "), cut.rfind(","))
    return (cut[:space] if space > width // 2 else cut).rstrip(" ,") + "…"


def _short(v) -> str:
    if isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v):
        return v[:8]
    if isinstance(v, (list, dict)):
        s = str(v)
        return s if len(s) < 24 else s[:23] + "…"
    return str(v)


def ls_line(m: Manifest) -> str:
    """One artifact's line in `dfcache ls` (under :data:`LS_HEADER`)."""
    return (f"{m.key[:12]}  {m.stage:<14}  {human_bytes(m.size_bytes):>9}  "
            f"{m.created[:19].replace('T', ' '):<19}  {backend_summary(m):<18}  {input_summary(m)}")


def ls_entry(m: Manifest) -> tuple[str, str, str, int, str, str]:
    """What `ls` needs of one artifact: (created, key, stage, size_bytes, its line as JSON, its
    ``ls --json`` row as JSON). The store's listing index keeps exactly this per manifest."""
    return (m.created, m.key, m.stage, m.size_bytes, json.dumps(ls_line(m)),
            json.dumps(manifest_row(m), separators=(",", ":"), default=str))


def manifest_row(m: Manifest) -> dict:
    """The `ls --json` object of one artifact (a documented contract, see docs/cli.md)."""
    return {"key": m.key, "stage": m.stage, "stage_version": m.stage_version, "size_bytes": m.size_bytes,
            "created": m.created, "backend": m.backend, "inputs": m.inputs, "upstream": m.upstream,
            "provenance": m.provenance, "summary": m.summary,
            "arrays": {n: {"shape": a.shape, "dtype": a.dtype} for n, a in m.arrays.items()},
            # a segment's partition and how many samples it holds (`ls --by selection` groups by them)
            "samples": ({"partition": m.samples["partition"], "count": len(m.samples["keys"])}
                        if m.samples else None)}


def stage_name(stage: str | None, manifests_of, known: set | frozenset = frozenset()) -> str | None:
    """``--stage`` as the store spells it: ``hidden-states`` (as `run` spells its targets) is
    ``hidden_states``. A stage that no command plugin defines (``known``) and no artifact has can
    never match: that is a usage error listing the valid names. ``manifests_of()`` gives the
    store's manifests (called only when the name is not a known stage)."""
    if stage is None:
        return None
    name = stage.strip().replace("-", "_")
    if name in known:
        return name
    present = {m.stage for m in manifests_of()}
    if name in present:
        return name
    choices = ", ".join(sorted(set(known) | present)) or "none (the store is empty)"
    raise UsageError(f"--stage {stage!r} is not a stage; choose one of {choices}.")


def kernel_name(kernel: str | None, manifests, known: set | frozenset = frozenset()) -> str | None:
    """``ls --backend``: a kernel family (the first part of the BACKEND column) that a plugin
    defines (``known``) or an artifact has; else a usage error listing them."""
    if kernel is None:
        return None
    present = {str(m.backend.get("kernel")) for m in manifests if m.backend}
    if kernel in set(known) | present:
        return kernel
    choices = ", ".join(sorted(set(known) | present)) or "none (no artifact has a backend)"
    raise UsageError(f"--backend {kernel!r} is not a kernel family; choose one of {choices} (the device "
                     "and dtype follow it in the BACKEND column of `dfcache ls`).")


def ls_entries(store, *, stage: str | None = None, kernel: str | None = None, where: list[str] | None = None,
               known_stages=frozenset(), known_kernels=frozenset()) -> tuple[list[tuple], int, str | None]:
    """What `dfcache ls` lists: (the :func:`ls_entry` of each artifact selected, in (created,
    key) order; how many manifests failed validation; ``stage`` as the store spells it).

    From the store's listing index where it has one (a local store) and ``where`` is not given
    (``--where`` reads whole manifests; the index holds only what ``ls`` prints), else from its
    manifests."""
    listed = None if where else store.backend.listing()
    if listed is None:
        errors: list = []
        everything = store.list_manifests(errors=errors)
        stage = stage_name(stage, lambda: everything, known_stages)
        kernel = kernel_name(kernel, everything, known_kernels)
        manifests = [m for m in everything if stage is None or m.stage == stage]
        if kernel:
            manifests = [m for m in manifests if (m.backend or {}).get("kernel") == kernel]
        if where:
            from .query import filter_manifests

            manifests = filter_manifests(manifests, where)
        entries = [ls_entry(m) for m in manifests]
        n_errors = len(errors)
    else:
        entries, n_errors = listed.artifacts, len(listed.errors)
        stage = stage_name(stage, lambda: [SimpleNamespace(stage=e[2]) for e in entries], known_stages)
        if kernel:
            kernels = [(e, json.loads(e[5])["backend"]) for e in entries]
            kernel = kernel_name(kernel, [SimpleNamespace(backend=b) for _, b in kernels], known_kernels)
            entries = [e for e, b in kernels if (b or {}).get("kernel") == kernel]
        entries = [e for e in entries if stage is None or e[2] == stage]
    entries.sort(key=lambda e: (e[0], e[1]))  # (created, key); stable, so directory order between equals
    return entries, n_errors, stage


@dataclass
class VerifyResult:
    """What :func:`verify_artifacts` found: ``checked`` artifacts (invalid manifests included),
    ``bad`` (key -> its problems), ``broken`` ((artifact, what it lacks) of each upstream
    artifact or sample missing from the store: a warning, not corrupt data)."""

    checked: int
    bad: dict[str, list[str]]
    broken: list[tuple[Manifest, str]]
    keys: list[str] = field(default_factory=list)  # the artifacts checked, in order

    @property
    def good(self) -> list[str]:
        return [k for k in self.keys if k not in self.bad]


def verify_artifacts(store, keys: list[str] | None = None, *, progress=None) -> VerifyResult:
    """Re-hash ``keys`` (full keys; default: every artifact) against their manifests, as
    `dfcache verify` does. ``progress(total)``, if given, returns a bar (``update(n)``,
    ``close()``; tqdm's) or None."""
    errors: list = []
    everything = store.list_manifests(errors=errors)
    targets = list(keys) if keys else [m.key for m in everything]
    bad = {k: [msg] for k, msg in errors}
    # A missing upstream artifact is a broken chain, not corrupt data: the dependent's own
    # bytes are fine, and a store may hold an artifact without its inputs on purpose (pulled
    # with --no-upstream, or a run that pulled only the eval it needed).
    wanted = set(targets)
    broken = [(m, u) for m, u in missing_upstream(store, everything) if m.key in wanted]
    bar = progress(len(targets)) if progress is not None else None
    try:
        for k in targets:
            problems = store.verify(k)
            if problems:
                bad[k] = problems
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return VerifyResult(checked=len(targets) + len(errors), bad=bad, broken=broken, keys=targets)


def missing_upstream(store, manifests) -> list[tuple[Manifest, str]]:
    """(artifact, what it lacks) pairs: an upstream artifact not in ``store``; for an artifact
    made from samples (``sample_refs``; its upstream keys name sets of those samples, not
    artifacts), the referenced samples no segment of ``store`` holds; for a segment of a stage
    whose samples are made from another partition's (hidden states from tokens), the upstream
    samples no segment holds any more."""
    from .samples import INDEX, index_of

    present = {m.key for m in manifests}
    out = []
    for m in manifests:
        if m.samples:
            ups = [v for v in (m.samples.get("partition_upstream") or {}).values() if isinstance(v, str)]
            if len(ups) != 1:
                continue  # samples made from records (prompts), or from several partitions at once
            try:
                upstream = set(store.open(m.key).json(INDEX)["upstream"])
            except Exception:
                continue  # an unreadable segment is verify's own finding
            where = index_of(store).partition(ups[0])
            lost = sum(1 for k in upstream if k not in where)
            if lost:
                out.append((m, f"{lost} of {len(upstream)} upstream sample(s) of partition {ups[0]}"))
            continue
        if m.sample_refs:
            idx = index_of(store)
            for ref in m.sample_refs:
                where = idx.partition(ref["partition"])
                lost = sum(1 for k in ref["keys"] if k not in where)
                if lost:
                    out.append((m, f"{lost} of {len(ref['keys'])} sample(s) of partition {ref['partition']}"))
            continue
        for u in m.upstream_keys:
            if u not in present and not store.has(u):
                out.append((m, u))
    return out


@dataclass
class GcItem:
    kind: str  # "temporary" | "artifact"
    name: str  # staging path or key
    size_bytes: int
    reason: str


@dataclass
class GcPlan:
    items: list[GcItem] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(i.size_bytes for i in self.items)

    def execute(self, store, grace_s: float = 60.0) -> list[str]:
        removed = []
        for item in self.items:
            if item.kind == "temporary":
                if store.backend.remove_temporary(item.name, grace_s=grace_s):
                    removed.append(item.name)
            elif store.delete(item.name):
                removed.append(item.name)
        return removed


def _age_days(created: str) -> float:
    try:
        t = _dt.datetime.fromisoformat(created)
    except ValueError:
        return 0.0
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return (_dt.datetime.now(_dt.timezone.utc) - t).total_seconds() / 86400


def gc_plan(store, *, tmp: bool = True, stage: str | None = None, older_than_days: float | None = None,
            keys: list[str] | None = None, bad: bool = False, grace_s: float = 60.0,
            duplicates: bool = False, force: bool = False) -> GcPlan:
    """What gc would remove. Temporaries held by a live writer are never listed.

    ``duplicates``: segments whose every sample is read from another segment (nothing is lost).
    Artifacts (or samples) that kept artifacts depend on are refused with
    :class:`~dfcache.errors.DependentsError` naming the dependents, unless ``force``."""
    plan = GcPlan()
    if tmp:
        for t in store.backend.list_temporaries():
            if t.in_use or (t.age_s < grace_s and not t.name.endswith(GRAVE_SUFFIX)):
                continue
            reason = "resumable progress of an interrupted run" if t.resumable else "left by a crashed writer"
            plan.items.append(GcItem("temporary", t.name, t.size_bytes, reason))
    chosen: dict[str, str] = {}
    if stage or older_than_days is not None:
        for m in store.list_manifests():
            if stage and m.stage != stage:
                continue
            if older_than_days is not None and _age_days(m.created) < older_than_days:
                continue
            chosen[m.key] = "scope"
    for k in keys or []:
        chosen[k] = "named"
    if duplicates:
        from .references import redundant_segments

        for k, where in redundant_segments(store).items():
            chosen.setdefault(k, f"duplicate: every sample is also in {where}")
    if chosen and not force:
        from .references import dependents

        checked = [k for k, why in chosen.items() if why in ("scope", "named")]
        deps = dependents(store, list(chosen)) if checked else {}
        deps = {k: v for k, v in deps.items() if k in checked}
        if deps:
            from .errors import DependentsError

            lines = [f"  {k[:12]} is needed by {', '.join(d[:12] for d in v[:5])}" + (" ..." if len(v) > 5 else "")
                     for k, v in list(deps.items())[:10]]
            raise DependentsError(f"gc would remove {len(deps)} artifact(s) that others depend on:\n" + "\n".join(lines)
                                  + "\nRemove the dependents too (add them with --key), or pass --force to remove "
                                  "anyway.", dependents=deps)
    if bad:
        errors: list = []
        for m in store.list_manifests(errors=errors):
            if store.verify(m.key):
                chosen[m.key] = "fails verification"
        for k, _msg in errors:
            chosen[k] = "invalid manifest"
    sizes = {}
    for k in chosen:
        try:
            sizes[k] = store.manifest(k).size_bytes
        except Exception:
            sizes[k] = sum(store.backend.list_files(k).values())
    for k, reason in chosen.items():
        plan.items.append(GcItem("artifact", k, sizes[k], reason))
    return plan


def where_scope(store, where: list[str], stage: str | None = None, older_than_days: float | None = None) -> list[Manifest]:
    """Artifacts matching every ``--where`` condition (and the stage / age, when given)."""
    from .query import filter_manifests

    ms = [m for m in store.list_manifests(stage=stage)
          if older_than_days is None or _age_days(m.created) >= older_than_days]
    return filter_manifests(ms, where)


def upstream_chain(store, m: Manifest) -> list[dict]:
    """What ``m`` was made from, depth first, as `dfcache show` prints it.

    Artifacts named by upstream keys are entries ``{"key", "stage", "depth", "present", "summary"}``
    as before. Samples are followed through their partitions (dfcache/samples/): an artifact
    made from samples (``sample_refs``: a report's upstream keys name *sets* of samples, not
    artifacts) or a segment leads to each partition its samples come from, and from there, through
    the upstream keys in each segment's samples document, to the exact samples they were made
    from, partition by partition. Such an entry is ``{"key": partition, "kind": "samples", "stage",
    "depth", "present": all there, "samples": {"needed", "present"}, "segments": [keys], "summary"}``;
    a partition already listed is not listed again."""
    from .samples import Segment, index_of, sample_key

    chain: list[dict] = []
    seen: set[str] = set()
    idx = index_of(store)

    def follow(roles: dict, upstream: list[str], depth: int) -> None:
        # The samples' own upstream ("sample") first: a chain reads eval -> tokens -> completions.
        for role, parts in sorted(roles.items(), key=lambda kv: kv[0] != "sample"):
            for q in (parts if isinstance(parts, list) else [parts]):
                visit(q, upstream if role == "sample" else [sample_key(q, u) for u in upstream], depth)

    def visit(partition: str, keys: list[str], depth: int) -> None:
        if partition in seen:
            return
        seen.add(partition)
        keys = list(dict.fromkeys(keys))
        where = idx.partition(partition)
        present = [k for k in keys if k in where]
        segs = sorted({where[k][0] for k in present})
        manifests = idx.segments(partition)
        first = manifests.get(segs[0]) if segs else next(iter(manifests.values()), None)
        summary = re.sub(r"^[0-9]+ samples: ", "", first.summary) if first else ""  # one segment's count
        chain.append({"key": partition, "kind": "samples", "stage": first.stage if first else None, "depth": depth,
                      "present": len(present) == len(keys), "samples": {"needed": len(keys), "present": len(present)},
                      "segments": segs, "summary": summary})
        if first is None or not present:
            return
        upstream: list[str] = []
        wanted = set(present)
        for s in segs:
            try:
                seg = Segment(store, s)
            except Exception:  # a damaged segment: verify names it; the chain stops there
                continue
            upstream += [u for k, u in zip(seg.keys, seg.upstream) if k in wanted]
        follow((first.samples or {}).get("partition_upstream") or {}, sorted(set(upstream)), depth + 1)

    def visit_artifact(key: str, depth: int) -> None:
        if key in seen:
            return
        seen.add(key)
        if not store.has(key):
            chain.append({"key": key, "stage": None, "depth": depth, "present": False, "summary": ""})
            return
        um = store.manifest(key)
        chain.append({"key": key, "stage": um.stage, "depth": depth, "present": True, "summary": um.summary})
        walk(um, depth + 1)

    def walk(mm: Manifest, depth: int) -> None:
        if mm.samples:
            try:
                seg = Segment(store, mm.key)
            except Exception:
                return
            follow(mm.samples.get("partition_upstream") or {}, seg.upstream, depth)
        for ref in mm.sample_refs or []:
            visit(ref["partition"], ref["keys"], depth)
        if not mm.sample_refs:  # with sample_refs, upstream keys are set keys of those samples
            for k in mm.upstream_keys:
                visit_artifact(k, depth)

    walk(m, 1)
    return chain
