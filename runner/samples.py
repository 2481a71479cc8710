"""The samples of a selection (target, prompts, backend, layers) as stored: the one adapter.

Every reader of stored hidden states for training, export and benchmarks goes through
:class:`StoredSamples` (a :class:`dfcache.training.SampleSource`), so the storage layout is known
in one place. The layout is sample-granular (docs/format.md "Samples and segments"): each tokens
sample (array ``ids``, document with ``prompt_len``) and each layer's hidden-state sample (array
``hidden``) lives in some segment; a read opens only the chunks of that sample's rows.

What a sample yields (names and semantics of SpecForge's DFlash offline features):

* ``input_ids``  int64 ``[n]``: prompt (chat template applied) then completion ids;
* ``loss_mask``  int64 ``[n]``: 1 on the completion's tokens (positions ``prompt_len`` to ``n``,
  the stop token included when the completion ended on it), 0 on the prompt. SpecForge marks
  the assistant turns' tokens as its chat template delimits them; for a one-turn prompt and its
  completion that is the same set of positions;
* ``hidden_states`` bf16 (or the stored dtype) ``[n, len(layers) * hidden]``: the layers'
  states concatenated along the last axis in the order given (a DFlash drafter's
  ``target_layer_ids`` order), layer k being the output of decoder layer k (HF
  ``hidden_states[k+1]``).

Sample keys: ``xxh3_128(canonical({"hidden_states": [layer sample keys], "tokens": tokens sample
key}))``, built from the store's own per-sample keys: exactly what its bytes come from, and the
same for a prompt in any set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

import xxhash

from dfcache.errors import BadInputError, OfflineMissingError
from dfcache.keys import canonical_encode
from dfcache.training import Sample

from .options import EvalOptions

class StoredSamples:
    """:class:`dfcache.training.SampleSource` over stored tokens samples and per-layer samples.

    Holds the store's location and the sample keys, not a handle: each process opens the store
    on first read (a forked or spawned DataLoader worker reopens it).
    """

    def __init__(self, store_location: str, tokens_partition: str, tokens_keys: list[str],
                 layer_partitions: list[str], layer_sample_keys: list[list[str]], sample_ids: list[str], *,
                 layers: list[int] | None = None, endpoint_url: str | None = None, store=None) -> None:
        if not layer_partitions:
            raise BadInputError("no hidden-state layers selected: pass --layer or a drafter.")
        self.store_location = store_location
        self.endpoint_url = endpoint_url
        self.tokens_partition = tokens_partition
        self.tokens_keys = list(tokens_keys)
        self.layer_partitions = list(layer_partitions)
        self.layer_sample_keys = [list(k) for k in layer_sample_keys]
        self.layers = list(layers) if layers is not None else None
        self.sample_ids = list(sample_ids)
        self._pid: int | None = None
        self._handles: dict | None = None
        h = self._open(store)
        docs = h["tokens"].docs()
        self.prompt_lens = np.asarray([d["prompt_len"] for d in docs], dtype=np.int64)
        self._lengths = np.asarray([h["tokens"].rows(i, "ids") for i in range(len(docs))], dtype=np.int64)
        self.widths: list[int] = []
        self.dtype = None
        for ss in h["layers"]:
            seg, pos = ss.segment(0) if len(ss) else (None, 0)
            spec = seg.artifact.manifest.arrays["hidden"] if seg is not None else None
            if spec is None:
                continue
            if self.dtype not in (None, spec.dtype):
                raise BadInputError(f"the selected layers mix dtypes ({self.dtype}, {spec.dtype}); select "
                                    "layers extracted with one --dtype.")
            self.dtype = spec.dtype
            self.widths.append(int(spec.shape[1]))
        self._keys = [xxhash.xxh3_128_hexdigest(canonical_encode(
            {"hidden_states": [keys[i] for keys in self.layer_sample_keys], "tokens": t}))
            for i, t in enumerate(self.tokens_keys)]

    # Pickling (spawned DataLoader workers) carries the location and the keys only.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = None
        state["_pid"] = None
        return state

    def _store(self):
        from dfcache import open_store

        return open_store(self.store_location, create=False, endpoint_url=self.endpoint_url)

    def _open(self, store=None) -> dict:
        if self._handles is None or self._pid != os.getpid():  # a forked child reopens
            from dfcache.samples import SampleSet

            st = store if store is not None and self._handles is None and self._pid is None else self._store()
            self._handles = {"tokens": SampleSet(st, self.tokens_partition, self.tokens_keys),
                             "layers": [SampleSet(st, p, keys) for p, keys in
                                        zip(self.layer_partitions, self.layer_sample_keys)]}
            self._pid = os.getpid()
        return self._handles

    def __len__(self) -> int:
        return len(self.tokens_keys)

    def keys(self) -> list[str]:
        return list(self._keys)

    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    @property
    def offsets(self) -> np.ndarray:
        """Sample i's tokens would be rows offsets[i]:offsets[i+1] of the selection laid end to end."""
        out = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        out[1:] = np.cumsum(self._lengths)
        return out

    def read(self, index: int) -> Sample:
        ids = self.read_tokens(index)
        mask = np.zeros(len(ids), dtype=np.int64)
        mask[int(self.prompt_lens[index]):] = 1
        parts = self.read_layers(index)
        hidden = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return Sample(key=self._keys[index],
                      arrays={"input_ids": ids, "loss_mask": mask, "hidden_states": hidden},
                      dtypes={"input_ids": "int64", "loss_mask": "int64", "hidden_states": self.dtype})

    def read_tokens(self, index: int) -> np.ndarray:
        """One sample's token ids (int64)."""
        return self._open()["tokens"].read(index, "ids").astype(np.int64)

    def read_layers(self, index: int) -> list[np.ndarray]:
        """One sample's rows of each layer, separately (storage dtype: bf16 as uint16 bits)."""
        return [ss.read_raw(index, "hidden") for ss in self._open()["layers"]]


