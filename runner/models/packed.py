"""Packed (varlen) forwards: samples of different lengths in one forward, no padding.

Equal-length batching (``runner.stages.hidden_states.extract``) runs a set of distinct lengths
one sample per forward, which leaves a GPU mostly idle on short samples. Here the samples of a batch are concatenated
into one row of ``sum(lengths)`` tokens with cumulative boundaries ``cu_seqlens`` (the layout
flash-attention's varlen kernels and fla's ``cu_seqlens`` use), and every layer keeps them
apart:

* full-attention layers: FlashAttention-2's varlen forward (``aten::_flash_attention_forward``
  with ``cum_seq_q/k``), causal inside each sample; registered with transformers as the
  attention implementation ``dfcache_varlen`` and used only for the duration of the call;
* gated-DeltaNet layers: fla's chunked delta rule gets ``cu_seqlens`` (transformers passes
  ``cu_seq_lens_q`` on), and the short causal convolution runs per sample (the PyTorch
  fallback of ``causal_conv1d_fn`` ignores boundaries, which would leak the end of one sample
  into the start of the next);
* positions restart at 0 in each sample (RoPE).

Whether the rows equal a one-sample forward bit for bit depends on the kernels (GEMM shapes,
attention tiling): ``bench/gpu_extract.py`` measures it. Until it is shown equal on a machine,
packed states count as a different kernel class from equal-length batches, and extraction packs
only when asked to.
"""

from __future__ import annotations

from typing import Any, Sequence

from .target import FINAL, LayerCapture

ATTN_NAME = "dfcache_varlen"
MODES = ("segments", "varlen")

_registered = False
_mode = {"attention": "segments"}


def _bounds(kwargs) -> list[int]:
    return kwargs["_dfcache_bounds"]


# (heads, kv heads, head dim, dtype, device) -> the varlen kernel that gave the one-sample bits
KERNEL_CHOICE: dict[tuple, dict] = {}


def _flash_varlen(q, k, v, cu, mx, scaling):
    import torch

    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scaling)[0]


def _cudnn_varlen(q, k, v, cu, mx, scaling):
    import torch

    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # cuDNN's varlen path takes no GQA: give it the repeated heads SDPA would use
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False,
                                                   scale=scaling)[0]


VARLEN_KERNELS = {"flash": _flash_varlen, "cudnn": _cudnn_varlen}


def _choose_kernel(module, query, key, value, scaling, bounds) -> dict:
    """Once per head configuration: run the first sample through transformers' SDPA call (what
    a one-sample forward runs) and through each varlen kernel, and keep the first that gives the
    same bits (else FlashAttention-2, recorded as not bitwise)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sig = (query.shape[1], key.shape[1], query.shape[-1], str(query.dtype), str(query.device))
    if sig in KERNEL_CHOICE:
        return KERNEL_CHOICE[sig]
    a, b = bounds[0], bounds[1]
    ref = sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                 scaling=scaling)[0][0]
    cu = torch.tensor([0, b - a], dtype=torch.int32, device=query.device)
    tried = {}
    for name, fn in VARLEN_KERNELS.items():
        try:
            out = fn(query[0, :, a:b].transpose(0, 1), key[0, :, a:b].transpose(0, 1),
                     value[0, :, a:b].transpose(0, 1), cu, b - a, scaling)
        except Exception as e:  # an op this torch lacks, or a shape it refuses
            tried[name] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
            continue
        tried[name] = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean()) \
            if out.dtype == torch.bfloat16 else float((out == ref).float().mean())
    exact = [n for n, v in tried.items() if v == 1.0]
    usable = [n for n, v in tried.items() if not isinstance(v, str)]
    pick = exact[0] if exact else (usable[0] if usable else None)
    KERNEL_CHOICE[sig] = {"kernel": pick, "bitwise": bool(exact), "probe": tried}
    return KERNEL_CHOICE[sig]


def _varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs) -> tuple[Any, None]:
    """transformers attention interface for a packed row: query/key/value [1, heads, T, D].

    ``segments``: transformers' own SDPA call once per sample, exactly what a one-sample forward
    runs (same shapes, same kernel). ``varlen``: one varlen call over the row, with the kernel
    :func:`_choose_kernel` found to match the one-sample bits (CUDA only).
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _bounds(kwargs)
    if _mode["attention"] == "varlen" and query.is_cuda:
        choice = _choose_kernel(module, query, key, value, scaling, bounds)
        if choice["kernel"] is not None:
            cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
            mx = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            out = VARLEN_KERNELS[choice["kernel"]](query[0].transpose(0, 1), key[0].transpose(0, 1),
                                                   value[0].transpose(0, 1), cu, mx, scaling)
            return out[None], None                                      # [1, T, heads, D], like sdpa's
    parts = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                    dropout=dropout, scaling=scaling)[0]
             for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=1), None


