"""`write`: hidden-state write throughput, dfcache store vs numpy.save, safetensors and the
SpecForge per-sample layout.

Every writer makes its bytes durable before the clock stops: dfcache's commit always fsyncs
every file and the directory, so numpy.save, safetensors and the SpecForge files are fsynced
too (file, then directory). Throughput is hidden-state bytes / seconds; dfcache and SpecForge
also write the token ids and loss mask (0.2 % more bytes, counted against them).
Data: N(0,1) rounded to bf16, width 4096 per token, samples of 256-2048 tokens.
"""

from __future__ import annotations

import itertools
import os
import time


from ._common import (Ctx, Result, Row, alternate, clock, fsync_path, gbps, med, profile_top, rmtree,
                      summary)
from ._data import make_hidden, numpy_save, specforge_samples, specforge_write

NAME = "write"
BASE_BYTES = 256 * 10**6


def _dfcache_write(store, key: str, h, *, codec: str, stream: bool) -> None:
    with store.writer(key, stage="hidden_states", stage_version=1, inputs={"bench": key}) as w:
        if stream:
            aw = w.create_array("hidden_states", h.states.shape, "bfloat16", codec=codec)
            off = h.offsets
            for i in range(len(h.lengths)):
                aw.append(h.states[off[i]:off[i + 1]])
        else:
            w.write_array("hidden_states", h.states, dtype="bfloat16", codec=codec)
        w.write_array("input_ids", h.input_ids)
        w.write_array("loss_mask", h.loss_mask)
        w.write_array("sample_offsets", h.offsets)


def breakdown(h, root, reps: int = 3) -> dict:
    """Where the time of an uncompressed dfcache write goes, piece by piece, with the store's own
    chunk functions, beside numpy.save split the same way (write, then fsync)."""
    from dfcache.store import format as S

    rows = S.default_chunk_rows(h.states.shape, "bfloat16")
    chunks = [h.states[i:i + rows] for i in range(0, h.tokens, rows)]
    out: dict[str, list[float]] = {k: [] for k in (
        "xxh3_chunk_digests", "crc32c_encode_chunk", "write_chunk_files_no_fsync", "fsync_chunk_files",
        "numpy_save_no_fsync", "numpy_fsync")}
    for _ in range(reps):
        out["xxh3_chunk_digests"].append(clock(lambda: [S.chunk_digest(c) for c in chunks]))
        enc = []
        out["crc32c_encode_chunk"].append(clock(lambda: enc.extend(S.encode_chunk(c, "none") for c in chunks)))
        d = root / "bd"
        d.mkdir()
        paths = [d / f"c{i}" for i in range(len(chunks))]

        def write_files():
            for p, parts in zip(paths, enc):
                with open(p, "wb") as f:
                    for part in parts:
                        f.write(part)
        out["write_chunk_files_no_fsync"].append(clock(write_files))
        out["fsync_chunk_files"].append(clock(lambda: [fsync_path(p) for p in paths]))
        p = d / "h.npy"
        out["numpy_save_no_fsync"].append(clock(lambda: numpy_save(p, h.states, fsync=False)))
        out["numpy_fsync"].append(clock(lambda: fsync_path(p)))
        rmtree(d)
    res = {k: round(med(v), 4) for k, v in out.items()}
    res["chunk_rows"] = rows
    res["chunks"] = len(chunks)
    res["bytes"] = h.nbytes
    return res


