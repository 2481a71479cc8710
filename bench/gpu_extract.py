"""GPU proof of hidden-state extraction: fla vs torch numerics, and throughput side by side.

Run on a CUDA machine (not in CI), from the repository root::

    PYTHONUNBUFFERED=1 python bench/gpu_extract.py --out $OUT/gpu_extract.json
    python bench/gpu_extract.py --cpu-smoke --out /tmp/smoke.json   # checks this script on a CPU box

What it does, in one process, through the real stage code (runner.stages.hidden_states) and a
real store in a temporary directory:

1. builds a Qwen3.5-style text model from a config with random weights (seed 0; default hidden
   2048, 16 layers of 3 gated-DeltaNet + 1 full attention, vocab 32000: about 1.25 B parameters,
   as in shared/reference/gpu-probe.md), saved in bf16 to a temporary model directory;
2. writes a tokens artifact of ``--samples`` random sequences of ``--seq-len`` tokens (equal
   lengths, so batches fill ``--batch-tokens``), plus a mixed-length set (``--mixed`` samples of
   distinct lengths, which run one sample per forward: the no-padding policy's worst case);
3. loads the target with ``--backend fla`` and warms it up (fla's first call compiles and
   autotunes Triton kernels, about a minute), then extracts ``--layers`` into the store and
   measures tokens/s committed to the store, against on the same batches: a bare forward that
   stops after the deepest layer (no copies, no store), a full forward with logits, and a naive
   loop (blocking ``.cpu()`` then one ``torch.save`` per sample, the SpecForge-style layout);
4. the same extraction with ``--backend torch`` (the PyTorch fallback, on the GPU);
5. ``dfcache.diff`` between the fla and torch artifacts of every layer;
6. exactness: stored (batched) fla rows against a one-sample forward and against a plain
   transformers forward (``hidden_states[k+1]``), as the share of bitwise-equal elements.

Every phase is guarded: a failing phase is recorded under ``errors`` and the rest still runs; the
JSON is rewritten after each phase, so a run cut short still leaves its results. ``--budget-s``
skips the optional phases (mixed lengths, naive loop, exactness) once that much time has passed.

Needs on the GPU machine, besides torch/transformers/triton: flash-linear-attention and fla-core,
zarr, numcodecs, donfig, crc32c (google-crc32c, the fallback, holds the GIL and slows the writer
threads), xxhash, typer, tqdm (carry wheels if missing).

JSON (``--out``): ``env`` (versions, GPU), ``model``, ``data``, ``throughput`` (list of rows
``{what, backend, tokens, seconds, tok_per_s, vs_bare}``), ``diff`` (per layer: rel_l2, max_abs,
cos_mean, cos_min, equal), ``exactness``, ``timings``, ``memory``, ``errors``; on CUDA also
``first_extraction`` (the one-time costs: shape checks, CUDA-graph captures, pinned buffers),
``extract_stats``, ``batch_sweep`` and ``pipeline_probe`` (``--probe``), ``profile``
(``--profile-samples``: torch.profiler without and with CUDA graphs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on sys.path, where its modules (read.py, write.py, ...)
# could shadow real ones: put the repository root there instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

T0 = time.perf_counter()
DEV = "cuda"


@contextlib.contextmanager
def env_set(name: str, value: str | None):
    """``os.environ[name] = value`` (None: unset) inside the block, as it was after."""
    old = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args), "env": {}, "model": {}, "data": {}, "throughput": [],
                          "diff": {}, "exactness": {}, "timings": {}, "memory": {}, "errors": []}

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        os.replace(tmp, out)

    def phase(self, name: str, fn, *, optional: bool = False):
        if optional and time.perf_counter() - T0 > self.args.budget_s:
            log(f"skip {name}: past --budget-s {self.args.budget_s}")
            self.res["errors"].append({"phase": name, "error": "skipped: time budget"})
            self.save()
            return None
        log(f"== {name}")
        t = time.perf_counter()
        try:
            return fn()
        except Exception as e:
            tb = traceback.format_exc()
            log(f"!! {name} failed: {type(e).__name__}: {e}\n{tb}")
            self.res["errors"].append({"phase": name, "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]})
            return None
        finally:
            self.res["timings"][name] = round(time.perf_counter() - t, 3)
            self.save()


def qwen36_27b_config(seq_len: int = 2048):
    """The Qwen3.5/3.6-27B text model's layout, from its published config.json (text_config):
    hidden 5120, MLP 17408, 64 layers of three gated-DeltaNet layers to one full-attention layer
    (full_attention_interval 4), 24 query / 4 key-value heads of 256 with an output gate and a
    quarter of the dimensions rotated (rope theta 1e7), gated DeltaNet with 16 key / 48 value heads
    of 128 and a 4-wide convolution, vocab 248320, untied embeddings. Weights are not part of it."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, attn_output_gate=True,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
        rms_norm_eps=1e-6, max_position_embeddings=max(262144, 2 * seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=248044, pad_token_id=None, tie_word_embeddings=False)