@dataclass
class Selection:
    """A resolved selection: the graph nodes and, once everything is cached, the stored keys."""

    store: object
    options: EvalOptions
    layers: list[int]  # concatenation order
    tokens_key: str
    layer_keys: list[str]
    target_dir: str
    num_layers: int
    hidden_size: int
    backend: dict
    nodes: list = field(default_factory=list)
    drafter_layers: list[int] | None = None

    tokens_node: object = None
    layer_nodes: list = field(default_factory=list)

    def identity(self) -> dict:
        """What the selection's bytes depend on (the set keys), for export manifests."""
        return {"tokens": self.tokens_key, "layers": self.layers, "hidden_states": self.layer_keys}

    def source(self) -> StoredSamples:
        st = self.store
        t = self.tokens_node
        return StoredSamples(st.url, t.partition.key, t.sample_keys, [n.partition.key for n in self.layer_nodes],
                             [n.sample_keys for n in self.layer_nodes], t.ids, layers=self.layers,
                             endpoint_url=self.options.endpoint_url, store=st)


def resolve_selection(opts: EvalOptions, *, store, layers: list[int] | None = None,
                      argv: list[str] | None = None, last_layer_last: bool = False) -> Selection:
    """The stored artifacts of a selection; raises OfflineMissingError (exit 3) if any is missing.

    Layers: ``layers``, else ``opts.layers`` (their order), else the first drafter's
    ``target_layer_ids``. ``last_layer_last``: the target's last layer is moved (or added) to the
    end, as speculators' layout wants.
    """
    from .graph import RunContext, resolve, topo_order
    from .models.target import read_model_info
    from .stages import completions, drafter_eval, hidden_states, prompts, tokens

    ctx = RunContext(store, opts, remotes=[], argv=argv or ["run", "hidden-states"])
    tok = tokens.build(ctx, completions.build(ctx, prompts.build(ctx)))
    drafter_layers = None
    if layers is None:
        if opts.layers:
            layers = list(dict.fromkeys(opts.layers))
        elif opts.drafters:
            refs = drafter_eval.resolve_drafters(ctx)
            drafter_layers = list(refs[0].target_layer_ids)
            layers = list(drafter_layers)
        else:
            raise BadInputError("no hidden-state layers selected: pass --drafter DIR (its "
                                "dflash_config.target_layer_ids) or --layer K (repeatable).")
    info = read_model_info(tok.payload["target_dir"])
    if last_layer_last:
        layers = [k for k in layers if k != info.num_layers - 1] + [info.num_layers - 1]
    nodes_by_layer = hidden_states.build(ctx, tok, sorted(set(layers)))
    nodes = resolve(ctx, topo_order(list(nodes_by_layer.values())))
    wanted = [tok] + [nodes_by_layer[k] for k in layers]
    missing = [n for n in wanted if len(n.local) != len(n.sample_keys)]
    if missing:
        cmd = "dfcache " + " ".join(_quote(a) for a in _run_args(ctx.argv, layers))
        lines = [f"{len(missing)} artifact(s) of the selection are not in {store.url}:"]
        lines += [f"  - {n.label or n.stage} {n.key}: {len(n.sample_keys) - len(n.local)} of {len(n.sample_keys)} "
                  "sample(s) missing" for n in missing]
        lines.append(f"Produce them first with: {cmd}")
        raise OfflineMissingError("\n".join(lines), missing=[n.to_plan_dict() for n in missing])
    hs0 = nodes_by_layer[layers[0]]
    return Selection(store=store, options=opts, layers=list(layers), tokens_key=tok.key,
                     layer_keys=[nodes_by_layer[k].key for k in layers], target_dir=tok.payload["target_dir"],
                     num_layers=info.num_layers, hidden_size=info.hidden_size, backend=hs0.inputs["backend"],
                     nodes=nodes, drafter_layers=drafter_layers, tokens_node=tok,
                     layer_nodes=[nodes_by_layer[k] for k in layers])


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _run_args(argv: list[str], layers: list[int]) -> list[str]:
    """``argv`` (global options, ``run TARGET``, options) as a `run hidden-states` line with explicit
    ``--layer``s: `run hidden-states` takes layers, and a drafter's are spelled out."""
    i = argv.index("run") if "run" in argv else 0
    head, tail = list(argv[:i]), list(argv[i + 2:] if "run" in argv else argv)
    drop = {"--drafter", "--layer", "--trained-on", "--tree-budget", "--max-blocks", "--end-rule", "--format",
            "--out"}
    out: list[str] = []
    skip = False
    for a in tail:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if not any(a.startswith(d + "=") for d in drop):
            out.append(a)
    return [*head, "run", "hidden-states", *out, *(x for k in layers for x in ("--layer", str(k)))]