def run(ctx: Ctx) -> Result:
    import torch
    from safetensors.torch import save_file

    from dfcache.keys import compute_key
    from dfcache.store import open_store

    reps = ctx.reps_or(5 if ctx.factor <= 1 else 3)
    nbytes = int(BASE_BYTES * ctx.factor)
    ctx.log(f"making {nbytes / 1e6:.0f} MB of bf16 hidden states")
    h = make_hidden(nbytes)
    samples = specforge_samples(h)
    states_bf16 = torch.from_numpy(h.states).view(torch.bfloat16)
    root = ctx.tmpdir("write")
    store = open_store(root / "store")
    counter = itertools.count()
    sizes: dict[str, int] = {}

    def c_numpy() -> float:
        d = root / "np"
        d.mkdir()
        t = clock(lambda: numpy_save(d / "h.npy", h.states))
        rmtree(d)
        return t

    def c_safetensors() -> float:
        d = root / "st"
        d.mkdir()

        def go():
            save_file({"hidden_states": states_bf16}, str(d / "h.safetensors"))
            fsync_path(d / "h.safetensors")
            fsync_path(d)
        t = clock(go)
        rmtree(d)
        return t

    def c_specforge() -> float:
        d = root / "sf"
        d.mkdir()
        t = clock(lambda: specforge_write(d, samples))
        rmtree(d)
        return t

    def c_dfcache(codec: str, stream: bool):
        def go() -> float:
            key = compute_key("bench_write", 1, {"n": next(counter)})
            t = clock(lambda: _dfcache_write(store, key, h, codec=codec, stream=stream))
            m = store.manifest(key)
            sizes[codec] = m.arrays["hidden_states"].nbytes if codec == "none" else sum(
                s for f, s in store.backend.list_files(key).items() if f.startswith("hidden_states/c/"))
            store.delete(key)
            return t
        return go

    contenders = {"numpy.save": c_numpy, "safetensors": c_safetensors, "specforge": c_specforge,
                  "dfcache": c_dfcache("none", False), "dfcache_append": c_dfcache("none", True),
                  "dfcache_zstd": c_dfcache("zstd", False)}
    ctx.log(f"{h.tokens} tokens x {h.states.shape[1]}, {len(h.lengths)} samples; {reps} reps alternating")
    times = alternate(contenders, reps, log=ctx.log)
    m = {k: med(v) for k, v in times.items()}

    ctx.log("breakdown of the dfcache write path")
    bd = breakdown(h, root)
    ctx.log("profiling one dfcache write (cProfile)")
    key = compute_key("bench_write", 1, {"n": "profile"})
    prof = profile_top(lambda: _dfcache_write(store, key, h, codec="none", stream=False))
    store.delete(key)
    rmtree(root)

    B = h.nbytes
    label = f"bf16 {B / 1e6:.0f} MB, fsync"
    rows = [
        Row(NAME, f"hidden states {label}: dfcache vs numpy.save", gbps(B, m["dfcache"]),
            gbps(B, m["numpy.save"]), m["numpy.save"] / m["dfcache"], target=0.8, direction=">=",
            note="throughput ratio"),
        Row(NAME, f"hidden states {label}: dfcache vs SpecForge (torch.save per sample)", gbps(B, m["dfcache"]),
            gbps(B, m["specforge"]), m["specforge"] / m["dfcache"], target=1.0, direction=">",
            note=f"{len(h.lengths)} samples"),
        Row(NAME, f"hidden states {label}: dfcache vs safetensors save_file", gbps(B, m["dfcache"]),
            gbps(B, m["safetensors"]), m["safetensors"] / m["dfcache"]),
        Row(NAME, f"hidden states {label}: dfcache append per sample vs numpy.save",
            gbps(B, m["dfcache_append"]), gbps(B, m["numpy.save"]), m["numpy.save"] / m["dfcache_append"]),
        Row(NAME, f"hidden states {label}: dfcache zstd vs numpy.save", gbps(B, m["dfcache_zstd"]),
            gbps(B, m["numpy.save"]), m["numpy.save"] / m["dfcache_zstd"],
            note=f"N(0,1) data; zstd size {B / max(1, sizes.get('zstd', B)):.3f}x smaller"),
    ]
    for r in rows:
        r.judge()
    return Result(rows, {"bytes": B, "tokens": h.tokens, "width": int(h.states.shape[1]),
                         "samples": len(h.lengths), "reps": reps, "fsync": "all writers",
                         "seconds": {k: summary(v) for k, v in times.items()},
                         "gbps": {k: round(B / v / 1e9, 3) for k, v in m.items()},
                         "breakdown_s": bd, "profile_dfcache_write": prof,
                         "load_avg": os.getloadavg(), "finished": time.strftime("%H:%M:%S")})
