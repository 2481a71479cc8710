"""Digests of the hidden states dfcache stores, to compare library versions bit for bit.

Run once per version (transformers 5.24 vs 5.25, say) on the same machine and compare the
printed digests::

    PYTHONUNBUFFERED=1 python bench/state_digest.py --out $OUT/digest.json        # fla on CUDA, 1.25 B
    python bench/state_digest.py --cpu-smoke --out /tmp/digest.json              # torch on the CPU, tiny

What it does, in one process, through the real hidden-states stage (``runner.stages.hidden_states``:
``load_target``, the kernel binding, the batch-shape check, CUDA graphs, the store) and a real
store in a temporary directory:

1. builds a Qwen3.5-style text model from a config (the shape of ``bench/gpu_extract.py``: by
   default hidden 2048, 16 layers of 3 gated-DeltaNet + 1 full attention, vocab 32000, about
   1.25 B parameters) and sets every parameter from a generator seeded by the parameter's name,
   not by transformers' initializers, which may change between versions; saves it in bf16. The
   digest of the weights (``weights_xxh3``) is printed, so two runs can be checked to have run
   the same weights;
2. writes a tokens artifact of ``--samples`` random sequences (numpy seed 1);
3. extracts ``--layers`` with ``--backend`` on ``--device`` and prints xxh3-64 of each layer's
   stored rows (the raw bf16 bits of every sample, in set order), per layer and per sample, and
   one digest of them all (``states_xxh3``).

Nothing may reach the network: every IPv4/IPv6 ``connect`` in the process is refused and recorded
under ``network_attempts`` (a hub-kernel fetch would show there), and the JSON records whether
the ``kernels`` package was imported, whether the model was kernelized (``use_kernels``), the
types of the modeling module's kernel functions after the run (plain functions expected) and any
kernel repositories in the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

T0 = time.perf_counter()
NETWORK_ATTEMPTS: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def block_network() -> None:
    """Refuse (and record) every IP connection of this process: nothing may be fetched."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            NETWORK_ATTEMPTS.append(repr(address))
            raise OSError(f"bench/state_digest.py refuses network connections (to {address!r})")

    def connect(self, address):
        check(self, address)
        return real_connect(self, address)

    def connect_ex(self, address):
        check(self, address)
        return real_connect_ex(self, address)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="state_digest.json")
    ap.add_argument("--work", default=None, help="temporary directory (default: a new one under $TMPDIR)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--layers", default="1,5,9,13", help="layer ids to extract")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--backend", default="fla", choices=("fla", "torch"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, torch backend on the CPU")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.hidden, args.num_layers, args.samples, args.seq_len = 128, 4, 3, 64
        args.vocab, args.batch_tokens, args.layers, args.backend, args.device = 512, 256, "1,3", "torch", "cpu"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    block_network()

    import numpy as np
    import torch
    import xxhash

    from dfcache import fingerprint_path, open_store
    from dfcache.samples import SampleArray, SampleSink, record_digest
    from runner.core.graph import Node, RunCache, RunContext, TokensSpec, resolve
    from runner.models import target as target_mod
    from runner.core.options import EvalOptions
    from runner.core.pipeline import execute
    from runner.stages import hidden_states as hs
    from runner.stages import tokens as tokens_stage

    dev = args.device
    layers = sorted(int(x) for x in args.layers.split(","))
    res: dict = {"args": vars(args), "env": {"python": sys.version.split()[0],
                                             "versions": target_mod.library_versions(),
                                             "torch_cuda": torch.version.cuda,
                                             "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None}}
    work = Path(args.work or tempfile.mkdtemp(prefix="dfcache-state-digest-"))
    model_dir = work / "model"
    try:
        # ------------------------------------------------------------------ model
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

        from runner.models.tiny import qwen35_shape_config

        cfg = qwen35_shape_config(args.num_layers, args.hidden, args.vocab, args.seq_len)
        t = time.perf_counter()
        with torch.device(dev):
            model = Qwen3_5ForCausalLM(cfg)
        wh = xxhash.xxh3_64()
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                g = torch.Generator(device=dev).manual_seed(xxhash.xxh32_intdigest(name.encode()))
                v = torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32) * 0.02
                if "norm" in name:
                    v += 1.0
                p.copy_(v)
        model.to(torch.bfloat16)
        for name, p in sorted(model.state_dict().items()):
            wh.update(name.encode())
            wh.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        res["model"] = {"params": sum(p.numel() for p in model.parameters()), "hidden": args.hidden,
                        "layers": args.num_layers,
                        "layer_types": cfg.layer_types, "extracted_layers": layers,
                        "weights_xxh3": wh.hexdigest()}
        model.save_pretrained(str(model_dir))
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
        log(f"model: {res['model']['params'] / 1e9:.3f} B parameters, weights xxh3 {res['model']['weights_xxh3']} "
            f"({time.perf_counter() - t:.1f} s)")

        # ------------------------------------------------------------------ tokens
        store = open_store(work / "store")
        fp = fingerprint_path(model_dir)
        rng = np.random.default_rng(1)
        arrs = [rng.integers(3, args.vocab, args.seq_len).astype(np.int32) for _ in range(args.samples)]
        ups = [record_digest({"bench": "state_digest", "seed": 1, "i": i}) for i in range(args.samples)]
        tok = Node.make_samples("tokens", tokens_stage.VERSION,
                                inputs={"target": fp, "tokenizer": fp, "bench": "state_digest", "seed": 1},
                                upstream_samples=ups, ids=[str(i) for i in range(args.samples)], needs="cpu",
                                spec=TokensSpec(target_dir=str(model_dir)), label="tokens")
        with SampleSink(store, tok.partition, arrays={"ids": SampleArray((), "int32")}) as sink:
            for u, x in zip(ups, arrs):
                sink.add(u, {"ids": x}, {"prompt_len": 0, "completion_len": len(x), "finish_reason": "length",
                                         "tokens_source": "local", "eos_appended": False})
        res["tokens_xxh3"] = xxhash.xxh3_64(np.concatenate(arrs).tobytes()).hexdigest()

        # ------------------------------------------------------------------ extraction
        opts = EvalOptions(target=str(model_dir), layers=layers, backend=args.backend, device=dev,
                           dtype="bfloat16", batch_tokens=args.batch_tokens, progress=False)
        ctx = RunContext(store, opts, argv=["run", "hidden-states", "--backend", args.backend], cache=RunCache())
        nodes = hs.build(ctx, tok, layers)
        resolve(ctx, list(nodes.values()))
        t = time.perf_counter()
        execute(ctx, list(nodes.values()))
        dt = time.perf_counter() - t
        ntok = args.samples * args.seq_len
        res["extract"] = {"tokens": ntok, "seconds": round(dt, 3), "tok_per_s": round(ntok / dt, 1),
                          "note": "includes the target's load, fla's first-call autotuning and the CUDA-graph captures"}
        st = ctx.last_extract_stats
        if st is not None:
            res["extract"]["shape_checks"] = st.checks
            res["extract"]["extra"] = {k: v for k, v in st.extra.items() if k != "forward_gpu_ms"}
        log(f"extracted {ntok} tokens in {dt:.1f} s (load and warm-up included)")

        # ------------------------------------------------------------------ digests
        all_h = xxhash.xxh3_64()
        res["layers"] = {}
        for k in layers:
            node = nodes[k]
            per = []
            lh = xxhash.xxh3_64()
            for i in range(len(node.sample_keys)):
                raw = hs.read_layer(store, node, [i]).contiguous().view(torch.int16).numpy().tobytes()
                per.append(xxhash.xxh3_64(raw).hexdigest())
                lh.update(raw)
            rows = hs.read_layer(store, node, [0])
            res["layers"][str(k)] = {"xxh3": lh.hexdigest(), "per_sample": per, "kind": cfg.layer_types[k],
                                     "dtype": str(rows.dtype), "row_shape": list(rows.shape),
                                     "key": node.key}
            all_h.update(lh.digest())
            log(f"layer {k:>2} ({cfg.layer_types[k]}): xxh3 {lh.hexdigest()}")
        res["states_xxh3"] = all_h.hexdigest()

        # ------------------------------------------------------------------ what ran
        tm = next(iter(ctx.cache.targets.values()))
        mod = tm.modeling_module
        res["bound"] = tm.bound
        res["use_kernels"] = bool(getattr(tm.model, "use_kernels", False))
        res["modeling_functions"] = {
            attr: type(getattr(mod, attr)).__name__
            for (m, attr) in list(target_mod._ORIGINAL_WRAPPERS) + list(target_mod._HUB_ONLY_FUNCTIONS)
            if mod is not None and m == mod.__name__}
        res["modeling_functions_all_plain"] = all(inspect.isfunction(getattr(mod, a))
                                                  for a in res["modeling_functions"])
        res["kernels_imported"] = "kernels" in sys.modules
        hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
        hub = Path(os.environ.get("HF_HUB_CACHE") or hf_home / "hub")
        res["hf_cache_kernel_repos"] = sorted(p.name for p in hub.glob("*kernel*")) if hub.is_dir() else []
        res["network_attempts"] = NETWORK_ATTEMPTS
        log(f"states xxh3 {res['states_xxh3']}; bound {res['bound']}; use_kernels {res['use_kernels']}; "
            f"functions {res['modeling_functions']}; network attempts {len(NETWORK_ATTEMPTS)}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        res["seconds"] = round(time.perf_counter() - T0, 3)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
