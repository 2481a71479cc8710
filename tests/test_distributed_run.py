"""`dfcache run` as many workers into one store: torchrun ranks and --shard workers (CPU, gloo).

Real processes all the way: `torchrun --standalone` (as ``python -m torch.distributed.run``) starting
`python -m dfcache run hidden-states`, completions from a real local HTTP server, the tiny target,
a local directory and the moto S3 server as the shared store. Every store a distributed run fills
must hold the same samples, byte for byte, as one process's run; a rank SIGKILLed mid-run
(tests/dist_child.py: right after its first committed segment) loses only uncommitted work, and a
rerun at another world size makes exactly what is missing.

One torchrun job starts its ranks as new interpreters, as a user's does; the others' workers (and
the --shard processes) are real processes forked from a server that imported torch and
transformers once (tests/torchrun_fork.py): a worker's start-up cost ~5.5 s of CPU, of which the
imports were ~3.5 s; the file went from 106 s to 49 s of CPU on the 2-core CI VM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from s3server import s3_in_env  # noqa: E402
from servers import ScriptedServer  # noqa: E402
from torchrun_fork import CLIENT, ForkServer  # noqa: E402

N = 6  # prompts: 3 a rank of 2, 2 a rank of 3
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun workers need fork/exec and gloo on TCP")


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(chat="slow") as s:
        yield s


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    drop = ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE", "DFCACHE_DEBUG", "DFCACHE_CONFIG", "RANK",
            "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    home = tmp_path_factory.mktemp("dist-home")
    e = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    e.update(DFCACHE_HOME=str(home), DFCACHE_CONFIG=str(home / "absent.toml"), HF_HUB_DISABLE_UPDATE_CHECK="1",
             OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             DFCACHE_SEGMENT_BYTES=str(128 * 4),  # fp32 rows of 128: one sample a segment
             PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    return e


# What the workers' fork server imports once (tests/torchrun_fork.py): what a hidden-states worker
# imports, less `datasets` (it reads HF_DATASETS_CACHE, which a test sets, when imported).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.launcher.api", "transformers", "transformers.models.qwen3_5.modeling_qwen3_5",
           "dfcache.cli", "runner.api", "runner.commands.run", "runner.core.pipeline", "runner.distributed",
           "runner.models.target", "runner.stages.completions", "runner.stages.tokens",
           "runner.stages.hidden_states.extract", "cli_util", "runpy"]


@pytest.fixture(scope="module")
def forks(env, tmp_path_factory):
    """The fork server of every worker here but test_torchrun_two_ranks_fill_the_store_like_one_process's
    (which starts new interpreters, as a user's torchrun does): ``forks.env_for_workers`` is
    ``env`` with its socket; a command runs ``[CLIENT, ...]`` where it would run ``python ...``.
    The variables the tests add to ``env`` are read at run time, not when torch or dfcache import."""
    server = ForkServer(env, tmp_path_factory.mktemp("dist-fork"), PRELOAD,
                        allowed=("DIST_CHILD_KILL_RANK", "AWS_*", "HF_DATASETS_CACHE"))
    assert server.hello["threads"] == 1 and not server.hello["datasets"], server.hello
    yield server
    server.close()


@pytest.fixture(scope="module")
def args(tiny_target, server):
    return ["--target", str(tiny_target), "--server", server.url, "--num-prompts", str(N), "--max-new-tokens", "8",
            "--layer", "1", "--backend", "torch", "--device", "cpu", "--dtype", "float32", "--no-progress", "--json"]


def _torchrun(nproc: int, *cmd) -> list[str]:
    """torchrun starting ``python CMD...`` ``nproc`` times; with CMD ``CLIENT ...``, torchrun and its
    workers are forked from the fork server (``forks.env_for_workers``)."""
    fork = [CLIENT] if cmd[0] == CLIENT else []
    return [sys.executable, *fork, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]


def _dfcache(store, *rest) -> list[str]:
    return ["-m", "dfcache", "--store", str(store), "run", "hidden-states", *rest]


def _run(cmd, env, extra=None, timeout=240):
    return subprocess.run(cmd, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _open(store, s3=None):
    from dfcache.store import open_store

    return open_store(str(store), create=False, endpoint_url=s3.endpoint if s3 else None)


def _states(store) -> dict[str, dict[str, bytes]]:
    """Every hidden-states sample of the store: partition -> sample key -> its raw bytes."""
    from dfcache.samples import SampleSet, index_of

    idx = index_of(store)
    idx.refresh()
    out = {}
    for p in idx.partitions():
        segs = idx.segments(p)
        if not segs or next(iter(segs.values())).stage != "hidden_states":
            continue
        keys = sorted(idx.partition(p))
        ss = SampleSet(store, p, keys)
        out[p] = {k: ss.read_raw(i, "hidden").tobytes() for i, k in enumerate(keys)}
    return out


def _hs_row(out: str) -> dict:
    (row,) = [r["samples"] for r in json.loads(out)["stages"] if r["stage"] == "hidden_states"]
    return row


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target, server):
    """One process's run (this one, on one thread like the workers): what every distributed run
    must reproduce byte for byte."""
    import torch

    from runner import api

    store = tmp_path_factory.mktemp("ref") / "store"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DFCACHE_SEGMENT_BYTES", str(128 * 4))
            for k in ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE"):
                mp.delenv(k, raising=False)
            api.run("hidden-states", store=str(store), target=str(tiny_target), server=server.url,
                    completions="server", num_prompts=N, max_new_tokens=8, layers=[1], backend="torch",
                    device="cpu", dtype="float32")
    finally:
        torch.set_num_threads(threads)
    states = _states(_open(store))
    (layer,) = states.values()
    assert len(layer) == N
    return states


def test_torchrun_two_ranks_fill_the_store_like_one_process(tmp_path, env, args, server, reference):
    store = tmp_path / "store"
    server.max_in_flight = 0
    r = _run(_torchrun(2, *_dfcache(store, *args, "--concurrency", "2")), env)
    assert r.returncode == 0, r.stderr
    summary = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(summary) == 1, r.stdout  # rank 0 speaks for the job; rank 1 prints nothing
    out = json.loads(summary[0])
    assert out["worker"]["world"] == 2 and out["worker"]["shares_missing"] and out["worker"]["complete"]
    row = _hs_row(summary[0])
    assert row["computed"] == N and row["reused"] == 0  # summed over both ranks, each sample once
    assert "[rank 1/2] hidden states: 3 sample(s)" in r.stderr and "[rank 0/2] hidden states: 3 sample(s)" in r.stderr
    assert server.max_in_flight <= 2  # the ranks share --concurrency 2, they do not each take 2
    states = _states(_open(store))
    assert states == reference
    # Rank 0's bar counts what every rank committed, read from the store: here, all of it.
    from runner.distributed import StoreProgress

    (p, samples), = states.items()
    units = [([(p, k)], 10) for k in samples] + [([(p, "0" * 32)], 5)]  # and one never made
    assert StoreProgress(str(store), units, enabled=False).poll() == (N, 10 * N)


def _killed_then_rerun(store, env, args, rerun_cmd, s3=None):
    """Rank 1 of 2 dies after its first committed segment; the rerun (``rerun_cmd``) makes the rest."""
    extra = {"DIST_CHILD_KILL_RANK": "1", **({"AWS_ENDPOINT_URL": s3.endpoint, **s3.env} if s3 else {})}
    killed = _run(_torchrun(2, CLIENT, str(HERE / "dist_child.py"), "--store", str(store), "run", "hidden-states",
                            *args), env, extra)
    assert killed.returncode != 0, "torchrun reports the lost rank"
    kept = _states(_open(store, s3))
    committed = sum(len(v) for v in kept.values())
    # rank 1 committed one of its 3, never its other two (else: what the ranks said)
    assert 1 <= committed <= N - 2, (committed, killed.stdout[-3000:], killed.stderr[-6000:])
    r = _run(rerun_cmd, env, extra)
    assert r.returncode == 0, r.stderr
    summary = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(summary) == 1, r.stdout
    row = _hs_row(summary[0])
    assert (row["reused"], row["computed"]) == (committed, N - committed)  # exactly the missing ones
    after = _states(_open(store, s3))
    for p, samples in kept.items():  # nothing committed was lost or rewritten
        assert all(after[p][k] == b for k, b in samples.items())
    return after


def test_killed_rank_then_three_ranks_finish_exactly_the_missing(tmp_path, forks, args, reference):
    store = tmp_path / "store"
    after = _killed_then_rerun(store, forks.env_for_workers, args, _torchrun(3, CLIENT, *_dfcache(store, *args)))
    assert after == reference


def test_killed_rank_into_s3_then_one_process_finishes(s3, forks, args, reference):
    store = f"s3://{s3.create_bucket()}/dfcache"
    after = _killed_then_rerun(store, forks.env_for_workers, args, [sys.executable, CLIENT, *_dfcache(store, *args)],
                               s3=s3)
    assert after == reference


def test_shards_as_plain_processes_fill_the_store(tmp_path, forks, args, reference):
    store = tmp_path / "store"
    env = forks.env_for_workers
    procs = [subprocess.Popen([sys.executable, CLIENT, *_dfcache(store, *args, "--shard", f"{i}/2")], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    docs = [json.loads(o) for o, _ in outs]
    assert [d["worker"]["rank"] for d in docs] == [0, 1]
    assert all(not d["worker"]["shares_missing"] for d in docs)  # they cannot meet: the whole set is shared
    assert any(d["worker"]["complete"] for d in docs)  # whichever finished last saw the set complete
    assert sum(_hs_row(o)["computed"] for o, _ in outs) == N  # every sample made once, by its owner
    assert _states(_open(store)) == reference
    # A rerun of one shard (say its task was retried) finds its share stored and makes nothing.
    again = _run([sys.executable, CLIENT, *_dfcache(store, *args, "--shard", "1/2")], env)
    assert again.returncode == 0, again.stderr
    assert _hs_row(again.stdout)["computed"] == 0


def test_bad_shard_is_a_usage_error(tmp_path, env, args):
    r = _run([sys.executable, *_dfcache(tmp_path / "store", *args, "--shard", "2/2")], env)
    assert r.returncode == 2 and "--shard '2/2'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "store" / "artifacts").exists()


_API_CHILD = """
import json, sys
from runner import api
r = api.run("hidden-states", store=sys.argv[1], target=sys.argv[2], server=sys.argv[3], completions="server",
            num_prompts=int(sys.argv[4]), max_new_tokens=8, layers=[1], backend="torch", device="cpu",
            dtype="float32")
hs = [n.samples for n in r.nodes if n.stage == "hidden_states"]
# One write of the whole line: print() writes the text and its newline apart, and two ranks on
# one pipe then interleaved ("RESULT {rank 0}RESULT {rank 1}", seen in CI with two busy loops).
sys.stdout.write("RESULT " + json.dumps({"worker": r.worker, "complete": r.complete, "nodes": len(r.nodes),
                                         "computed": hs[0]["produced"] if hs else None}) + "\\n")
sys.stdout.flush()
"""


def test_python_api_run_under_torchrun_is_one_worker_like_the_cli(tmp_path, forks, server, tiny_target, reference):
    """runner.api.run in a script that torchrun starts twice makes each rank's share, as `dfcache
    run` would; rank 0's result speaks for the job, rank 1's says only who it was."""
    store = tmp_path / "store"
    script = tmp_path / "api_child.py"
    script.write_text(_API_CHILD)
    r = _run(_torchrun(2, CLIENT, str(script), str(store), str(tiny_target), server.url, str(N)), forks.env_for_workers)
    assert r.returncode == 0, r.stderr
    out = sorted((json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")),
                 key=lambda d: d["worker"]["rank"])
    assert [d["worker"]["rank"] for d in out] == [0, 1] and all(d["worker"]["world"] == 2 for d in out)
    assert out[0]["complete"] and out[0]["nodes"] > 0 and out[0]["computed"] == N  # summed over both ranks
    assert out[1]["nodes"] == 0  # rank 0 has the job's result
    assert out[0]["worker"]["my_prompts"] + out[1]["worker"]["my_prompts"] == N
    assert _states(_open(store)) == reference


def test_python_api_run_with_shard_makes_only_its_share(tmp_path, server, tiny_target, reference, monkeypatch):
    """shard="I/N" from Python: each call makes its share of the whole set; the second finds the
    set complete, and the two together hold exactly one process's samples."""
    import torch

    from runner import api

    for k in ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DFCACHE_SEGMENT_BYTES", str(128 * 4))
    store = tmp_path / "store"
    opts = dict(store=str(store), target=str(tiny_target), server=server.url, completions="server", num_prompts=N,
                max_new_tokens=8, layers=[1], backend="torch", device="cpu", dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference was made
    try:
        first = api.run("hidden-states", shard="1/2", **opts)
        second = api.run("hidden-states", shard="0/2", **opts)
    finally:
        torch.set_num_threads(threads)
    assert first.worker["rank"] == 1 and first.worker["world"] == 2 and not first.complete
    assert second.worker["rank"] == 0 and second.complete
    made = [sum(n.samples["produced"] for n in res.nodes if n.stage == "hidden_states") for res in (first, second)]
    assert made == [first.worker["my_prompts"], second.worker["my_prompts"]] and sum(made) == N
    assert _states(_open(store)) == reference
    with pytest.raises(Exception, match="--shard '2/2'|2/2"):
        api.run("hidden-states", shard="2/2", **opts)


def test_torchrun_ranks_share_mt_bench_second_turns(tmp_path, forks, tiny_target):
    """A multi-turn set under torchrun: the ranks share the first turns, meet, and share the
    second turns too (made from the stored answers), rather than rank 0 making them alone; the
    job's summary counts every turn's completion once."""
    from test_suites import MT_BENCH, cache_dataset

    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "HuggingFaceH4/mt_bench_prompts", None, {"train": MT_BENCH})
    store = tmp_path / "store"
    cmd = ["-m", "dfcache", "--store", str(store), "run", "completions", "--target", str(tiny_target),
           "--completions", "local", "--prompts", "suite:mt-bench", "--max-new-tokens", "4", "--device", "cpu",
           "--dtype", "float32", "--no-progress", "--json"]
    r = _run(_torchrun(2, CLIENT, *cmd), forks.env_for_workers, {"HF_DATASETS_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    (summary,) = [line for line in r.stdout.splitlines() if line.startswith("{")]
    out = json.loads(summary)
    assert out["worker"]["complete"]
    (row,) = [s["samples"] for s in json.loads(summary)["stages"] if s["stage"] == "completions"]
    assert (row["computed"], row["reused"]) == (4, 0)  # two first turns and two second turns, once each
    assert out["computed"] and set(out["computed"]) <= {n["key"] for n in out["nodes"]}  # the final graph's nodes name the work
    for rank in (0, 1):  # both ranks went on with the second turns (rank 1 used to stop after the first)
        assert f"[rank {rank}/2] prompts: the prompts of turn 2 of 2 multi-turn prompt(s)" in r.stderr, r.stderr
