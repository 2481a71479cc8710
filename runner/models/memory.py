"""How large the extraction's forwards may be, from the GPU memory free once the target is loaded.

Why: a 27B-shaped target holds 54 GB of bf16 weights on an 80 GB H100, which leaves about 25 GB
for a forward's activations, the CUDA graphs' memory pool and the allocator's slack. A batch size
fixed for an 8B target would run out of memory there. So the extraction sizes itself after the
model loads, says what it chose, and refuses (exit 6, with the figures) a set whose longest sample
cannot run at all, instead of crashing with an out-of-memory error halfway through.

The estimate is per token of one forward, from the model's config: the transient tensors of the
widest decoder layer (the MLP's gate, up and product rows, the attention or gated-DeltaNet
projections and convolution output, a few hidden-size rows: residual, norm, layer output), the
requested layers' outputs, which live until their copy to the host is done, and on linear-attention
layers fla's per-chunk recurrent states (float32, one [heads, key dim, value dim] state per
64-token chunk). The sum is multiplied by :data:`SAFETY` for what the estimate does not name
(kernel workspaces, fragmentation). CUDA graphs keep their own pool beside the eager forwards
(the first forward of a shape and the batch-shape checks run eagerly), so with graphs a batch
needs the working memory twice. Lanes (:mod:`runner.models.lanes`: forwards side by side on more
CUDA streams, each with its own graphs) get what the first lane leaves: each further lane holds
an eager working set and a graph pool of its own, so it runs only forwards of at most
``lane_tokens`` tokens, and lanes are on only where every sample fits one. Nothing here touches
torch: the free figure is passed in (``torch.cuda.mem_get_info`` plus what torch's allocator
holds unused, on CUDA), so the choice is testable on any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dfcache.errors import BadInputError

SAFETY = 1.5  # the estimate times this: kernel workspaces, allocator rounding and fragmentation
RESERVE_BYTES = 1 << 30  # kept free: cuBLAS/cuDNN workspaces, Triton autotuning's trial buffers
FLA_CHUNK = 64  # fla's chunked gated delta rule keeps one float32 state per chunk of this many tokens
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    """What the extraction chose, and from which figures (all bytes)."""

    free_bytes: int  # free for the extraction once the model is loaded
    per_token_bytes: int  # estimated working memory of one forward, per token (SAFETY included)
    longest_sample: int  # tokens
    requested_batch_tokens: int
    batch_tokens: int  # the cap actually used for batches of equal-length samples
    cuda_graphs: bool  # whether graphs may be captured (they need a second pool)
    lanes: int = 1  # CUDA streams running forwards side by side (1: one at a time)
    lane_tokens: int = 0  # the largest forward (tokens) the further lanes may run; 0 when lanes are off

    def describe(self) -> str:
        graphs = "on" if self.cuda_graphs else "off (no room for their pool)"
        if self.lanes > 1:
            graphs += f", {self.lanes} lanes for forwards of at most {self.lane_tokens} tokens"
        shrunk = "" if self.batch_tokens == self.requested_batch_tokens else \
            f" (asked {self.requested_batch_tokens}, shrunk to fit)"
        return (f"GPU memory: {self.free_bytes / GIB:.1f} GiB free after the model loaded, about "
                f"{self.per_token_bytes / 1024:.0f} KiB a token of a forward; batches of at most "
                f"{self.batch_tokens} tokens{shrunk}, CUDA graphs {graphs}")

    def to_dict(self) -> dict:
        return asdict(self)


def per_token_bytes(config, n_layers: int, dtype_bytes: int) -> int:
    """Estimated bytes a token of one forward needs (see the module docstring), SAFETY included.
    ``config`` is a transformers config (its ``text_config`` where it has one)."""
    c = getattr(config, "text_config", None) or config

    def get(name: str, default: int = 0) -> int:
        v = getattr(c, name, None)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else default

    H = get("hidden_size")
    inter = get("intermediate_size", 4 * H)
    heads, kv = get("num_attention_heads", 1), get("num_key_value_heads", get("num_attention_heads", 1))
    hd = get("head_dim", H // max(1, heads))
    attn = heads * hd * 2 + 2 * kv * hd + heads * hd  # q (+ output gate), k, v, attention output
    nk, nv = get("linear_num_key_heads"), get("linear_num_value_heads")
    dk, dv = get("linear_key_head_dim"), get("linear_value_head_dim")
    types = getattr(c, "layer_types", None) or []
    linear = "linear_attention" in types and nv > 0
    delta = 2 * (2 * nk * dk + nv * dv) + 2 * nv * dv if linear else 0  # qkv, its conv, z, core output
    states = nv * dk * dv * 4 // FLA_CHUNK if linear else 0  # float32 chunk states, per token
    elems = 3 * inter + max(attn, delta) + 4 * H + n_layers * H
    return int(SAFETY * (elems * dtype_bytes + states))


def plan(free_bytes: int, per_token: int, longest_sample: int, batch_tokens: int, *,
         cuda_graphs: bool = True, lanes: int = 1) -> MemoryPlan:
    """The batch cap, whether CUDA graphs fit and how many of ``lanes`` do; :class:`BadInputError`
    (exit 6) with the figures when the longest sample cannot run even alone and eagerly."""
    usable = max(0, int(free_bytes) - RESERVE_BYTES)
    eager_tokens = usable // max(1, per_token)
    if longest_sample > eager_tokens:
        need = longest_sample * per_token + RESERVE_BYTES
        raise BadInputError(
            f"hidden states: the longest sample ({longest_sample} tokens) needs about {need / GIB:.1f} GiB of GPU "
            f"memory for one forward ({per_token / 1024:.0f} KiB a token, {RESERVE_BYTES / GIB:.0f} GiB kept free), "
            f"but only {free_bytes / GIB:.1f} GiB is free once the model is loaded. Extract on a GPU with more "
            "memory (or free the other processes on this one), or make the samples shorter (--max-new-tokens, a shorter prompt set).")
    graphs = cuda_graphs and longest_sample <= eager_tokens // 2
    cap = eager_tokens // 2 if graphs else eager_tokens
    cap = int(max(1, min(batch_tokens, cap)))
    # further lanes: an eager working set and a graph pool each, from what the first lane leaves
    lane_tokens = (eager_tokens - 2 * cap) // (2 * (lanes - 1)) if graphs and lanes > 1 else 0
    n = lanes if lane_tokens >= longest_sample else 1
    return MemoryPlan(free_bytes=int(free_bytes), per_token_bytes=int(per_token), longest_sample=int(longest_sample),
                      requested_batch_tokens=int(batch_tokens), batch_tokens=cap, cuda_graphs=graphs,
                      lanes=n, lane_tokens=int(lane_tokens) if n > 1 else 0)


def free_gpu_bytes(device) -> int:
    """Free bytes on ``device`` for this process: the driver's free figure plus what torch's
    caching allocator holds but does not use."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