def forward_flops_per_token(cfg, deepest: int, seq_len: int) -> float:
    """Model FLOPs of one token of a forward that stops after layer ``deepest``: 2 x the weights
    of layers 0..deepest (every projection is a matmul), plus causal attention on full-attention
    layers (QK and PV: 2 x 2 x heads x head_dim x seq_len / 2) and the chunked gated delta rule on
    linear ones (per head and token: state read and update 2 x 2 x dk x dv, the 64-token chunk's
    intra terms 2 x 64 x (dk + dv)). The embedding lookup is free."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gate = 2 if getattr(cfg, "attn_output_gate", False) else 1
    nk, nv = getattr(cfg, "linear_num_key_heads", 0), getattr(cfg, "linear_num_value_heads", 0)
    dk, dv = getattr(cfg, "linear_key_head_dim", 0), getattr(cfg, "linear_value_head_dim", 0)
    mlp = 3 * H * inter
    total = 0.0
    for kind in cfg.layer_types[: deepest + 1]:
        if kind == "full_attention":
            w = H * heads * hd * gate + 2 * H * kv * hd + heads * hd * H
            total += 2 * (w + mlp) + 2 * heads * hd * seq_len
        else:
            w = H * (2 * nk * dk + nv * dv) + H * nv * dv + 2 * H * nv + nv * dv * H
            total += 2 * (w + mlp) + nv * (4 * dk * dv + 2 * 64 * (dk + dv))
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_extract.json")
    ap.add_argument("--work", default=None, help="temporary directory (default: a new one under $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--layers", default="1,5,9,13", help="layer ids to extract")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--mixed", type=int, default=16, help="samples of distinct lengths (0: skip)")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--skip-torch", action="store_true", help="skip the torch-backend extraction")
    ap.add_argument("--disk-gb", type=float, default=4.0,
                    help="GB written (with fsync) to measure the disk beside the extraction (0: skip)")
    ap.add_argument("--skip-packed", action="store_true", help="skip the packed (varlen) mixed-length runs")
    ap.add_argument("--skip-naive", action="store_true", help="skip the naive .cpu()+torch.save loop")
    ap.add_argument("--fp8", action="store_true",
                    help="also extract the equal-length set with --compression fp8-e4m3 (quantized on the GPU, "
                         "issue 33): its row against min(bare forward, disk at FP8's bytes per token)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--label", default="", help="model label in the rows (e.g. 8B-shaped)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--probe", action="store_true",
                    help="also sweep batch sizes (speed, bits) and take the pipeline apart (contention, variants)")
    ap.add_argument("--profile-samples", type=int, default=0,
                    help="profile a short extraction of this many samples, without and with CUDA graphs (0: skip)")
    ap.add_argument("--preset", choices=["qwen3.6-27b"], default=None,
                    help="qwen3.6-27b: the Qwen3.5/3.6-27B text layout from its published config (hidden 5120, 64 "
                         "layers, every 4th full attention, 24/4 heads of 256, gated DeltaNet 16/48 heads of 128, "
                         "MLP 17408, vocab 248320), random bf16 weights built on the GPU and never saved "
                         "(--in-memory), DFlash2 tap layers 5,19,33,47,61; torch backend, naive loop and the full "
                         "forward with logits skipped")
    ap.add_argument("--in-memory", action="store_true",
                    help="build the model on the GPU and hand it to the stage (config.json only on disk)")
    ap.add_argument("--skip-full", action="store_true", help="skip the full forward with logits")
    ap.add_argument("--write-threads", default="1,2,4,8",
                    help="DFCACHE_WRITE_THREADS values the store path alone is measured at ('' skips)")
    ap.add_argument("--write-threads-reps", type=int, default=3, help="runs of each --write-threads value")
    ap.add_argument("--lanes-reps", type=int, default=2,
                    help="extractions of the equal set with DFCACHE_CUDA_LANES=1 and =2 each, in turns (CUDA; 0: skip)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script on a CPU machine: tiny sizes, torch backend only, no GPU figures")
    ap.add_argument("--rows-from", default=None, metavar="JSON",
                    help="no measuring: rebuild the suite rows of an earlier run's JSON with this version's row "
                         "rules (its measured fields unchanged) and write it to --out")
    args = ap.parse_args()
    if args.rows_from:
        return rebuild_rows(args.rows_from, args.out)
    global DEV
    if args.preset == "qwen3.6-27b":
        args.hidden, args.num_layers, args.vocab = 5120, 64, 248320
        if args.layers == "1,5,9,13":
            args.layers = "5,19,33,47,61"
        args.in_memory = args.skip_torch = args.skip_naive = args.skip_full = True
        args.label = args.label or "27B-shaped (Qwen3.6-27B layout)"
    if args.cpu_smoke:
        DEV = "cpu"
        args.hidden, args.num_layers, args.samples, args.seq_len = 128, 4, 6, 64
        args.mixed, args.batch_tokens, args.layers = min(args.mixed, 4), 256, "1,3"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model directory only; never the network
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    b = Bench(args)

    # Preflight: name every missing package at once (the GPU image lacks some; carry wheels).
    import importlib.util

    needed = {"zarr": "zarr", "numcodecs": "numcodecs", "google_crc32c": "google-crc32c", "donfig": "donfig",
              "xxhash": "xxhash", "ml_dtypes": "ml_dtypes", "typer": "typer", "tqdm": "tqdm",
              "transformers": "transformers", "torch": "torch"}
    missing = [pip for mod, pip in needed.items() if importlib.util.find_spec(mod) is None]
    if "google-crc32c" in missing and importlib.util.find_spec("crc32c") is not None:
        missing.remove("google-crc32c")  # crc32c (releases the GIL) is the preferred one
    if not args.cpu_smoke:
        missing += [pip for mod, pip in (("fla", "flash-linear-attention fla-core"), ("triton", "triton"))
                    if importlib.util.find_spec(mod) is None]
    b.res["env"]["missing_packages"] = missing
    if missing:
        log(f"missing packages: {', '.join(missing)} (carry their wheels; see the module docstring)")
        if any(m in missing for m in ("zarr", "numcodecs", "google-crc32c", "donfig", "xxhash", "torch",
                                      "transformers")):
            b.res["errors"].append({"phase": "preflight", "error": f"missing packages: {', '.join(missing)}"})
            b.save()
            return 6

    import numpy as np
    import torch

    env = b.res["env"]
    from runner.models.target import library_versions

    env.update(python=sys.version.split()[0], versions=library_versions(), torch_cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available())
    if DEV == "cuda" and not torch.cuda.is_available():
        b.res["errors"].append({"phase": "env", "error": "no CUDA GPU visible to torch"})
        b.save()
        log("no CUDA GPU: nothing to measure")
        return 6
    env["gpu"] = torch.cuda.get_device_name(0) if DEV == "cuda" else None
    env["cpu_count"] = os.cpu_count()
    log(f"env: {env}")
    b.save()

    work = Path(args.work or tempfile.mkdtemp(prefix="dfcache-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, store_dir, naive_dir = work / "model", work / "store", work / "naive"
    layers = sorted(int(x) for x in args.layers.split(","))
    try:
        return run(b, np, torch, work, model_dir, store_dir, naive_dir, layers)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        b.res["timings"]["total"] = round(time.perf_counter() - T0, 3)
        b.save()
        log(f"wrote {args.out}")


def run(b: Bench, np, torch, work, model_dir, store_dir, naive_dir, layers) -> int:
    args = b.args
    from dfcache import fingerprint_path, open_store
    from runner.stages.hidden_states.extract import plan_windows
    from dataclasses import dataclass

    from runner.core.graph import Node, RunCache, RunContext, TokensSpec, resolve

    @dataclass
    class _BenchTokens(TokensSpec):
        """The tokens stage's spec plus the bench's own copy of the ids in position order."""
        offsets: object = None
        ids: object = None
    from runner.core.pipeline import execute
    from runner.models.target import resolve_kernel
    from runner.core.options import EvalOptions
    from runner.stages import hidden_states as hs

    # ------------------------------------------------------------------ model
    def build_model():
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

        from runner.models.tiny import qwen35_shape_config

        cfg = qwen36_27b_config(args.seq_len) if args.preset == "qwen3.6-27b" else \
            qwen35_shape_config(args.num_layers, args.hidden, args.vocab, args.seq_len)
        torch.manual_seed(0)
        t = time.perf_counter()
        if args.in_memory:
            # bf16 from the start: 27 B parameters in float32 would not fit the card
            cfg._attn_implementation = "sdpa"
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(DEV):
                    model = Qwen3_5ForCausalLM(cfg)
            finally:
                torch.set_default_dtype(old)
        else:
            with torch.device(DEV):
                model = Qwen3_5ForCausalLM(cfg)
            model.to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        built["cfg"] = cfg
        if args.in_memory:
            model_dir.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(str(model_dir))  # config.json only: the weights stay on the GPU
            built["model"] = model
        else:
            model.save_pretrained(str(model_dir))
        del model
        if DEV == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            b.res["memory"]["after_build"] = {"allocated_gb": torch.cuda.memory_allocated() / 1e9,
                                              "card_total_gb": torch.cuda.get_device_properties(0).total_memory / 1e9}
        b.res["model"] = {"params": n, "hidden": args.hidden, "layers": args.num_layers, "layer_types": cfg.layer_types,
                          "extracted_layers": layers, "in_memory": bool(args.in_memory), "build_s": time.perf_counter() - t,
                          "config": {k: getattr(cfg, k, None) for k in (
                              "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                              "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                              "linear_value_head_dim", "vocab_size")},
                          "extracted_kinds": [cfg.layer_types[k] for k in layers]}
        log(f"model: {n / 1e9:.2f} B parameters in {model_dir}")

    built: dict = {}
    b.phase("build_model", build_model)
    if not (model_dir / "config.json").exists():
        return 1
    store = open_store(store_dir)
    fp = fingerprint_path(model_dir)

    def write_tokens(name: str, lengths: list[int], seed: int) -> Node:
        """A tokens node whose samples have the tokens stage's names and layout (per sample)."""
        from dfcache.samples import SampleArray, SampleSink, record_digest
        from runner.stages import tokens as tokens_stage

        rng = np.random.default_rng(seed)
        arrs = [rng.integers(3, args.vocab, n).astype(np.int32) for n in lengths]
        ups = [record_digest({"bench": name, "seed": seed, "i": i}) for i in range(len(lengths))]
        node = Node.make_samples("tokens", tokens_stage.VERSION, inputs={"target": fp, "tokenizer": fp, "bench": name,
                                                                         "seed": seed},
                                 upstream_samples=ups, ids=[str(i) for i in range(len(lengths))], needs="cpu",
                                 spec=_BenchTokens(target_dir=str(model_dir)), label="tokens")
        with SampleSink(store, node.partition, arrays={"ids": SampleArray((), "int32")}) as sink:
            for u, x in zip(ups, arrs):
                sink.add(u, {"ids": x}, {"prompt_len": 0, "completion_len": len(x), "finish_reason": "length",
                                         "tokens_source": "local", "eos_appended": False})
        offsets = np.zeros(len(lengths) + 1, np.int64)
        offsets[1:] = np.cumsum(lengths)
        # in position order, for the bench's own forwards (the stage orders samples its own way)
        node.spec.offsets, node.spec.ids = offsets, np.concatenate(arrs)
        return node

    def read_rows(key: str, start: int, stop: int):
        """Rows [start, stop) of a plain artifact's ``hidden`` array (the bench's direct extractions)."""
        arr = store.open(key).array("hidden")
        raw = arr.read_raw(start, stop)
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16) if arr.dtype == "bfloat16" else torch.from_numpy(raw)

    equal = write_tokens("equal", [args.seq_len] * args.samples, 1)
    mixed = None
    if args.mixed:
        rng = np.random.default_rng(2)
        lens = sorted(set(int(x) for x in rng.integers(args.seq_len // 4, args.seq_len * 3 // 2, 4 * args.mixed)))
        lens = [int(x) for x in rng.permutation(lens)[: args.mixed]]
        mixed = write_tokens("mixed", lens, 2)
    b.res["data"] = {"equal": {"samples": args.samples, "seq_len": args.seq_len,
                               "tokens": int(equal.spec.offsets[-1])},
                     "mixed": None if mixed is None else {"samples": len(mixed.spec.offsets) - 1,
                                                          "tokens": int(mixed.spec.offsets[-1])},
                     "batch_tokens": args.batch_tokens}

    def ctx_for(kernel: str, compression: str = "none") -> RunContext:
        opts = EvalOptions(target=str(model_dir), layers=layers, backend=kernel, device=DEV,
                           dtype="bfloat16", batch_tokens=args.batch_tokens, progress=False, compression=compression)
        return RunContext(store, opts, argv=["run", "hidden-states", "--backend", kernel], cache=caches[kernel])

    def batches_of(tok: Node):
        offsets, ids = tok.spec.offsets, tok.spec.ids
        windows, _ = plan_windows(offsets, 0, args.batch_tokens)
        out = []
        for w in windows:
            for bt in w.batches:
                x = np.stack([ids[offsets[s]:offsets[s] + bt.length] for s in bt.samples]).astype(np.int64)
                out.append((bt, torch.from_numpy(x)))
        return out

    def row(what: str, kernel: str, tokens: int, seconds: float, bare: float | None = None) -> dict:
        r = {"what": what, "backend": kernel, "tokens": tokens, "seconds": round(seconds, 4),
             "tok_per_s": round(tokens / seconds, 1) if seconds > 0 else None}
        if bare:
            r["vs_bare"] = round(r["tok_per_s"] / bare, 3) if r["tok_per_s"] else None
        b.res["throughput"].append(r)
        log(f"{what:<34} {kernel:<6} {tokens:>9} tok {seconds:8.3f} s {r['tok_per_s'] or 0:>12,.0f} tok/s"
            + (f"  ({r['vs_bare']:.2f}x bare)" if bare and r.get("vs_bare") else ""))
        return r

    def sync() -> None:
        if DEV == "cuda":
            torch.cuda.synchronize()

    from bench.gpu_clocks import Clocks

    clocks = Clocks() if DEV == "cuda" else None  # the card's clocks beside each timed pass

    def marked(name: str | None) -> None:
        if clocks is not None:
            clocks.mark(name)
            b.res["clocks"] = clocks.summary()

    def bare_forward(target, batches, full: bool = False, mark: str | None = None, fwd=None) -> tuple[int, float]:
        sync()
        marked(mark)
        t = time.perf_counter()
        n = 0
        with torch.no_grad():
            for _, x in batches:
                x = x.to(DEV, non_blocking=True)
                if full:
                    target.rebind()
                    target.model(input_ids=x, use_cache=False)
                else:
                    (fwd or target.forward_layers)(x, layers)
                n += x.numel()
        sync()
        dt = time.perf_counter() - t
        marked(None)
        return n, dt

    keys: dict[str, dict[int, str]] = {}

    def lanes_bare(target, g, one, bare) -> None:
        """The same one-sample forwards replayed on two lanes side by side (runner.models.lanes),
        nothing else running: the ceiling of the extraction's lanes. The lanes' graphs and their
        pair check come from the first extraction (skipped where it left them unchecked)."""
        from runner.models.lanes import Lanes

        lanes = Lanes(target, g, 2, 1 << 62)
        shape = tuple(one[0][1].shape)
        if lanes.verdict(shape, layers) is not True:
            log(f"lanes: shape {shape} not checked side by side by the first extraction; no lanes row "
                f"({lanes.stats()})")
            return
        host = [x.numpy() for _, x in one]

        def launch(fwd, rows):
            return fwd(torch.from_numpy(rows).to(DEV, non_blocking=True), layers)

        sync()
        marked("one-sample CUDA-graph replays, 2 lanes")
        t = time.perf_counter()
        with torch.no_grad():
            for rows in host:
                lanes.forward(launch, rows, layers)
        sync()
        dt = time.perf_counter() - t
        marked(None)
        row(f"bare forward to layer {max(layers)} (equal), one sample per forward, CUDA-graph replays, 2 lanes",
            "fla" if "fla" in targets else "torch", sum(r.size for r in host), dt, bare)
        b.res["lanes_bare"] = lanes.stats()

    def lanes_ab(target, bare) -> None:
        """The extraction (runner.stages.hidden_states.extract, the stage's pipeline) of the equal set
        with $DFCACHE_CUDA_LANES=1 and =2, in turns (order rotating), in this process: what the
        second lane gives, and its pair check's verdicts."""
        import statistics

        offsets, ids = equal.spec.offsets, equal.spec.ids
        runs: dict[str, list[float]] = {"1": [], "2": []}
        extra = {}

        def rates() -> dict:
            return {n: [round(x, 1) for x in v] for n, v in runs.items()}
        for r in range(args.lanes_reps):
            if r and time.perf_counter() - T0 > args.budget_s:  # (2026-12-07: a 4th turn ran past the 470 s cap)
                log(f"lanes: {r} turn(s) each, past --budget-s {args.budget_s}")
                break
            for n in (("1", "2") if r % 2 == 0 else ("2", "1")):
                marked(f"dfcache extract (equal), {n} lane(s), run {r + 1}")
                with env_set("DFCACHE_CUDA_LANES", n):
                    st, dt, _ = direct_extract(target, offsets, ids, f"lanes-{n}-{r}")
                marked(None)
                runs[n].append(st.tokens / dt)
                extra[n] = {k: v for k, v in st.extra.items() if k != "forward_gpu_ms"}
                log(f"lanes {n}, run {r + 1}: {st.tokens / dt:,.0f} tok/s ({st.tokens / dt / bare:.3f}x bare); "
                    f"{extra[n].get('lanes')}")
                b.res["lanes_ab"] = {"tok_per_s": rates()}
                b.save()  # each turn's figure kept, whatever cuts the run short
        med = {n: statistics.median(v) for n, v in runs.items()}
        b.res["lanes_ab"] = {"tok_per_s": rates(),
                             "median": {n: round(v, 1) for n, v in med.items()},
                             "vs_bare": {n: round(v / bare, 3) for n, v in med.items()}, "stats": extra}
        for n in ("1", "2"):
            row(f"dfcache extract (equal), {n} lane{'s' if n == '2' else ''}, median of {len(runs[n])}",
                "fla" if "fla" in targets else "torch", int(offsets[-1]),
                int(offsets[-1]) / med[n], bare)

    def extraction(kernel: str, tok: Node, label: str, bare_rate: float | None, compression: str = "none") -> None:
        ctx = ctx_for(kernel, compression)
        nodes = hs.build(ctx, tok, layers)
        if args.in_memory:  # the weights are the loaded model's, on the GPU: no weight files to check
            for n in nodes.values():
                n.precheck = None
        resolve(ctx, list(nodes.values()))
        marked(f"dfcache extract ({label})")
        t = time.perf_counter()
        execute(ctx, list(nodes.values()))
        marked(None)
        # without the FP8-vs-bf16 error the stage prints after a lossy extraction (a host pass over both)
        dt = time.perf_counter() - t - ctx.last_lossy_check_s
        st = ctx.last_extract_stats
        row(f"dfcache extract ({label})", kernel, int(tok.spec.offsets[-1]), dt, bare_rate)
        if st:
            b.res.setdefault("extract_stats", {})[f"{kernel}/{label}"] = {
                "tokens": st.tokens, "batches": st.batches, "windows": st.windows, "wall_s": st.wall_s,
                "compute_loop_s": st.forward_s, "forward_gpu_s": st.forward_gpu_s, "writer_wait_s": st.writer_wait_s,
                "shape_checks": st.checks, **st.extra}
            log(f"extract stats {kernel}/{label}: "
                f"{ {k: v for k, v in b.res['extract_stats'][f'{kernel}/{label}'].items() if k != 'forward_gpu_ms'} }")
        keys.setdefault(f"{kernel}/{label}", {}).update(nodes)  # layer -> node
        b.save()  # the judged row and its statistics kept before the optional phases after it

    caches = {"fla": RunCache(), "torch": RunCache()}  # one loaded target per kernel, reused by every run
    targets: dict = {}

    def load(kernel: str):
        def go():
            backend = resolve_kernel(kernel, DEV, "bfloat16", "sdpa")
            t = time.perf_counter()
            ctx = ctx_for(kernel)
            if args.in_memory:
                from runner.models.target import _check_fla_importable, bind_target, read_model_info

                if kernel == "fla":
                    _check_fla_importable()
                # the model built on the GPU, bound with load_target's checks, where the stage finds it
                caches[kernel].targets[(str(model_dir), backend.label)] = bind_target(
                    built["model"], read_model_info(model_dir), backend)
            targets[kernel] = hs.get_target(ctx, str(model_dir), backend)
            b.res["env"].setdefault("bound", {})[kernel] = targets[kernel].bound
            # the binding's exact fused layers (runner/models/fused_layers.py) and why any were left out
            fused = {k: targets[kernel].provenance.get(k) for k in ("fused_layers", "fused_layers_skipped",
                                                                     "exact_overrides_skipped")}
            b.res["env"].setdefault("fused", {})[kernel] = fused
            log(f"{kernel}: loaded in {time.perf_counter() - t:.1f} s; bound {targets[kernel].bound}; fused {fused}")
            # Warm-up on every batch shape: fla compiles and autotunes its Triton kernels here.
            t = time.perf_counter()
            seen = set()
            for tok in (equal, mixed):
                if tok is None:
                    continue
                for bt, x in batches_of(tok):
                    shape = tuple(x.shape)
                    if shape in seen or (tok is mixed and len(seen) > 3):
                        continue
                    seen.add(shape)
                    target = targets[kernel]
                    target.forward_layers(x.to(DEV), layers)
                    if tok is equal:
                        # the batch-shape check may fall back to halves down to one sample: warm those too
                        n = x.shape[0] // 2
                        while n >= 1:
                            if (n, x.shape[1]) not in seen:
                                seen.add((n, x.shape[1]))
                                target.forward_layers(x[:n].to(DEV), layers)
                            n //= 2
            sync()
            b.res["timings"][f"warmup_{kernel}"] = round(time.perf_counter() - t, 3)
            log(f"{kernel}: warm-up {time.perf_counter() - t:.1f} s over shapes {sorted(seen)[:4]}")
        return go

    def measure(kernel: str):
        def go():
            target = targets[kernel]
            eb = batches_of(equal)
            n, dt = bare_forward(target, eb)  # a second pass, so clocks and caches are warm
            n, dt = bare_forward(target, eb, mark="bare forward (equal)")
            bare = row(f"bare forward to layer {max(layers)} (equal)", kernel, n, dt)["tok_per_s"]
            one = [(bt, x[i:i + 1]) for bt, x in eb for i in range(x.shape[0])]
            if any(x.shape[0] > 1 for _, x in eb):
                # The same samples one per forward: what the exact extraction runs wherever a batch
                # changes bits (every batch size at hidden 4096), so the judged ceiling's batching
                # gain and the pipeline's own cost can be told apart.
                n, dt = bare_forward(target, one, mark="bare forward (equal), one sample per forward")
                row(ONE_SAMPLE_BARE.format(layer=max(layers)), kernel, n, dt, bare)
            if DEV == "cuda" and kernel == "fla":
                b.phase("mfu", lambda: mfu(bare))
            if not args.skip_full:
                n, dt = bare_forward(target, eb, full=True)
                row("bare full forward + logits (equal)", kernel, n, dt, bare)
            if DEV == "cuda":
                # One-time costs per loaded target, like fla's autotuning above: the batch-shape checks,
                # the CUDA-graph captures and the pinned window buffers. A first extraction of three
                # batches pays them (timed and reported); the measured extraction is the steady state.
                per = max(1, args.batch_tokens // args.seq_len)
                m = min(args.samples, 3 * per)
                off = equal.spec.offsets[: m + 1]
                # with two lanes where lanes are measured (their graphs and pair check are one-time costs
                # too), whatever $DFCACHE_CUDA_LANES says for the judged row
                with env_set("DFCACHE_CUDA_LANES", "2") if args.lanes_reps else contextlib.nullcontext():
                    st, dt, _ = direct_extract(target, off, equal.spec.ids[: int(off[-1])], "first-in-process")
                r = row(f"dfcache extract, first in the process ({m} samples)", kernel, st.tokens, dt, bare)
                b.res["first_extraction"] = {"tok_per_s": r["tok_per_s"], "wall_s": dt, "shape_checks": st.checks,
                                             **{k: v for k, v in st.extra.items() if k != "forward_gpu_ms"}}
                log(f"first extraction: {b.res['first_extraction']}")
                # The one-sample forwards as the extraction replays them (its CUDA graphs, captured
                # by the first extraction), nothing beside them: the exact forward's own speed.
                import runner.stages.hidden_states.extract as rx

                g = rx._graphs_for(target)
                if g is not None:
                    r0 = g.replays
                    n, dt = bare_forward(target, one, mark="one-sample CUDA-graph replays", fwd=g)
                    if g.replays - r0 == len(one):
                        row(f"bare forward to layer {max(layers)} (equal), one sample per forward, CUDA-graph "
                            f"replays", kernel, n, dt, bare)
                    lanes_bare(target, g, one, bare)
            extraction(kernel, equal, "equal", bare)
            if DEV == "cuda" and args.lanes_reps:
                b.phase("lanes_ab", lambda: lanes_ab(target, bare), optional=True)
            # The bare forward again right after: did the card itself slow down over the runs?
            n, dt = bare_forward(target, eb, mark="bare forward (equal), after the extraction")
            row(f"bare forward to layer {max(layers)} (equal), after the extraction", kernel, n, dt, bare)
            if clocks is not None:
                log(f"the card's clocks by pass: {b.res.get('clocks')}")
            if args.fp8 and kernel == ("torch" if args.cpu_smoke else "fla"):
                extraction(kernel, equal, "equal, fp8-e4m3", bare, compression="fp8-e4m3")
            if mixed is not None:
                mb = batches_of(mixed)
                bare_forward(target, mb)  # new lengths may autotune once: keep that out of the timing
                n, dt = bare_forward(target, mb)
                mbare = row(f"bare forward to layer {max(layers)} (mixed)", kernel, n, dt)["tok_per_s"]
                b.phase(f"extract_mixed_{kernel}", lambda: extraction(kernel, mixed, "mixed", mbare), optional=True)
            return bare
        return go

    def naive(kernel: str, bare_rate: float | None):
        def go():
            target = targets[kernel]
            naive_dir.mkdir(parents=True, exist_ok=True)
            sync()
            t = time.perf_counter()
            n = 0
            for bt, x in batches_of(equal):
                outs = target.forward_layers(x.to(DEV), layers)
                for row_i, s in enumerate(bt.samples):
                    torch.save({k: outs[k][row_i].cpu() for k in layers}, naive_dir / f"{s}.pt")
                n += x.numel()
            dt = time.perf_counter() - t
            row("naive loop: .cpu() + torch.save/sample", kernel, n, dt, bare_rate)
            shutil.rmtree(naive_dir, ignore_errors=True)
        return go

    bytes_per_token = len(layers) * args.hidden * 2

    def mfu(bare_rate: float) -> None:
        """The bare forward's share of the card's measured bf16 peak: the best of square bf16
        matmuls (8192 and 16384) timed here, against the forward's model FLOPs per token."""
        best = {}
        for n in (8192, 16384):
            a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
            c = torch.empty_like(a)
            for _ in range(3):
                torch.mm(a, a, out=c)
            reps = 20 if n == 8192 else 4
            for _ in range(5):
                sync()
                t = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, a, out=c)
                sync()
                best[n] = max(best.get(n, 0.0), reps * 2 * n ** 3 / (time.perf_counter() - t))
            del a, c
        peak = max(best.values())
        fpt = forward_flops_per_token(built["cfg"], max(layers), args.seq_len)
        b.res["mfu"] = {"peak_bf16_tflops": peak / 1e12, "matmul_tflops": {str(k): v / 1e12 for k, v in best.items()},
                        "gflop_per_token": fpt / 1e9, "bare_tok_per_s": bare_rate,
                        "bare_tflops": bare_rate * fpt / 1e12, "mfu": bare_rate * fpt / peak}
        log(f"MFU: bare forward {bare_rate:,.0f} tok/s x {fpt / 1e9:.1f} GFLOP/token = {bare_rate * fpt / 1e12:.0f} "
            f"TFLOP/s = {100 * bare_rate * fpt / peak:.1f} % of the measured bf16 peak {peak / 1e12:.0f} TFLOP/s")

    def disk():
        """The disk's fsync'd write rate, beside the extraction: dd (conv=fdatasync) and one
        numpy.save of random bytes + fsync, GB/s of data; the faster one is the ceiling."""
        import subprocess

        n_gb = args.disk_gb
        f = work / "disk.bin"
        count = max(1, int(n_gb * 1e9 / (16 << 20)))
        t = time.perf_counter()
        cp = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fdatasync"],
                            capture_output=True, text=True)
        dd_s = time.perf_counter() - t
        dd_rate = count * (16 << 20) / dd_s / 1e9 if cp.returncode == 0 else None
        f.unlink(missing_ok=True)
        subprocess.run(["sync"])
        data = np.random.default_rng(0).integers(0, 1 << 16, size=int(n_gb * 1e9 / 2), dtype=np.uint16)
        t = time.perf_counter()
        with open(f, "wb") as fh:
            np.save(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        np_s = time.perf_counter() - t
        np_rate = data.nbytes / np_s / 1e9
        f.unlink(missing_ok=True)
        # Parallel fsync'd streams, as the store writes (a writer thread per layer, each chunk file
        # fsync'd): n threads each write n_gb/n of the random bytes into its own file in 16 MiB
        # pieces, then fsync it. The best stream count is the disk's ceiling for the extraction.
        from concurrent.futures import ThreadPoolExecutor

        raw = data.view(np.uint8)
        streams = {}
        for n_streams in (4, 8):
            part = len(raw) // n_streams

            def one(i, part=part):
                with open(work / f"disk{i}.bin", "wb") as fh:
                    for a in range(i * part, (i + 1) * part, 16 << 20):
                        fh.write(raw[a:min(a + (16 << 20), (i + 1) * part)])
                    fh.flush()
                    os.fsync(fh.fileno())

            subprocess.run(["sync"])
            t = time.perf_counter()
            with ThreadPoolExecutor(n_streams) as pool:
                list(pool.map(one, range(n_streams)))
            streams[n_streams] = part * n_streams / (time.perf_counter() - t) / 1e9
            for i in range(n_streams):
                (work / f"disk{i}.bin").unlink(missing_ok=True)
        del data, raw
        rate = max(r for r in (dd_rate, np_rate, *streams.values()) if r)
        b.res["disk"] = {"dd_fdatasync_gbps": dd_rate, "numpy_save_fsync_gbps": np_rate, "gb": n_gb,
                         "parallel_fsync_streams_gbps": streams,
                         "ceiling_gbps": rate, "bytes_per_token": bytes_per_token,
                         "ceiling_tok_per_s": rate * 1e9 / bytes_per_token}
        log(f"disk: dd {dd_rate or 0:.2f} GB/s, numpy.save+fsync {np_rate:.2f} GB/s, parallel fsync'd streams "
            f"{ {k: round(v, 2) for k, v in streams.items()} } GB/s -> "
            f"{rate * 1e9 / bytes_per_token:,.0f} tok/s at {bytes_per_token} B/token")

    class Fake:
        """Ready-made GPU tensors in place of the forward (same rows whatever the batch)."""
        device = torch.device(DEV)
        hidden_size = args.hidden
        torch_dtype = torch.bfloat16

        def __init__(self):
            g = torch.Generator(device=DEV).manual_seed(0)
            self.t = torch.randn((max(1, args.batch_tokens // args.seq_len), args.seq_len, args.hidden),
                                 device=DEV, generator=g).to(torch.bfloat16)

        def forward_layers(self, ids, want):
            return {k: self.t[: ids.shape[0], : ids.shape[1]] for k in want}

    class NoCheckpoint:
        """The sink's writer as the stage's (``_SegmentRows``): the pipeline's per-window checkpoint
        does nothing, the artifact is committed whole. Before 2026-12-07 this bench used resumable
        writers that checkpointed (drained, flushed, wrote progress) after every window, which
        the stage does not do since its segments (so the store-path phase measured another path)."""

        def checkpoint(self, state=None) -> None:
            pass

    def direct_extract(model, offsets, ids, tag: str, stage: str = "bench_direct", keep: bool = False):
        """runner.stages.hidden_states.extract.extract into fresh artifacts of ``layers`` (deleted after, unless
        ``keep``), written as the stage writes a segment: no checkpoints, the layers' commits side by side."""
        from concurrent.futures import ThreadPoolExecutor

        from runner.stages.hidden_states.extract import LayerSink, extract
        from dfcache import compute_key

        writers, sinks = [], []
        for k in layers:
            key = compute_key(stage, 1, {"layer": k, "tag": tag, "run": time.time()})
            w = store.writer(key, stage=stage, stage_version=1, inputs={"layer": k, "tag": tag})
            writers.append(w)
            sinks.append(LayerSink(layer=k, writer=NoCheckpoint(), array=w.create_array(
                "hidden", (int(offsets[-1]), args.hidden), "bfloat16")))
        sync()
        t = time.perf_counter()
        st = extract(model, ids, offsets, sinks, batch_tokens=args.batch_tokens)
        with ThreadPoolExecutor(len(writers)) as pool:
            list(pool.map(lambda w: w.commit(), writers))
        dt = time.perf_counter() - t
        if not keep:
            for w in writers:
                store.delete(w.key)
        return st, dt, [w.key for w in writers]

    def store_only():
        """The extraction pipeline (copies, window buffers, writer threads, store) with the
        forward replaced by ready-made GPU tensors: what the store path alone sustains."""
        offsets, ids = equal.spec.offsets, equal.spec.ids
        st, dt, _ = direct_extract(Fake(), offsets, ids, "store-only", stage="bench_store_only")
        r = row("store path only (no forward)", "none", st.tokens, dt)
        from dfcache.store._pools import write_threads

        b.res["store_only"] = {"tok_per_s": r["tok_per_s"], "gbps": st.tokens * bytes_per_token / dt / 1e9,
                               "writer_wait_s": st.writer_wait_s, "compute_loop_s": st.forward_s,
                               "write_threads": write_threads()}
        # The same store path by DFCACHE_WRITE_THREADS (chunk files of one layer's append written
        # at once; 1 = one after the other, the writer before 2026-12-06): the counts in turn,
        # the order rotating, medians (bench/write_threads.py does the same without a GPU).
        counts = [int(x) for x in args.write_threads.split(",") if x.strip()]
        if not counts:
            return
        # About 2 GB of rows a run (12 runs by default; the 27B preset's full set is 13 GB a run).
        m = max(1, min(args.samples, int(2e9 // (args.seq_len * bytes_per_token))))
        c_offsets, c_ids = offsets[: m + 1], ids[: int(offsets[m])]
        runs: dict[int, list[float]] = {n: [] for n in counts}
        for rep in range(args.write_threads_reps):
            k = rep % len(counts)
            for n in counts[k:] + counts[:k]:
                with env_set("DFCACHE_WRITE_THREADS", str(n)):
                    st_n, dt_n, _ = direct_extract(Fake(), c_offsets, c_ids, f"store-only-t{n}", stage="bench_store_only")
                runs[n].append(st_n.tokens / dt_n)
        import statistics

        curve = {str(n): round(statistics.median(v), 1) for n, v in runs.items()}
        b.res["store_only"]["by_write_threads"] = curve
        b.res["store_only"]["by_write_threads_runs"] = {str(n): [round(x, 1) for x in v] for n, v in runs.items()}
        b.res["store_only"]["by_write_threads_tokens"] = int(c_offsets[-1])
        log(f"store path alone by DFCACHE_WRITE_THREADS (tok/s, median of {args.write_threads_reps}, "
            f"{int(c_offsets[-1])} tokens a run): {curve}")

    def batch_sweep():
        """Bare forwards of the same samples in batches of 1, 2, 4, ... and whether each size gives
        sample 0 a one-sample forward's bits: what the extraction's batch-shape check decides on."""
        target = targets["fla" if "fla" in targets else "torch"]
        ids = equal.spec.ids
        L = args.seq_len
        per = max(1, args.batch_tokens // L)
        n = min(args.samples, 2 * per)
        x_all = torch.from_numpy(ids[: n * L].reshape(n, L).astype(np.int64))
        one = target.forward_layers(x_all[:1].to(DEV), layers)
        out = {}
        bsz = 1
        while bsz <= per:
            target.forward_layers(x_all[:bsz].to(DEV), layers)  # warm (autotune) outside the clock
            sync()
            t = time.perf_counter()
            for i in range(0, n - bsz + 1, bsz):
                target.forward_layers(x_all[i:i + bsz].to(DEV), layers)
            sync()
            dt = time.perf_counter() - t
            got = target.forward_layers(x_all[:bsz].to(DEV), layers)
            eq = {str(k): (got[k][0].view(torch.int16) == one[k][0].view(torch.int16)).float().mean().item()
                  for k in layers}
            out[str(bsz)] = {"tok_per_s": round((n // bsz) * bsz * L / dt, 1), "bitwise_equal_to_one_sample": eq,
                             "min_equal": min(eq.values())}
            log(f"batch {bsz} x {L}: {out[str(bsz)]['tok_per_s']:,.0f} tok/s bare; sample 0 bitwise-equal to "
                f"a one-sample forward: min {min(eq.values()):.4f} over layers")
            del got
            bsz *= 2
        if DEV == "cuda":
            # the same one-sample forwards replayed as a CUDA graph (runner.models.graphs): the launch-free ceiling
            from runner.models.graphs import ForwardGraphs

            g = ForwardGraphs(target)
            for i in range(3):  # eager, then capture (+ check), then a replay
                g(x_all[i:i + 1].to(DEV), layers)
            sync()
            t = time.perf_counter()
            for i in range(n):
                g(x_all[i:i + 1].to(DEV), layers)
            sync()
            dt = time.perf_counter() - t
            got = g(x_all[:1].to(DEV), layers)
            eq = {str(k): (got[k][0].view(torch.int16) == one[k][0].view(torch.int16)).float().mean().item()
                  for k in layers}
            out["1 (CUDA graph)"] = {"tok_per_s": round(n * L / dt, 1), "bitwise_equal_to_one_sample": eq,
                                     "min_equal": min(eq.values()), "graphs": g.stats()}
            log(f"batch 1 x {L}, CUDA graph replay: {out['1 (CUDA graph)']['tok_per_s']:,.0f} tok/s bare; "
                f"bitwise-equal to an eager one-sample forward: min {min(eq.values()):.4f}; {g.stats()}")
            del g, got
        b.res["batch_sweep"] = out

    def pipeline_probe():
        """Where the extraction's time goes beside the bare forward, on the first 64 samples:
        the bare forward alone and beside the store path (ready tensors, in a thread), then the
        extraction with its defaults (CUDA graphs), without CUDA graphs (every kernel launched
        from Python, as before 2026-12-03 evening), and batched without the batch-shape check
        (not exact where the check refuses)."""
        import threading

        import runner.stages.hidden_states.extract as rx

        target = targets["fla" if "fla" in targets else "torch"]
        m = min(args.samples, 64)
        offsets = equal.spec.offsets[: m + 1]
        ids = equal.spec.ids[: int(offsets[-1])]
        eb = batches_of(equal)[: max(1, (m * args.seq_len) // args.batch_tokens)]
        out = {}
        n, alone = bare_forward(target, eb)
        big = np.concatenate([offsets, offsets[1:] + offsets[-1]])
        box = {}
        th = threading.Thread(target=lambda: box.update(r=direct_extract(Fake(), big, np.concatenate([ids, ids]), "bg")))
        th.start()
        n2, beside = bare_forward(target, eb)
        th.join()
        out["bare"] = {"tokens": n, "alone_s": alone, "beside_store_path_s": beside,
                       "store_path_s": box["r"][1] if "r" in box else None}
        log(f"probe: bare forward {alone:.3f} s alone, {beside:.3f} s beside the store path "
            f"({beside / alone:.3f}x)")
        variants = (("default", {}), ("no CUDA graphs", {"graphs": "0"}), ("batched, no shape check", {"trust": True}))
        for name, v in variants:
            old_t, old_sw = rx.WRITER_THREADS, sys.getswitchinterval()
            old_verdicts = dict(rx._verdicts(target))
            rx.WRITER_THREADS = v.get("threads", old_t)
            if v.get("switch"):
                sys.setswitchinterval(v["switch"])
            if v.get("trust"):
                rx._verdicts(target).update({(len(bt.samples), bt.length): True for bt, _ in eb})
            graphs = env_set("DFCACHE_CUDA_GRAPHS", v["graphs"]) if v.get("graphs") else contextlib.nullcontext()
            try:
                with graphs:
                    st, dt, _ = direct_extract(target, offsets, ids, name)
            finally:
                rx.WRITER_THREADS = old_t
                sys.setswitchinterval(old_sw)
                rx._verdicts(target).clear()
                rx._verdicts(target).update(old_verdicts)
            out[name] = {"tok_per_s": round(st.tokens / dt, 1), "wall_s": round(dt, 3), "compute_loop_s": st.forward_s,
                         "forward_gpu_s": st.forward_gpu_s, "writer_wait_s": st.writer_wait_s,
                         "vs_bare": round(alone / dt, 3), **st.extra}
            log(f"probe {name}: { {k: v for k, v in out[name].items() if k != 'forward_gpu_ms'} }")
        b.res["pipeline_probe"] = out

    def profile():
        """torch.profiler over a short extraction (the pipeline of runner.stages.hidden_states.extract
        on the first --profile-samples samples), without and with CUDA graphs: the GPU's kernel-busy
        share of the wall, the copies, and the top operators by CPU and by GPU time. Also counts the
        host synchronizations inside one eager forward (torch.cuda.set_sync_debug_mode)."""
        import warnings

        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile as tprofile

        target = targets["fla"]
        m = min(args.samples, args.profile_samples)
        offsets = equal.spec.offsets[: m + 1]
        ids = equal.spec.ids[: int(offsets[-1])]
        out = {"samples": m}
        x = torch.from_numpy(ids[: args.seq_len].astype(np.int64))[None].to(DEV)
        sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                target.forward_layers(x, layers)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        sync()
        syncs = [str(w.message)[:200] for w in caught if "called a synchronizing" in str(w.message)]
        out["syncs_in_one_eager_forward"] = {"count": len(syncs), "first": syncs[:3]}
        log(f"profile: {len(syncs)} host synchronization(s) inside one eager forward")

        def busy(intervals):
            total, end = 0.0, -1.0
            for a, z in sorted(intervals):
                if z > end:
                    total += z - max(a, end)
                    end = z
            return total / 1e6

        for name, env in (("no CUDA graphs", "0"), ("CUDA graphs", "1")):
            with env_set("DFCACHE_CUDA_GRAPHS", env), \
                    tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                st, dt, _ = direct_extract(target, offsets, ids, f"profile-{env}")
            ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            kern = [(e.time_range.start, e.time_range.end) for e in ev if not e.name.startswith(("Memcpy", "Memset"))]
            copies = [(e.time_range.start, e.time_range.end) for e in ev if e.name.startswith("Memcpy")]
            ka = prof.key_averages()
            tables = {}
            for key in ("self_cpu_time_total", "self_device_time_total", "self_cuda_time_total"):
                try:
                    tables[key] = ka.table(sort_by=key, row_limit=15, max_name_column_width=60)
                except Exception as e:  # the sort key's name moved between torch versions
                    tables[key] = f"{type(e).__name__}: {e}"
            first = min((a for a, _ in kern), default=0.0)
            last = max((z for _, z in kern), default=0.0)
            out[name] = {"wall_s": round(dt, 3), "tok_per_s": round(st.tokens / dt, 1),
                         "kernel_busy_s": round(busy(kern), 3), "kernels": len(kern),
                         "kernel_span_s": round((last - first) / 1e6, 3),
                         "copy_busy_s": round(busy(copies), 3), "compute_loop_s": st.forward_s,
                         "forward_gpu_s": st.forward_gpu_s, "extra": st.extra, "tables": tables}
            log(f"profile {name}: wall {dt:.2f} s, GPU kernels busy {out[name]['kernel_busy_s']:.2f} s over a span "
                f"of {out[name]['kernel_span_s']:.2f} s ({len(kern)} kernels), copies {out[name]['copy_busy_s']:.2f} s "
                f"(profiler on)")
        b.res["profile"] = out

    if args.disk_gb:
        b.phase("disk", disk)
        b.phase("store_only", store_only)

    def packed(kernel: str, mode: dict, label: str, equal_rate: float | None):
        """Mixed-length set packed into varlen forwards; stored under its own keys (another
        kernel class unless the exactness phase shows it bitwise equal)."""
        def go():
            from runner.stages.hidden_states.extract import LayerSink, extract
            from dfcache import compute_key

            target = targets[kernel]
            offsets, ids = mixed.spec.offsets, mixed.spec.ids
            # warm the packed shapes (fla autotunes per shape) outside the clock
            from runner.stages.hidden_states.extract import plan_windows
            from runner.models.packed import forward_layers_packed
            for w in plan_windows(offsets, 0, args.batch_tokens, pack=True)[0]:
                for bt in w.batches:
                    x = np.concatenate([ids[offsets[s]:offsets[s + 1]] for s in bt.samples]).astype(np.int64)
                    forward_layers_packed(target, torch.from_numpy(x)[None].to(DEV), bt.lengths, layers, **mode)
            sync()
            writers, sinks = [], []
            for k in layers:
                key = compute_key("hidden_states_packed_bench", 1, {"layer": k, "mode": mode, "kernel": kernel,
                                                                    "tokens": mixed.key})
                w = store.writer(key, stage="hidden_states_packed_bench", stage_version=1,
                                 inputs={"layer": k, "mode": mode}, resumable=True)
                writers.append(w)
                sinks.append(LayerSink(layer=k, writer=w, array=w.create_array(
                    "hidden", (int(offsets[-1]), args.hidden), "bfloat16")))
            t = time.perf_counter()
            st = extract(target, ids, offsets, sinks, batch_tokens=args.batch_tokens, pack=mode)
            for w in writers:
                w.commit()
            dt = time.perf_counter() - t
            r = row(f"dfcache extract (mixed, packed {label})", kernel, st.tokens, dt, None)
            r["vs_equal_extract"] = round(r["tok_per_s"] / equal_rate, 3) if equal_rate else None
            keys[f"{kernel}/packed-{label}"] = {k: w.key for k, w in zip(layers, writers)}
            # exactness against one-sample forwards, a few samples
            share = {}
            for s in range(min(4, len(offsets) - 1)):
                x = torch.from_numpy(ids[offsets[s]:offsets[s + 1]].astype(np.int64))[None].to(DEV)
                one = target.forward_layers(x, layers)
                for k in layers:
                    stored = read_rows(keys[f"{kernel}/packed-{label}"][k], int(offsets[s]), int(offsets[s + 1]))
                    o = one[k][0].cpu()
                    eq = (stored.view(torch.int16) == o.view(torch.int16)).float().mean().item()
                    rel = ((stored.float() - o.float()).norm() / o.float().norm()).item()
                    share[f"sample{s}/layer{k}"] = {"bitwise_equal": eq, "rel_l2": rel}
            b.res.setdefault("packed", {})[f"{kernel}/{label}"] = {
                "mode": mode, "tok_per_s": r["tok_per_s"], "vs_equal_extract": r["vs_equal_extract"],
                "exactness": share, "batches": st.batches,
                "min_bitwise_equal": min(v["bitwise_equal"] for v in share.values()),
                "max_rel_l2": max(v["rel_l2"] for v in share.values())}
            log(f"packed {label}: {r['tok_per_s']:,.0f} tok/s = {r['vs_equal_extract']}x equal-length extraction; "
                f"bitwise-equal share min {b.res['packed'][f'{kernel}/{label}']['min_bitwise_equal']:.4f}, "
                f"rel L2 max {b.res['packed'][f'{kernel}/{label}']['max_rel_l2']:.2e}")
        return go

    if DEV == "cuda":
        b.phase("load_fla", load("fla"))
        bare_fla = b.phase("measure_fla", measure("fla")) if "fla" in targets else None
        if "fla" in targets and args.probe:
            b.phase("batch_sweep", batch_sweep, optional=True)
            b.phase("pipeline_probe", pipeline_probe, optional=True)
        if "fla" in targets and args.profile_samples:
            b.phase("profile", profile, optional=True)
        if "fla" in targets and mixed is not None and not args.skip_packed:
            eq_rate = next((r["tok_per_s"] for r in b.res["throughput"]
                            if r["what"] == "dfcache extract (equal)" and r["backend"] == "fla"), None)
            b.phase("packed_varlen_fla", packed("fla", {"attention": "varlen", "delta": "varlen", "conv": "padded"},
                                                "varlen", eq_rate), optional=True)
            from runner.models import packed as _pk
            b.res["packed_kernel_choice"] = {str(k): v for k, v in _pk.KERNEL_CHOICE.items()}
            log(f"packed attention kernel choice: {b.res['packed_kernel_choice']}")
        if "fla" in targets and not args.skip_naive:
            b.phase("naive_fla", naive("fla", bare_fla), optional=True)
    if not args.skip_torch:
        b.phase("load_torch", load("torch"))
        if "torch" in targets:
            bare_torch = b.phase("measure_torch", measure("torch"))
            if DEV == "cpu" and args.probe:
                b.phase("batch_sweep", batch_sweep, optional=True)
                b.phase("pipeline_probe", pipeline_probe, optional=True)
            if DEV == "cpu":  # smoke: exercise the naive loop, packing and diff on the only backend there is
                b.phase("naive_torch", naive("torch", bare_torch), optional=True)
                if mixed is not None and not args.skip_packed:
                    b.phase("packed_torch", packed("torch", {"attention": "segments", "delta": "segments"},
                                                   "attn per sample", None), optional=True)

    def diffs():
        torch_keys = keys.get("torch/equal", {})
        # the CPU smoke run has no fla: compare torch with itself (exercises the code, reads 0)
        fla_keys = keys.get("fla/equal", {}) if DEV == "cuda" else torch_keys
        for k in layers:
            if k in fla_keys and k in torch_keys:
                a = hs.read_layer(store, fla_keys[k]).float()
                t = hs.read_layer(store, torch_keys[k]).float()
                cos = torch.nn.functional.cosine_similarity(a, t, dim=-1)
                d = {"rel_l2": ((a - t).norm() / t.norm().clamp_min(1e-30)).item(), "max_abs": (a - t).abs().max().item(),
                     "cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "equal": (a == t).float().mean().item(),
                     "equal_kind": "values"}
                b.res["diff"][str(k)] = d
                log(f"diff fla vs torch layer {k:>2}: rel L2 {d['rel_l2']:.4f}  max|d| {d['max_abs']:.3f}  "
                    f"cos mean {d['cos_mean']:.5f} min {d['cos_min']:.5f}  bitwise equal {100 * d['equal']:.1f}%")

    b.phase("diff_fla_vs_torch", diffs)

    def exactness():
        offsets, ids = equal.spec.offsets, equal.spec.ids
        for kernel, target in targets.items():
            out = {}
            for s in (0, args.samples - 1):
                x = torch.from_numpy(ids[offsets[s]:offsets[s + 1]].astype(np.int64))[None].to(DEV)
                one = target.forward_layers(x, layers)
                target.rebind()
                target.model.config.tie_last_hidden_states = False
                with torch.no_grad():
                    plain = target.model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
                for k in layers:
                    stored = hs.read_layer(store, keys[f"{kernel}/equal"][k], [s])
                    o = one[k][0].cpu()
                    p = plain[k + 1][0].cpu()
                    out[f"sample{s}/layer{k}"] = {
                        "stored_vs_one_sample_forward": (stored.view(torch.int16) == o.view(torch.int16)).float().mean().item(),
                        "stored_vs_plain_hf_forward": (stored.view(torch.int16) == p.view(torch.int16)).float().mean().item()}
            b.res["exactness"][kernel] = out
            worst = min(min(v.values()) for v in out.values())
            log(f"exactness {kernel}: min share of bitwise-equal elements, stored vs one-sample/plain forward: {worst:.4f}")

    b.phase("exactness", exactness, optional=True)
    b.res["memory"].update({"host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                            "gpu_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else None,
                            "gpu_peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if DEV == "cuda" else None,
                            "gpu_total_mb": torch.cuda.get_device_properties(0).total_memory / 2**20
                            if DEV == "cuda" else None})
    b.res["rows"] = suite_rows(b)
    print_table(b)
    return 0 if not [e for e in b.res["errors"] if not str(e.get("error", "")).startswith("skipped")] else 1


def rebuild_rows(src: str, out: str) -> int:
    """``--rows-from``: an earlier run's rows again, from its own measured fields (``args`` included)."""
    import types

    doc = json.loads(Path(src).read_text())
    doc["rows"] = suite_rows(types.SimpleNamespace(res=doc, args=types.SimpleNamespace(**doc["args"])))
    doc["rows_rebuilt"] = f"python3 bench/gpu_extract.py --rows-from {src} --out {out}"
    Path(out).write_text(json.dumps(doc, indent=1))
    print(f"{out}: {len(doc['rows'])} rows from {src}")
    return 0


ONE_SAMPLE_BARE = "bare forward to layer {layer} (equal), one sample per forward"
# (hidden, layers) -> the judged share of the physical limit; issue 36 item 2: "the 8B-shaped
# extraction >= 0.6 of the physical limit" (other shapes: the row is INFO)
PHYSICAL_TARGETS = {(4096, 36): 0.6}


def suite_rows(b: Bench) -> list[dict]:
    """Rows in the suite's format (bench/_common.Row), with targets, for ``python -m bench --gpu-json``."""
    res, rows = b.res, []
    gpu = (res.get("env") or {}).get("gpu") or "GPU"
    label = b.args.label or f"{(res.get('model') or {}).get('params', 0) / 1e9:.2f} B"
    tp = {(r["what"], r["backend"]): r for r in res["throughput"]}
    deepest = max(res["model"].get("extracted_layers") or [0]) if res.get("model") else 0
    bare = tp.get((f"bare forward to layer {deepest} (equal)", "fla"))
    ext = tp.get(("dfcache extract (equal)", "fla"))
    disk = res.get("disk") or {}

    def add(measure, dfc, comp, ratio, target=None, direction=">=", note=""):
        status = "INFO"
        if target is not None and ratio is not None:
            status = "PASS" if (ratio >= target if direction == ">=" else ratio <= target) else "FAIL"
        rows.append({"measure": measure, "dfcache": dfc, "competitor": comp, "ratio": ratio, "unit": "x",
                     "target": target, "direction": direction, "status": status, "note": note})

    st = (res.get("extract_stats") or {}).get("fla/equal") or {}
    clk = res.get("clocks") or {}
    first = res.get("first_extraction")
    if bare and ext and disk.get("ceiling_tok_per_s"):
        ceiling = min(bare["tok_per_s"], disk["ceiling_tok_per_s"])
        bound = "disk" if disk["ceiling_tok_per_s"] < bare["tok_per_s"] else "forward"
        add(f"{label}: fla extraction vs min(bare forward to layer {deepest}, fsync'd disk)",
            f"{ext['tok_per_s']:,.0f} tok/s", f"{ceiling:,.0f} tok/s ({bound}-bound)",
            round(ext["tok_per_s"] / ceiling, 3), 0.9,
            note=f"{gpu}; bare forward {bare['tok_per_s']:,.0f} tok/s; disk {disk['ceiling_gbps']:.2f} GB/s "
                 f"(dd {disk.get('dd_fdatasync_gbps') or 0:.2f}, numpy.save+fsync {disk['numpy_save_fsync_gbps']:.2f}, "
                 f"parallel fsync'd streams {disk.get('parallel_fsync_streams_gbps')}) "
                 f"= {disk['ceiling_tok_per_s']:,.0f} tok/s at {disk['bytes_per_token']} B/token; "
                 f"store path alone {(res.get('store_only') or {}).get('tok_per_s') or 0:,.0f} tok/s"
                 + (f" (by DFCACHE_WRITE_THREADS: {res['store_only']['by_write_threads']} tok/s)"
                    if (res.get("store_only") or {}).get("by_write_threads") else "")
                 + (f"; batch shapes used {st.get('batch_shapes')}, refused (change bits) {st.get('shapes_changing_bits')}; "
                    f"GPU time in forwards {st.get('forward_gpu_s', 0):.2f} s of {st.get('wall_s', 0):.2f} s"
                    if st.get("batch_shapes") is not None else "")
                 + (f"; CUDA graphs {st['cuda_graphs'].get('captured')}, {st['cuda_graphs'].get('replays')} replays"
                    + (f", refused {st['cuda_graphs'].get('refused')}" if st['cuda_graphs'].get('refused') else "")
                    if st.get("cuda_graphs") else "")
                 + (f"; {st['lanes']['lanes']} lanes, {st['lanes']['side_by_side']} forwards side by side, pair checks "
                    f"{st['lanes']['checked'] or 'from the first extraction'}" if st.get("lanes") else
                    "; one lane" if st.get("batch_shapes") is not None else "")
                 + (f"; SM clock median {clk['bare forward (equal)']['sm_mhz_median']} MHz bare, "
                    f"{clk['dfcache extract (equal)']['sm_mhz_median']} MHz extracting"
                    if all(k in clk for k in ("bare forward (equal)", "dfcache extract (equal)")) else "")
                 + (f"; after a first extraction in the process ({first['tok_per_s']:,.0f} tok/s, "
                    f"{first['shape_checks']} shape check(s), graphs captured {first.get('cuda_graphs', {}).get('captured')})"
                    if first else ""))
    one = tp.get((ONE_SAMPLE_BARE.format(layer=deepest), "fla"))
    if one and ext:
        add(f"{label}: fla extraction vs the bare forward one sample per forward (the batching an exact "
            f"extraction cannot use set aside)", f"{ext['tok_per_s']:,.0f} tok/s", f"{one['tok_per_s']:,.0f} tok/s",
            round(ext["tok_per_s"] / one["tok_per_s"], 3),
            note=f"{gpu}; batch shapes the extraction used {st.get('batch_shapes')}; the judged row's bare forward "
                 f"{bare['tok_per_s'] if bare else 0:,.0f} tok/s runs batches of up to {b.args.batch_tokens} tokens")
    if res.get("mfu"):
        m = res["mfu"]
        add(f"{label}: bare forward to layer {deepest}, share of the card's measured bf16 peak (MFU)",
            f"{m['bare_tflops']:.0f} TFLOP/s", f"{m['peak_bf16_tflops']:.0f} TFLOP/s", round(m["mfu"], 3),
            note=f"{gpu}; {m['gflop_per_token']:.1f} GFLOP/token (weights x 2 + attention + delta rule) at "
                 f"{m['bare_tok_per_s']:,.0f} tok/s; peak = best square bf16 matmul {m['matmul_tflops']}")
        if ext:
            limit = m["peak_bf16_tflops"] * 1e3 / m["gflop_per_token"]
            shape = ((res.get("model") or {}).get("hidden"), (res.get("model") or {}).get("layers"))
            add(f"{label}: fla extraction vs the physical limit (the card's measured bf16 peak / FLOP per token)",
                f"{ext['tok_per_s']:,.0f} tok/s", f"{limit:,.0f} tok/s", round(ext["tok_per_s"] / limit, 3),
                PHYSICAL_TARGETS.get(shape),
                note=f"{gpu}; {m['gflop_per_token']:.1f} GFLOP/token to layer {deepest}, peak {m['peak_bf16_tflops']:.0f} "
                     f"TFLOP/s measured in the same run (it moves by a few % between runs on one card)")
    mem = res.get("memory") or {}
    if mem.get("gpu_peak_allocated_mb"):
        plan = st.get("memory_plan") or {}
        add(f"{label}: peak GPU memory (allocated) vs the card", f"{mem['gpu_peak_allocated_mb'] / 1024:.1f} GiB",
            f"{mem['gpu_total_mb'] / 1024:.1f} GiB", round(mem["gpu_peak_allocated_mb"] / mem["gpu_total_mb"], 3),
            target=1.0, direction="<=",
            note=f"{gpu}; reserved peak {mem.get('gpu_peak_reserved_mb', 0) / 1024:.1f} GiB; weights "
                 f"{(mem.get('after_build') or {}).get('allocated_gb', 0):.1f} GB; the extraction's memory plan: "
                 + (f"{plan.get('free_bytes', 0) / 2**30:.1f} GiB free after the load, "
                    f"{plan.get('per_token_bytes', 0) / 1024:.0f} KiB/token, batches of <= {plan.get('batch_tokens')} "
                    f"tokens (asked {plan.get('requested_batch_tokens')}), CUDA graphs "
                    f"{'on' if plan.get('cuda_graphs') else 'off'}"
                    + (f", {plan['lanes']} lanes for forwards of <= {plan['lane_tokens']} tokens"
                       if plan.get("lanes", 1) > 1 else "") if plan else "not recorded"))
    ext8 = tp.get(("dfcache extract (equal, fp8-e4m3)", "fla"))
    if bare and ext8 and disk.get("ceiling_gbps"):
        fp8_bpt = len(res["model"].get("extracted_layers") or []) * (res["model"].get("hidden", 0) + 4)
        disk8 = disk["ceiling_gbps"] * 1e9 / fp8_bpt if fp8_bpt else float("inf")
        ceiling = min(bare["tok_per_s"], disk8)
        add(f"{label}: fla extraction with fp8-e4m3 (quantized on the GPU) vs min(bare forward, fsync'd disk)",
            f"{ext8['tok_per_s']:,.0f} tok/s", f"{ceiling:,.0f} tok/s ({'disk' if disk8 < bare['tok_per_s'] else 'forward'}-bound)",
            round(ext8["tok_per_s"] / ceiling, 3), 0.9,
            note=f"{gpu}; disk {disk['ceiling_gbps']:.2f} GB/s = {disk8:,.0f} tok/s at {fp8_bpt} B/token (FP8 codes + "
                 f"a float32 scale per token and layer); bf16 row {ext['tok_per_s'] if ext else 0:,.0f} tok/s")
    for name, pk in (res.get("packed") or {}).items():
        add(f"{label}: mixed lengths packed ({name.split('/', 1)[1]}) vs equal-length extraction",
            f"{pk['tok_per_s']:,.0f} tok/s", f"{ext['tok_per_s']:,.0f} tok/s" if ext else "",
            pk["vs_equal_extract"], 0.8,
            note=f"{gpu}; stored rows vs one-sample forwards: bitwise-equal share min {pk['min_bitwise_equal'] * 100:.2f} %, "
                 f"rel L2 max {pk['max_rel_l2']:.2g}" + ("" if pk["min_bitwise_equal"] == 1.0 else
                                                       " (not bitwise: a different kernel class, keyed apart)"))
    mixed_one = tp.get(("dfcache extract (mixed)", "fla"))
    if mixed_one and ext:
        add(f"{label}: mixed lengths one sample per forward vs equal-length extraction",
            f"{mixed_one['tok_per_s']:,.0f} tok/s", f"{ext['tok_per_s']:,.0f} tok/s",
            round(mixed_one["tok_per_s"] / ext["tok_per_s"], 3), note=f"{gpu}; the default (exact) batching")
    for r in res["throughput"]:
        add(f"{label}: {r['what']} [{r['backend']}]", f"{r['tok_per_s'] or 0:,.0f} tok/s",
            f"{r['tokens']} tokens in {r['seconds']} s", r.get("vs_bare"),
            note="ratio = tokens/s / bare forward to the deepest layer")
    sweep = res.get("batch_sweep") or {}
    one = (sweep.get("1") or {}).get("tok_per_s")
    for bsz, v in sweep.items():
        size, _, how = bsz.partition(" ")
        add(f"{label}: bare forward, batches of {size} x {b.args.seq_len} {how + ' ' if how else ''}[fla]",
            f"{v['tok_per_s']:,.0f} tok/s",
            f"sample 0 bitwise-equal to a one-sample forward: {v['min_equal'] * 100:.2f} %",
            round(v["tok_per_s"] / one, 3) if one else None,
            note="ratio = / batches of 1; the batch-shape check runs a shape only where its bits are 100 %")
    probe = res.get("pipeline_probe") or {}
    if probe.get("bare"):
        pb = probe["bare"]
        add(f"{label}: bare forward beside the store path (ready tensors, in a thread) vs alone",
            f"{pb['beside_store_path_s']:.3f} s", f"{pb['alone_s']:.3f} s",
            round(pb["alone_s"] / pb["beside_store_path_s"], 3), note=f"{pb['tokens']} tokens; host-side contention")
        for name, v in probe.items():
            if name != "bare":
                add(f"{label}: extraction variant: {name}", f"{v['tok_per_s']:,.0f} tok/s",
                    f"GPU time in forwards {v['forward_gpu_s']:.2f} s, compute loop {v['compute_loop_s']:.2f} s, "
                    f"wall {v['wall_s']:.2f} s", v["vs_bare"],
                    note=f"ratio = / the bare forward alone on the same {pb['tokens']} tokens; shapes {v.get('batch_shapes')}")
    prof = res.get("profile") or {}
    for name in ("no CUDA graphs", "CUDA graphs"):
        v = prof.get(name)
        if v:
            add(f"{label}: profiled extraction ({prof['samples']} samples), {name}: GPU kernels busy / wall",
                f"{v['kernel_busy_s']:.2f} s", f"{v['wall_s']:.2f} s", round(v["kernel_busy_s"] / v["wall_s"], 3),
                note=f"torch.profiler on; {v['kernels']} kernels over a span of {v['kernel_span_s']:.2f} s, copies "
                     f"{v['copy_busy_s']:.2f} s; host syncs in one eager forward: "
                     f"{(prof.get('syncs_in_one_eager_forward') or {}).get('count')}")
    for kernel, per in (res.get("exactness") or {}).items():
        if per:
            low = min(min(v.values()) for v in per.values())
            add(f"{label}: stored rows bitwise-equal to an unbatched forward [{kernel}]", f"{low * 100:.2f} %", "",
                None, note="lowest share over the checked samples and layers")
    for e in res.get("errors") or []:
        add(f"{label}: phase {e.get('phase')} failed or skipped", "", "", None, note=str(e.get("error"))[:200])
    return rows


def print_table(b: Bench) -> None:
    rows = b.res["throughput"]
    if not rows:
        return
    print("\nthroughput (tokens/s; vs_bare = / the bare forward to the deepest layer on the same batches)")
    print(f"{'what':<40} {'backend':<8} {'tokens':>9} {'seconds':>9} {'tok/s':>12} {'vs bare':>8}")
    for r in rows:
        vs = f"{r['vs_bare']:.2f}x" if r.get("vs_bare") else ""
        print(f"{r['what']:<40} {r['backend']:<8} {r['tokens']:>9} {r['seconds']:>9.3f} {r['tok_per_s'] or 0:>12,.0f} {vs:>8}")
    if b.res["diff"]:
        print("\nfla vs torch (same tokens, bf16, GPU)")
        print(f"{'layer':>5} {'rel L2':>9} {'max|d|':>8} {'cos mean':>9} {'cos min':>9} {'equal':>7}")
        for k, d in b.res["diff"].items():
            print(f"{k:>5} {d['rel_l2']:>9.4f} {d['max_abs']:>8.3f} {d['cos_mean']:>9.5f} {d['cos_min']:>9.5f} "
                  f"{100 * d['equal']:>6.1f}%")
    if b.res["errors"]:
        print(f"\n{len(b.res['errors'])} phase(s) failed or skipped: " +
              ", ".join(f"{e['phase']} ({e['error'][:80]})" for e in b.res["errors"]))


if __name__ == "__main__":
    sys.exit(main())
