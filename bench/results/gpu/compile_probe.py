"""Experiment (issue 36 item 2, not a bench row): is torch.compile's forward faster than the eager
one the exact extraction runs, and does it keep the stored rows' bits?

The 8B-shaped Qwen3.5 text target of the GPU benches (runner.models.tiny.qwen35_shape_config:
hidden 4096, three gated-DeltaNet layers to one full-attention layer), ``--layers`` of them
(per-layer cost; 8 by default), random bf16 weights built on the GPU, fla's kernels as installed.
One sample of ``--seq-len`` tokens per forward, as the exact extraction runs at hidden 4096.
Eager against ``torch.compile(model.model)`` (default mode, static shapes): CUDA-event time of a
forward (median of ``--reps``), and every layer's output hidden states compared bitwise.

    python3 bench/results/gpu/compile_probe.py [--layers 8] [--seq-len 2048] [--reps 20] [--out F]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--seq-len", type=int, default=2048)
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--out", default=None)
ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (torch kernels)")
ap.add_argument("--profile", action="store_true", help="print the eager forward's top ops by device time")
ap.add_argument("--copy-sites", action="store_true",
                help="with --profile: also the call sites (Python stacks) of the copies and casts, by device time")
ap.add_argument("--skip-compile", action="store_true")
ap.add_argument("--reference-conv", action="store_true",
                help="also time eager without the binding's fused Qwen3.5 layers (runner/models/fused_layers.py), "
                     "then also without its fused causal conv (transformers' PyTorch conv), and compare each "
                     "one's bits with the binding's")
ap.add_argument("--no-hooks", action="store_true",
                help="drop the binding's module hooks (its layer counter) before compiling: the counter's "
                     "int guard recompiled every call and hit dynamo's cache limit on an H100 (2026-12-07)")
args = ap.parse_args()
sys.path.insert(0, ".")
from runner.models.tiny import qwen35_shape_config  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402

cfg = qwen35_shape_config(args.layers, args.hidden, args.vocab, args.seq_len)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device(args.device):
    model = Qwen3_5ForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
# Bound as the stage binds it (fla's kernels for the gated-DeltaNet layers; load_target's checks).
from runner.models.target import _check_fla_importable, bind_target, read_model_info, resolve_kernel  # noqa: E402

model_dir = tempfile.mkdtemp(prefix="compile-probe-")
model.config.save_pretrained(model_dir)
KERNEL = "fla" if args.device == "cuda" else "torch"
if KERNEL == "fla":
    _check_fla_importable()
target = bind_target(model, read_model_info(model_dir), resolve_kernel(KERNEL, args.device, "bfloat16", "sdpa"))
bound = target.bound
print("bound:", bound, flush=True)
if args.reference_conv or target.overrides:  # the binding without its exact overrides (the fused causal conv)
    import importlib
    modeling = importlib.import_module(type(model.model).__module__)
    from runner.models.target import apply_binding  # noqa: E402
    fused_fns = dict(target.overrides)
ids = torch.randint(3, args.vocab, (1, args.seq_len), device=args.device,
                    generator=torch.Generator(args.device).manual_seed(1))
res = {"args": vars(args), "card": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
       "layer_types": cfg.layer_types, "bound": bound}
from runner.models.causal_conv import _CHECKED  # noqa: E402

res["fused_conv_check"] = {" / ".join(k): list(v) for k, v in _CHECKED.items()}
print("fused conv check:", res["fused_conv_check"], target.provenance.get("exact_overrides_skipped"), flush=True)


def states(fn):
    with torch.inference_mode():
        out = fn(input_ids=ids, output_hidden_states=True, use_cache=False)
    return [h.clone() for h in out.hidden_states]


def timed(fn, reps):
    ms = []
    with torch.inference_mode():
        for _ in range(3):
            fn(input_ids=ids, use_cache=False)
        for _ in range(reps):
            if args.device != "cuda":
                t0 = time.perf_counter()
                fn(input_ids=ids, use_cache=False)
                ms.append((time.perf_counter() - t0) * 1e3)
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(input_ids=ids, use_cache=False)
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
    return statistics.median(ms)


eager = model.model
ref = states(eager)
res["eager_ms"] = timed(eager, args.reps)
print(f"eager: {res['eager_ms']:.2f} ms a forward of {args.seq_len} tokens ({args.layers} layers)", flush=True)
if args.reference_conv:
    from runner.models.fused_layers import install, uninstall  # noqa: E402

    res["fused_layers"] = target.provenance.get("fused_layers")
    res["fused_layers_skipped"] = target.provenance.get("fused_layers_skipped")
    print("fused layers:", res["fused_layers"], res["fused_layers_skipped"], flush=True)
    steps = [("without the fused layers", lambda: uninstall(model))]
    if target.overrides:
        steps.append(("and transformers' PyTorch causal conv", lambda: apply_binding(modeling, KERNEL)))
    res["ab"] = []
    for what, undo in steps:
        undo()
        other = states(eager)
        ms = timed(eager, args.reps)
        equal = [bool(torch.equal(a.view(torch.int16), b.view(torch.int16))) for a, b in zip(ref, other)]
        res["ab"].append({"what": what, "ms": ms, "binding_speedup": ms / res["eager_ms"], "bitwise_equal": equal})
        print(f"eager {what}: {ms:.2f} ms (the binding {ms / res['eager_ms']:.3f}x faster); every layer's bits "
              f"equal to the binding's: {all(equal)}", flush=True)
    for name, fn in fused_fns.items():  # back to the binding as it was
        setattr(modeling, name, fn)
    if args.device == "cuda":
        install(model, model.device)

if args.profile:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch.inference_mode(), profile(activities=acts) as prof:
        for _ in range(3):
            eager(input_ids=ids, use_cache=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
    print(table, flush=True)
    res["profile"] = table
    if args.copy_sites:
        with torch.inference_mode(), profile(activities=acts, with_stack=True) as prof:
            eager(input_ids=ids, use_cache=False)
            if args.device == "cuda":
                torch.cuda.synchronize()
        # torch 2.13 records Python frames as events in the tree (FunctionEvent.stack stays empty):
        # each copy kernel's op is attributed to its nearest frames in runner/, transformers/ or fla/.
        agg = {}
        for ev in prof.events():
            if ev.name != "aten::copy_":
                continue
            chain, p = [], ev.cpu_parent
            while p is not None:
                if ".py(" in p.name and any(k in p.name for k in ("runner/", "transformers/", "fla/")):
                    chain.append(p.name.split("site-packages/")[-1])
                elif p.name.startswith("aten::") and not chain:
                    chain.append(p.name)
                p = p.cpu_parent
            # torch 2.11 (the device image) keeps the frames in FunctionEvent.stack instead
            frames = [f.split("site-packages/")[-1] for f in (getattr(ev, "stack", None) or [])
                      if any(k in f for k in ("runner/", "transformers/", "fla/"))]
            key = " <- ".join((chain[:1] + frames[:3]) if frames and len(chain) < 2 else chain[:4])
            t = ev.self_device_time_total if args.device == "cuda" else ev.self_cpu_time_total
            n, t0 = agg.get(key, (0, 0.0))
            agg[key] = (n + 1, t0 + t)
        sites = sorted(((t, n, k) for k, (n, t) in agg.items()), key=lambda r: -r[0])
        print("copy sites (aten::copy_ self time us, calls, ops and frames):", flush=True)
        for t, n, k in sites[:20]:
            print(f"  {t:9.1f} {n:4d} {k}")
        res["copy_sites"] = [{"self_us": t, "calls": n, "site": k} for t, n, k in sites]
if args.skip_compile:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(0)
if args.no_hooks:
    # Only the binding's own (runner.*); transformers collects output_hidden_states through hooks.
    for mod in model.modules():
        for hooks in (mod._forward_hooks, mod._forward_pre_hooks):
            for k in [k for k, h in hooks.items() if getattr(h, "__module__", "").startswith("runner.")]:
                del hooks[k]
t = time.perf_counter()
compiled = torch.compile(model.model, dynamic=False)
try:
    got = states(compiled)
    res["compile_s"] = time.perf_counter() - t
    res["compiled_ms"] = timed(compiled, args.reps)
    res["speedup"] = res["eager_ms"] / res["compiled_ms"]
    res["layers"] = [{"layer": i, "bitwise_equal_share": (g == r).float().mean().item(),
                      "max_abs_diff": (g.float() - r.float()).abs().max().item()} for i, (g, r) in enumerate(zip(got, ref))]
    print(f"compiled: {res['compiled_ms']:.2f} ms ({res['speedup']:.3f}x), compile {res['compile_s']:.0f} s", flush=True)
    for row in res["layers"]:
        print(f"  hidden_states[{row['layer']}]: bitwise equal {row['bitwise_equal_share'] * 100:.2f} %, "
              f"max |diff| {row['max_abs_diff']:.3g}")
except Exception as e:  # a compile failure is a result too
    res["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    print("compile failed:", res["error"][:500])
if args.out:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
