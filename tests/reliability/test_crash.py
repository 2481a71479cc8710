"""Crash injection: writers SIGKILLed at random instants across staging, chunk writes and commit.

After every kill: `dfcache verify` is clean, `dfcache ls` lists only complete artifacts, a rerun
completes, and nothing committed earlier is lost. Writers print phase markers (children.py), so
the test knows where each kill landed and asserts that all three phases were hit.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from children import boundaries_of, check_artifact, key_of
from rel_helpers import NUM_PROMPTS, artifacts_listing, copy_store, has_stage

from dfcache.store import open_store

PHASES = {"S": "staging", "C": "chunks", "P": "publish", "D": "between", "H": "between", "R": "staging",
          "K": "checkpoint", "k": "chunks"}


def markers(text: str) -> list[list[str]]:
    """The phase markers (the pause's own ``Z``/``O`` lines left out)."""
    return [m for m in (line.split() for line in text.splitlines() if line.strip()) if m[0] not in ("Z", "O")]


def frozen(text: str) -> bool:
    return any(line.startswith("Z ") for line in text.splitlines())


def kill_when_frozen(child, stream: str = "out", timeout: float = 300.0) -> bool:
    """Wait until the child stopped at its pause (True) or exited without reaching it (False),
    then SIGKILL it: the kill lands where the pause is, whatever the load."""
    deadline = time.monotonic() + timeout
    while not frozen(getattr(child, stream)):
        if child.poll() is not None:
            return frozen(getattr(child, stream))
        if time.monotonic() > deadline:
            raise TimeoutError(f"child never reached its pause:\n{child.out}\n{child.err}")
        time.sleep(0.001)
    child.kill()
    return True


def wait_for(child, pred, timeout: float = 60.0) -> bool:
    """Poll the child's markers until ``pred(markers)`` holds (True) or the child exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(markers(child.out)):
            return True
        if child.poll() is not None:
            return pred(markers(child.out))
        time.sleep(0.0005)
    raise TimeoutError(f"child never reached the marker:\n{child.out}\n{child.err}")


def store_is_sound(zygote, store: Path, must_have: set[str], known: set[str], where: str) -> set[str]:
    """`dfcache verify` clean, `dfcache ls` only complete artifacts, nothing committed lost."""
    verify = zygote.spawn("children:cli_main", "--store", store, "verify", "--json", name="verify")
    ls = zygote.spawn("children:cli_main", "--store", store, "ls", "--json", name="ls")  # both read-only: at once
    code, err = verify.wait(120), verify.err
    report = json.loads(verify.out) if verify.out.strip() else None
    assert code == 0 and report["bad"] == [], f"{where}: verify: {code} {report} {err}"
    code, err = ls.wait(120), ls.err
    rows = json.loads(ls.out) if ls.out.strip() else None
    assert code == 0, f"{where}: ls: {err}"
    listed = {r["key"] for r in rows}
    assert must_have <= listed, f"{where}: committed artifacts lost: {must_have - listed}"
    assert listed <= known, f"{where}: unknown artifacts listed: {listed - known}"
    assert report["checked"] == len(listed)
    return listed


def random_spec(rng: random.Random, i: int) -> dict:
    cols = rng.choice([8, 32, 64, 128])
    rows = rng.choice([50, 300, 1200, 4000])
    while rows * cols > 120_000:
        rows //= 2
    return {"i": i, "rows": rows, "cols": cols, "chunk_rows": rng.choice([64, 256, 1024]),
            "dtype": rng.choice(["float32", "bfloat16"]), "codec": rng.choice(["none", "none", "zstd"])}


def files_of(spec: dict) -> int:
    chunks = -(-spec["rows"] // spec["chunk_rows"])
    return 2 * chunks + 5


# ------------------------------------------------------------------------------ store writers


def test_sigkill_store_writers_at_random_instants(zygote, fast_tmp, stress, figures):
    trials = 300 if stress else 52
    rng = random.Random(20240611)
    store = fast_tmp / "store"
    open_store(store)
    committed: set[str] = set()
    known: set[str] = set()
    hits = {"staging": 0, "chunks": 0, "publish": 0, "between": 0, "exited": 0}
    aims = ["staging", "chunks", "publish", "random"]
    t0 = time.monotonic()
    for t in range(trials):
        specs = [random_spec(rng, 3 * t + j) for j in range(3)]
        known |= {key_of(s) for s in specs}
        aim, target = aims[t % 4], rng.randrange(3)
        letter = {"staging": "S", "chunks": "C", "publish": "P"}.get(aim)
        if letter:  # the n-th store operation of that phase of that artifact (its end at the latest)
            ops = {"S": 2, "C": files_of(specs[target]), "P": 10}[letter]
            pause = {"after": f"{letter} {specs[target]['i']}", "op": rng.randint(1, ops)}
        else:  # any operation of the job, or none (the job completes)
            pause = {"op": rng.randint(1, sum(2 * files_of(sp) for sp in specs))}
        job = json.dumps({"artifacts": specs, "pause": pause})
        child = zygote.spawn("children:writer_job", store, job, name=f"writer{t}")
        kill_when_frozen(child)
        code = child.wait(60)
        ms = markers(child.out)
        if code == 0:
            hits["exited"] += 1  # the pause was past the job's last operation
        else:
            assert code == -9, child.err
            hits[PHASES[ms[-1][0]] if ms else "staging"] += 1
        committed |= {m[2] for m in ms if m[0] in ("D", "H")}
        where = f"trial {t} (aim {aim}, pause {pause}, last marker {ms[-1] if ms else None})"
        store_is_sound(zygote, store, committed, known, where)
        # a rerun completes, and what it (or the killed run) committed is exactly the spec's bytes
        rerun = zygote.run("children:writer_job", store, json.dumps({"artifacts": specs}), name=f"rerun{t}")
        assert rerun.code == 0, f"{where}: rerun failed: {rerun.err}"
        s = open_store(store)
        for spec in specs:  # (the next trial's `dfcache verify` re-hashes them against the manifest)
            assert check_artifact(s, spec, verify=False) == [], where
        committed |= {key_of(sp) for sp in specs}
    store_is_sound(zygote, store, committed, known, "end")
    # What the kills left is only temporaries: gc removes them and nothing else.
    before = artifacts_listing(store)
    gc = zygote.cli("--store", store, "gc", "--yes", "--grace", "0")
    assert gc.code == 0, gc.err
    assert list((store / "staging").iterdir()) == []
    assert artifacts_listing(store) == before
    figures.record("crash_store_writers", trials=trials, kills_by_phase=hits, artifacts_committed=len(committed),
                   seconds=round(time.monotonic() - t0, 1))
    for phase in ("staging", "chunks", "publish"):  # every aimed kill lands in its phase
        assert hits[phase] >= trials // 4, f"kills landed in {phase} only {hits[phase]} times: {hits}"


# ------------------------------------------------------------------------------ resumable writers


def resumable_spec(rng: random.Random, i: int) -> dict:
    steps = [rng.randrange(1, 200)]
    while sum(steps) < 2400:
        # Multiples of chunk_rows as well as odd steps: consecutive checkpoints then often have
        # tails of equal length, which is where a stale tail could pass for a current one.
        steps.append(rng.choice([64, 128, 192, 37, 100, 150]))
    return {"i": 10_000 + i, "rows": 2400, "cols": 24, "chunk_rows": 64, "steps": steps,
            "dtype": "float32", "codec": rng.choice(["none", "zstd"]), "slow": 0.0}


def test_sigkill_resumable_writers_mid_checkpoint_then_resume(zygote, fast_tmp, stress, figures):
    trials = 60 if stress else 14
    rng = random.Random(77)
    store = fast_tmp / "store"
    ref_store = fast_tmp / "ref"
    open_store(store)
    committed: set[str] = set()
    known: set[str] = set()
    hits = {"checkpoint": 0, "chunks": 0, "staging": 0, "publish": 0, "between": 0, "exited": 0}
    resumed_rows = []
    t0 = time.monotonic()
    for t in range(trials):
        spec = resumable_spec(rng, t)
        key = key_of(spec)
        known.add(key)
        bounds = boundaries_of(spec)
        if t % 3 != 2:  # most kills aimed at a checkpoint in flight (up to its last operation)
            pause = {"after": f"K {rng.choice(bounds[1:-2])}", "op": rng.randint(1, 4)}
        else:  # the rest at any store operation (two per chunk file, a few per checkpoint)
            pause = {"op": rng.randint(1, 2 * (spec["rows"] // spec["chunk_rows"]) + 4 * len(bounds))}
        child = zygote.spawn("children:resumable_job", store, json.dumps(spec), json.dumps(pause), name=f"res{t}")
        kill_when_frozen(child)
        code = child.wait(60)
        ms = markers(child.out)
        if code == 0:
            hits["exited"] += 1
        else:
            hits[PHASES[ms[-1][0]] if ms else "staging"] += 1
        done = [int(m[1]) for m in ms if m[0] == "k"]
        started = [int(m[1]) for m in ms if m[0] == "K"]
        where = f"resumable trial {t} (pause {pause}, last marker {ms[-1] if ms else None})"
        store_is_sound(zygote, store, committed, known, where)

        rerun = zygote.run("children:resumable_job", store, json.dumps(spec), name=f"reres{t}")
        assert rerun.code == 0, f"{where}: {rerun.err}"
        r = next((m for m in markers(rerun.out) if m[0] in ("R", "H")), None)
        if r and r[0] == "R" and code != 0:
            rows, resumed = int(r[1]), int(r[2])
            last_done = max(done, default=0)
            # Everything checkpointed is kept (a tail written by a checkpoint that did not finish
            # may be dropped, never more than one chunk's worth), nothing beyond what was written.
            assert rows >= (last_done // spec["chunk_rows"]) * spec["chunk_rows"], (where, rows, done)
            assert rows <= max(started, default=0), (where, rows, started)
            assert resumed == (1 if done or started else resumed)
            resumed_rows.append(rows)
        s = open_store(store)
        assert check_artifact(s, spec) == [], where
        committed.add(key)
        # byte-identical to an uninterrupted run of the same spec
        ref = open_store(ref_store)
        if not ref.has(key):
            assert zygote.run("children:resumable_job", ref_store, json.dumps({**spec, "slow": 0})).code == 0
        a, b_ = s.manifest(key), ref.manifest(key)
        assert {n: (x.digest, x.chunk_digests, x.shape) for n, x in a.arrays.items()} == \
            {n: (x.digest, x.chunk_digests, x.shape) for n, x in b_.arrays.items()}
        for rel in sorted(s.backend.list_files(key)):
            if "/c/" in rel:
                assert (store / "artifacts" / key[:2] / key / rel).read_bytes() == \
                    (ref_store / "artifacts" / key[:2] / key / rel).read_bytes(), (where, rel)
        shutil.rmtree(ref_store)
    figures.record("crash_resumable_writers", trials=trials, kills_by_phase=hits,
                   resumed_runs=len(resumed_rows), rows_resumed_mean=round(float(np.mean(resumed_rows or [0])), 1),
                   seconds=round(time.monotonic() - t0, 1))
    assert hits["checkpoint"] >= (2 * trials) // 3, hits  # every aimed kill
    assert len(resumed_rows) >= (2 * trials) // 3, "too few reruns actually resumed"


def test_sigkill_inside_a_parallel_append_then_resume(zygote, fast_tmp):
    """DFCACHE_WRITE_THREADS=4: a kill while four threads stage the chunk files of one append
    (16 chunks) loses that append only; the rerun resumes at the last checkpoint exactly and
    commits the spec's bytes."""
    rng = random.Random(36)
    store = fast_tmp / "store"
    open_store(store)
    env = {"DFCACHE_WRITE_THREADS": "4"}
    for t in range(3):
        spec = {"i": 20_000 + t, "rows": 2048, "cols": 64, "chunk_rows": 32, "steps": [512] * 4,
                "dtype": "bfloat16", "codec": "none", "slow": 0.0}
        after = rng.choice([512, 1024])
        # a put and a rename per chunk file: operations 2..30 after the checkpoint are inside the append
        pause = {"after": f"k {after}", "op": rng.randint(2, 30)}
        child = zygote.spawn("children:resumable_job", store, json.dumps(spec), json.dumps(pause), env=env,
                             name=f"par{t}")
        assert kill_when_frozen(child)
        child.wait(60)
        where = f"parallel trial {t} (pause {pause}): {child.out}"
        assert markers(child.out)[-1] == ["k", str(after)], where
        z = child.out.splitlines()[-1]
        assert " put x/c/" in z or z.endswith(" replace 0"), where  # frozen at a chunk file's put or rename
        assert not open_store(store).has(key_of(spec)), where
        rerun = zygote.run("children:resumable_job", store, json.dumps(spec), env=env, name=f"parre{t}")
        assert rerun.code == 0, f"{where}: {rerun.err}"
        assert next(m for m in markers(rerun.out) if m[0] == "R") == ["R", str(after), "1"], (where, rerun.out)
        assert check_artifact(open_store(store), spec) == [], where


def test_gc_killed_while_removing_resumable_progress(zygote, tmp_path, stress):
    """`gc --yes` SIGKILLed half-way through deleting a crashed writer's resumable progress must
    not leave progress that a later writer trusts but whose chunks are gone."""
    trials = 20 if stress else 6
    rng = random.Random(5)
    for t in range(trials):
        store = tmp_path / f"store{t}"  # a disk: tmpfs lists the newest file (progress.json) first
        open_store(store)
        spec = resumable_spec(rng, 500 + t)
        spec["slow"] = 0.0
        child = zygote.spawn("children:resumable_job", store, json.dumps(spec), name=f"gcres{t}")
        wait_for(child, lambda ms: sum(m[0] == "k" for m in ms) >= 12)
        child.kill()
        child.wait(30)
        gc = zygote.spawn("children:slow_cli", "0.002", "--store", store, "gc", "--yes", "--grace", "0",
                          name=f"gc{t}")
        after = rng.randrange(1, 30)
        wait_for(gc, lambda ms: any(m[0] == "U" and int(m[1]) >= after for m in ms))
        gc.kill()
        gc.wait(30)
        rerun = zygote.run("children:resumable_job", store, json.dumps(spec), name=f"gcrerun{t}")
        assert rerun.code == 0, rerun.err
        assert check_artifact(open_store(store), spec) == [], f"trial {t}: {rerun.out}"


# ------------------------------------------------------------------------------ pulls


def test_sigkill_dfcache_pull_at_random_instants(zygote, fast_tmp, stress, figures):
    """`dfcache pull` SIGKILLed at random instants: the local store only ever holds complete,
    verified artifacts, and the next pull fetches the rest."""
    trials = 40 if stress else 10
    rng = random.Random(99)
    src, local = fast_tmp / "src", fast_tmp / "local"
    remote = f"file://{fast_tmp / 'remote'}"
    specs = [random_spec(rng, 5000 + j) for j in range(8)]
    assert zygote.run("children:writer_job", src, json.dumps({"artifacts": specs})).code == 0
    assert zygote.cli("--store", src, "push", remote, "--all").code == 0
    known = {key_of(sp) for sp in specs}
    open_store(local)
    killed = 0
    for t in range(trials):
        # Stop before one of the files this pull must fetch (each is one staged file here), so
        # that the kill lands mid-pull: inside an artifact or between two.
        s = open_store(local)
        to_fetch = sum(1 for k in known if not s.has(k) for f in (src / "artifacts" / k[:2] / k).rglob("*")
                       if f.is_file())
        pause = {"op": rng.randint(1, to_fetch)}
        child = zygote.spawn("children:paused_cli", json.dumps(pause), "--store", local, "pull", remote, "--all",
                             "--jobs", "2", name=f"pull{t}")
        assert kill_when_frozen(child, "err"), f"pull trial {t}: never reached {pause}:\n{child.err}"
        killed += child.wait(60) == -9
        listed = store_is_sound(zygote, local, set(), known, f"pull trial {t}")
        again = zygote.cli("--store", local, "pull", remote, "--all")
        assert again.code == 0, again.err
        s = open_store(local)
        assert all(check_artifact(s, sp, verify=False) == [] for sp in specs)
        assert listed <= known
        # forget a few so that the next pull has work again
        for k in rng.sample(sorted(known), 5):
            s.delete(k)
    figures.record("crash_pull", trials=trials, killed_mid_pull=killed)
    assert killed == trials


# ------------------------------------------------------------------------------ real hidden-states runs


@pytest.mark.skipif(not has_stage("hidden_states"), reason="runner/stages/hidden_states/ (the hidden-states "
                    "stage) is not there yet")
def test_sigkill_dfcache_run_hidden_states(heavy_zygote, base_store, tmp_path, stress, figures):
    """`dfcache run hidden-states` on the tiny target, committing one sample a segment, SIGKILLed at
    random instants once a segment is committed: nothing committed is lost, the rerun computes only
    the samples still missing, and every sample's states equal an uninterrupted run's bytes."""
    from dfcache.samples import SampleSet, index_of

    trials = 16 if stress else 4
    rng = random.Random(11)
    small = {"DFCACHE_SEGMENT_BYTES": str(128 * 4)}  # fp32 rows of 128: one sample a segment
    args = [*base_store["args"], "--offline", "--layer", "1", "--layer", "4", "--backend", "torch", "--device",
            "cpu", "--dtype", "float32", "--batch-tokens", "8", "--json"]
    ref = copy_store(base_store, tmp_path / "ref")
    # The uninterrupted run lists its store operations (how many segments it publishes); the kills
    # stop the same run after its first segment is published and before its last one is.
    first = heavy_zygote.run("children:paused_cli", json.dumps({"list": True}), "--store", ref, "run",
                             "hidden-states", *args, timeout=300, name="hs-ref", env=small)
    assert first.code == 0, first.err
    layer_nodes = [n for n in json.loads(first.out)["nodes"] if n["stage"] == "hidden_states"]
    assert len(layer_nodes) == 2
    ref_store = open_store(ref)
    ref_keys = {n["partition"]: sorted(index_of(ref_store).partition(n["partition"])) for n in layer_nodes}
    assert all(len(v) == NUM_PROMPTS for v in ref_keys.values())
    ops = [line.split(" ", 2)[2] for line in first.err.splitlines() if line.startswith("O ")]
    publishes = [i for i, op in enumerate(ops) if op.startswith("rename ")]
    assert len(publishes) > len(layer_nodes), ops
    kept_before = set(base_store["keys"].values())
    resumed = 0
    t0 = time.monotonic()
    for t in range(trials):
        store = copy_store(base_store, tmp_path / f"s{t}")
        # just before the (n+1)-th segment publish, n >= 1: counted in publishes, not in operations,
        # as the layers' segments are written by a pool of threads (any interleaving). Counting
        # starts when the first publish returns; another layer's publish already under way then is
        # not counted (one per other commit thread: CI's run of 2026-12-08 stopped at op 7 of 8 and
        # the run finished with 6 counted), so the last ones reachable for sure are publishes - layers.
        last = len(publishes) - len(layer_nodes)
        pause = {"after_op": "rename ", "only": "rename ", "op": rng.randint(1, last)}
        child = heavy_zygote.spawn("children:paused_cli", json.dumps(pause), "--store", store, "run",
                                   "hidden-states", *args, name=f"hs{t}", env=small)
        assert kill_when_frozen(child, "err"), f"hs trial {t}: never reached {pause}:\n{child.err[-3000:]}"
        code = child.wait(60)
        assert code == -9, child.err[-3000:]
        segs = {m.key for m in open_store(store).list_manifests(stage="hidden_states")}
        committed = {p: set(index_of(open_store(store)).partition(p)) for p in ref_keys}
        assert any(committed.values()), f"hs trial {t} ({pause}): nothing committed before the kill"
        store_is_sound(heavy_zygote, store, kept_before | segs, kept_before | segs, f"hs trial {t}")
        rerun = heavy_zygote.cli("--store", store, "run", "hidden-states", *args, timeout=300, env=small)
        assert rerun.code == 0, rerun.err
        rows = {r["key"]: r["samples"] for r in json.loads(rerun.out)["stages"] if r["stage"] == "hidden_states"}
        for n in layer_nodes:
            c = rows[n["key"]]
            kept = len(committed[n["partition"]])
            assert c["reused"] == kept and c["computed"] == NUM_PROMPTS - kept, (t, c, kept)
        resumed += 1
        st = open_store(store)
        for p, keys in ref_keys.items():
            assert sorted(index_of(st).partition(p)) == keys
            mine, theirs = SampleSet(st, p, keys), SampleSet(ref_store, p, keys)
            for i in range(len(keys)):
                assert mine.read_raw(i, "hidden").tobytes() == theirs.read_raw(i, "hidden").tobytes(), \
                    f"hs trial {t}: sample {keys[i]} of partition {p} differs after the kill"
        assert {m.key for m in st.list_manifests(stage="hidden_states")} >= segs  # nothing committed lost
    figures.record("crash_run_hidden_states", trials=trials, resumed=resumed,
                   seconds=round(time.monotonic() - t0, 1))
    assert resumed == trials, "a rerun did not find committed segments of a killed run"