def _padded_conv(original):
    """``causal_conv1d_fn`` over a packed row in one call: K-1 zeros before each sample (what the
    one-sample call pads with), one convolution, then each sample's outputs picked out."""
    import torch

    def run(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds = kwargs.pop("_dfcache_bounds", None)
        for k in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(k, None)
        if bounds is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        pad = weight.shape[-1] - 1
        n = len(bounds) - 1
        B, C, T = hidden_states.shape
        key = (tuple(bounds), pad, str(hidden_states.device))
        idx = _PAD_INDEX.get(key)
        if idx is None:
            src = torch.arange(T, device=hidden_states.device)
            seg = torch.bucketize(src, torch.tensor(bounds[1:], device=src.device), right=True)
            idx = src + (seg + 1) * pad                    # padded position of each real token
            _PAD_INDEX.clear()
            _PAD_INDEX[key] = idx
        xp = hidden_states.new_zeros((B, C, T + n * pad))
        xp[:, :, idx] = hidden_states
        out = original(xp, weight, bias, activation=activation)
        # the original pads K-1 zeros in front and keeps len(xp) outputs: output u ends at u
        return out[:, :, idx]

    return run


_PAD_INDEX: dict = {}


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _varlen_attention)
        _registered = True


def _per_sample(original, dim: int, n_positional: int, keywords: Sequence[str] = ()):
    """Wrap a sequence function so it runs once per sample of a packed row (same shapes as a
    one-sample forward, same bits) instead of across the boundaries: the first ``n_positional``
    positional arguments and the ``keywords`` arguments are cut along ``dim``, the outputs (or
    the first of a tuple) joined along it."""
    import torch

    def cut(v, a, b):
        return v.narrow(dim, a, b - a) if v is not None else v

    def run(*args, **kwargs):
        bounds = kwargs.pop("_dfcache_bounds", None)
        if bounds is None:
            return original(*args, **kwargs)
        for k in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(k, None)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            seg_args = [cut(v, a, b) if i < n_positional else v for i, v in enumerate(args)]
            seg_kw = {k: (cut(v, a, b) if k in keywords else v) for k, v in kwargs.items()}
            outs.append(original(*seg_args, **seg_kw))
        if isinstance(outs[0], tuple):
            return (torch.cat([o[0] for o in outs], dim=dim),) + tuple(outs[-1][1:])
        return torch.cat(outs, dim=dim)

    return run


def forward_layers_packed(target, input_ids, lengths: Sequence[int], layers, *, attention: str = "segments",
                          delta: str = "varlen", conv: str = "segments") -> dict:
    """Outputs of ``layers`` for samples concatenated in ``input_ids`` [1, sum(lengths)].

    Each output is [1, sum(lengths), H]; sample i's rows are ``[cu[i], cu[i+1])``. ``attention``
    and ``delta`` pick, for full-attention and gated-DeltaNet layers, ``segments`` (the
    one-sample call once per sample) or ``varlen`` (one call over the packed row: FlashAttention-2
    varlen on CUDA; fla's ``cu_seqlens``, fla kernels only). The short convolution runs per
    sample (``conv="segments"``) or once over the row with zeros between samples (``"padded"``).
    Positions restart at 0 in each sample. ``FINAL`` among ``layers``: every layer and the final
    norm run, and its entry is the base model's ``last_hidden_state`` (as ``forward_layers``).
    """
    import torch

    if attention not in MODES or delta not in MODES or conv not in ("segments", "padded"):
        raise ValueError(f"attention/delta must be one of {MODES}, conv segments|padded")
    conv_mode = conv
    _register()
    dev = input_ids.device
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    if tuple(input_ids.shape) != (1, bounds[-1]):
        raise ValueError(f"packed input_ids must be [1, {bounds[-1]}], got {tuple(input_ids.shape)}")
    cu = torch.tensor(bounds, dtype=torch.long, device=dev)
    pos = torch.cat([torch.arange(int(n), device=dev) for n in lengths])[None]
    module = target.modeling_module
    cfg = target.base.config
    final = FINAL in layers
    want = sorted(set(int(k) for k in layers if k != FINAL))
    capture = LayerCapture(target.layers, want, stop=not final)
    with capture as out:
        target.rebind()
        old_attn = cfg._attn_implementation
        patched: dict[str, Any] = {}
        if module is not None:
            conv = getattr(module, "causal_conv1d_fn", None)
            if conv is not None:
                patched["causal_conv1d_fn"] = conv
                module.causal_conv1d_fn = (_padded_conv(conv) if conv_mode == "padded"
                                           else _per_sample(conv, dim=2, n_positional=1))
            rule = getattr(module, "torch_chunk_gated_delta_rule", None)
            if rule is not None and (delta == "segments" or target.backend.kernel != "fla"):
                patched["torch_chunk_gated_delta_rule"] = rule
                module.torch_chunk_gated_delta_rule = _per_sample(rule, dim=1, n_positional=3,
                                                                  keywords=("g", "beta"))
        _mode["attention"] = attention
        try:
            cfg._attn_implementation = ATTN_NAME
            with torch.no_grad():
                res = target.base(input_ids=input_ids, position_ids=pos, use_cache=False,
                                  attention_mask={"full_attention": None, "linear_attention": None},
                                  cu_seq_lens_q=cu, _dfcache_bounds=bounds)
            if final:
                out[FINAL] = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        finally:
            cfg._attn_implementation = old_attn
            for name, fn in patched.items():
                setattr(module, name, fn)
    missing = capture.missing()
    if missing:
        raise RuntimeError(f"layers {missing} did not run in the packed forward")
    target.tokens_forwarded += bounds[-1]
    return out

