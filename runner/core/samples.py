"""The samples of a selection (target, prompts, backend, layers) as stored: the one adapter.

Every reader of stored hidden states for training, export and benchmarks goes through
:class:`StoredSamples` (a :class:`dfcache.training.SampleSource`), so the storage layout is known
in one place. The layout is sample-granular (docs/format.md "Samples and segments"): each tokens
sample (array ``ids``, document with ``prompt_len``) and each layer's hidden-state sample (array
``hidden``) lives in some segment; a read opens only the chunks of that sample's rows. Sets that
`dfcache import` brought in keep the set-level layout (one tokens artifact, one artifact per layer);
:class:`ArtifactSamples` reads those, with the same sample semantics.

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
same for a prompt in any set. (An imported set's keys cover its artifacts: see ArtifactSamples.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

import xxhash

from dfcache.errors import BadInputError, OfflineMissingError
from dfcache.fp8 import FP8_DTYPE, hidden_width
from dfcache.fp8 import dequantize as fp8_dequantize
from dfcache.fp8 import unpack as fp8_unpack
from dfcache.keys import canonical_encode, compute_key
from dfcache.training import Sample

from .options import EvalOptions

SAMPLE_KEY_VERSION = 1  # of ArtifactSamples' keys

class _SampleSource:
    """What both layouts' sample sources share: the store's location, not a handle (pickled for a
    spawned DataLoader worker, it carries no handle and the worker opens the store on first read),
    the layers' common dtype and widths, one key per sample, the pipeline's loss mask (prompt 0,
    completion 1) unless the tokens carry their own, and the :class:`Sample` an item is.

    :class:`StoredSamples` reads the sample-granular layout, :class:`ArtifactSamples` the set-level
    one; each adds only how its layout is opened and read."""

    store_location: str
    endpoint_url: str | None
    prompt_lens: np.ndarray
    _keys: list[str]

    def _init_location(self, store_location: str, endpoint_url: str | None, n_layers: int,
                       layers: list[int] | None) -> None:
        if not n_layers:
            raise BadInputError("no hidden-state layers selected: pass --layer or a drafter.")
        self.store_location = store_location
        self.endpoint_url = endpoint_url
        self.layers = list(layers) if layers is not None else None
        self._pid: int | None = None
        self._handles: dict | None = None
        self.widths: list[int] = []
        self.dtype = None

    def _add_layer(self, spec) -> None:
        """Take one layer's ``hidden`` array spec: its width, and its dtype, which all layers share."""
        if self.dtype not in (None, spec.dtype):
            raise BadInputError(f"the selected layers mix dtypes ({self.dtype}, {spec.dtype}); select "
                                "layers extracted with one --dtype.")
        self.dtype = spec.dtype
        self.widths.append(int(spec.shape[1]))

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def keys(self) -> list[str]:
        return list(self._keys)

    def _prompt_mask(self, index: int, n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=np.int64)
        mask[int(self.prompt_lens[index]):] = 1
        return mask

    def _sample(self, index: int, ids: np.ndarray, mask: np.ndarray, hidden: np.ndarray,
                tensors: dict | None = None) -> Sample:
        return Sample(key=self._keys[index],
                      arrays={"input_ids": ids, "loss_mask": mask, "hidden_states": hidden},
                      dtypes={"input_ids": "int64", "loss_mask": "int64", "hidden_states": self.dtype},
                      tensors=tensors if tensors is not None else {})

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = None
        state["_pid"] = None
        return state

    def _store(self):
        from dfcache import open_store

        return open_store(self.store_location, create=False, endpoint_url=self.endpoint_url)


class StoredSamples(_SampleSource):
    """:class:`dfcache.training.SampleSource` over stored tokens samples and per-layer samples.

    Holds the store's location and the sample keys; pickled (a spawned DataLoader worker) it
    carries no handle and the worker opens the store on first read. A *forked* worker of a local
    store keeps the parent's handles: they are read-only memory maps of chunk files whose crc32c
    the parent checked, valid in the child as they are, so workers neither re-map nor re-check
    what the parent read (a remote store is reopened: its clients are not fork-safe).

    Reads: every layer's chunk files of the sample that are not in the page cache are first set
    loading (all at once, so a cold read loads them in parallel), then each layer's rows are copied from
    the mapped chunks straight into its columns of the item (one copy). A chunk's crc32c is
    checked when this process tree first maps it (``ArrayReader.read_raw(mapped=True)``); a
    chunk file changed on disk after that (its signature differs) is checked again on its next
    read, in a worker as in the parent, and `dfcache verify` checks everything.
    """

    def __init__(self, store_location: str, tokens_partition: str, tokens_keys: list[str],
                 layer_partitions: list[str], layer_sample_keys: list[list[str]], sample_ids: list[str], *,
                 layers: list[int] | None = None, endpoint_url: str | None = None, store=None) -> None:
        self._init_location(store_location, endpoint_url, len(layer_partitions), layers)
        self.tokens_partition = tokens_partition
        self.tokens_keys = list(tokens_keys)
        self.layer_partitions = list(layer_partitions)
        self.layer_sample_keys = [list(k) for k in layer_sample_keys]
        self.sample_ids = list(sample_ids)
        self.concatenated: tuple[str, list[str]] | None = None  # (partition, sample keys): use_concatenated
        h = self._open(store)
        docs = h["tokens"].docs()
        self.prompt_lens = np.asarray([d["prompt_len"] for d in docs], dtype=np.int64)
        self._lengths = np.asarray([h["tokens"].rows(i, "ids") for i in range(len(docs))], dtype=np.int64)
        # Imported tokens carry the peer's own loss mask; the pipeline's is prompt 0, completion 1.
        self.has_loss_mask = bool(len(docs)) and "loss_mask" in h["tokens"].segment(0)[0].artifact.manifest.arrays
        self.fp8 = False  # FP8 layers (dfcache.fp8): read as codes + per-layer scales, the dataset dequantizes
        for ss in h["layers"]:
            seg, pos = ss.segment(0) if len(ss) else (None, 0)
            spec = seg.artifact.manifest.arrays["hidden"] if seg is not None else None
            if spec is not None:
                self._add_layer(spec)
        if self.dtype == FP8_DTYPE:
            self.fp8, self.widths = True, [hidden_width(w) for w in self.widths]
        self._keys = [xxhash.xxh3_128_hexdigest(canonical_encode(
            {"hidden_states": [keys[i] for keys in self.layer_sample_keys], "tokens": t}))
            for i, t in enumerate(self.tokens_keys)]

    def _open(self, store=None) -> dict:
        if self._handles is not None and self._pid != os.getpid() and self._handles.get("local"):
            self._pid = os.getpid()  # a forked worker of a local store: the parent's maps serve as they are
        if self._handles is None or self._pid != os.getpid():  # a forked child of a remote store reopens
            from dfcache.samples import SampleSet

            st = store if store is not None and self._handles is None and self._pid is None else self._store()
            self._handles = {"tokens": SampleSet(st, self.tokens_partition, self.tokens_keys),
                             "layers": [SampleSet(st, p, keys) for p, keys in
                                        zip(self.layer_partitions, self.layer_sample_keys)],
                             "local": st.backend.is_local}
            if self.concatenated is not None:
                self._handles["concatenated"] = SampleSet(st, *self.concatenated)
            self._pid = os.getpid()
        return self._handles

    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    @property
    def offsets(self) -> np.ndarray:
        """Sample i's tokens would be rows offsets[i]:offsets[i+1] of the selection laid end to end."""
        out = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        out[1:] = np.cumsum(self._lengths)
        return out

    def loss_mask(self, index: int) -> np.ndarray:
        """One sample's loss mask (int64): 0 on the prompt, 1 on the completion (an import's: its own)."""
        if self.has_loss_mask:
            return self._open()["tokens"].read_raw(index, "loss_mask", mapped=True).astype(np.int64)
        return self._prompt_mask(index, int(self._lengths[index]))

    takes_alloc = True  # read(i, alloc=...): see dfcache.training.shared_alloc

    def read(self, index: int, alloc=None) -> Sample:
        """Sample ``index``. ``alloc(shape, dtype) -> (array, tensor)``, when given, makes the
        memory the hidden states are read into (a DataLoader worker's shared memory)."""
        ids = self.read_tokens(index)
        mask = self.loss_mask(index)
        tensors: dict = {}
        if self.fp8:
            codes, scales = self.read_fp8(index)
            return Sample(key=self._keys[index], arrays={"input_ids": ids, "loss_mask": mask, "hidden_states": codes,
                                                         "hidden_states_scales": scales},
                          dtypes={"input_ids": "int64", "loss_mask": "int64", "hidden_states": "float8_e4m3fn",
                                  "hidden_states_scales": "float32"})
        return self._sample(index, ids, mask, self._hidden(index, alloc, tensors), tensors)

    def use_concatenated(self, partition: str, keys: list[str]) -> None:
        """Read hidden states from the selection's concatenated copy (runner.core.concat): each sample's
        layers side by side in one chunk, so an item in the main process is a private map of its rows."""
        self.concatenated = (partition, list(keys))
        if self._handles is not None:
            from dfcache.samples import SampleSet

            self._handles["concatenated"] = SampleSet(self._store(), partition, self.concatenated[1])

    def _hidden(self, index: int, alloc=None, tensors: dict | None = None) -> np.ndarray:
        if self.concatenated is not None:
            return self._concatenated_rows(index, alloc, tensors)
        return self.read_hidden_per_layer(index, alloc, tensors)

    def _concatenated_rows(self, index: int, alloc=None, tensors: dict | None = None) -> np.ndarray:
        from dfcache.training import shared_alloc

        stored = self._open()["concatenated"]
        if alloc is not shared_alloc:  # a worker's item goes through shared memory: read it there
            rows = stored.map_rows(index, "hidden")
            if rows is not None:
                return rows
        seg, pos = stored.segment(index)
        if alloc is None:
            return seg.read_raw(pos, "hidden", mapped=True)
        a, b = seg.rows(pos, "hidden")
        out, tensors["hidden_states"] = alloc((b - a, sum(self.widths)),
                                              np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype))
        return seg.read_raw(pos, "hidden", out=out, mapped=True)

    def read_hidden_per_layer(self, index: int, alloc=None, tensors: dict | None = None) -> np.ndarray:
        """One sample's layers side by side, copied from the per-layer partitions."""
        sets = self._open()["layers"]
        where = [ss.segment(index) for ss in sets]
        for seg, pos in where:  # read-ahead of every layer's chunks before the first (blocking) read
            seg.prefetch(pos, "hidden")
        shape = (int(self._lengths[index]), sum(self.widths))
        dtype = np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        copy = None
        if alloc is not None:  # a training item: torch is loaded, and its copy is the faster one
            from dfcache.training import copy_rows as copy

            out, tensors["hidden_states"] = alloc(shape, dtype)
        elif len(where) == 1:
            return where[0][0].read_raw(where[0][1], "hidden", mapped=True)
        else:
            out = np.empty(shape, dtype=dtype)
        from dfcache.samples import read_side_by_side

        return read_side_by_side(where, "hidden", out, mapped=True, copy=copy)

    def read_fp8(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One sample's FP8 layers side by side: codes [n, layers x H] (uint8, float8_e4m3fn bits)
        and scales [n, layers] (float32, one per token and layer)."""
        sets = self._open()["layers"]
        n = int(self._lengths[index])
        codes = np.empty((n, sum(self.widths)), np.uint8)
        scales = np.empty((n, len(sets)), np.float32)
        col = 0
        for j, (ss, w) in enumerate(zip(sets, self.widths)):
            c, s = fp8_unpack(ss.read_raw(index, "hidden", mapped=True))
            codes[:, col:col + w] = c.view(np.uint8)
            scales[:, j] = s
            col += w
        return codes, scales

    def read_tokens(self, index: int) -> np.ndarray:
        """One sample's token ids (int64)."""
        return self._open()["tokens"].read_raw(index, "ids", mapped=True).astype(np.int64)

    def read_layers(self, index: int) -> list[np.ndarray]:
        """One sample's rows of each layer, separately (storage dtype: bf16 as uint16 bits)."""
        layers = [ss.read_raw(index, "hidden") for ss in self._open()["layers"]]
        return [fp8_dequantize(x) for x in layers] if self.fp8 else layers  # FP8: the bf16 its readers get


class ArtifactSamples(_SampleSource):
    """:class:`dfcache.training.SampleSource` over a set-level tokens artifact (``token_ids``,
    ``offsets``, ``prompt_lens``, ``samples``, optionally ``loss_mask``) and one ``hidden`` artifact per
    layer (rows in the tokens' order): the layout `dfcache import` writes. Sample ``i`` is rows
    ``offsets[i]:offsets[i+1]`` of each; a read touches only the chunks those rows fall in.

    Holds the store's location, not a handle: each process opens the store on first read.
    """

    def __init__(self, store_location: str, tokens_key: str, layer_keys: list[str], *,
                 layers: list[int] | None = None, endpoint_url: str | None = None, store=None) -> None:
        self._init_location(store_location, endpoint_url, len(layer_keys), layers)
        self.tokens_key = tokens_key
        self.layer_keys = list(layer_keys)
        st = store if store is not None else self._store()
        art = st.open(tokens_key)
        self.offsets = art.array("offsets").read().astype(np.int64)
        self.prompt_lens = art.array("prompt_lens").read().astype(np.int64)
        self.sample_ids = [str(s.get("id", i)) for i, s in enumerate(art.json("samples"))]
        # Imported tokens carry the peer's own loss mask; the pipeline's is prompt 0, completion 1.
        self.has_loss_mask = "loss_mask" in art.manifest.arrays
        if len(self.prompt_lens) != len(self.offsets) - 1 or len(self.sample_ids) != len(self.prompt_lens):
            raise BadInputError(f"tokens artifact {tokens_key} is inconsistent (offsets, prompt_lens and "
                                f"samples disagree); delete it (dfcache gc --key {tokens_key[:12]} --yes) "
                                "and run again.")
        total = int(self.offsets[-1])
        for k in self.layer_keys:
            spec = st.manifest(k).arrays.get("hidden")
            if spec is None or spec.shape[0] != total:
                raise BadInputError(f"hidden-state artifact {k} does not hold {total} rows for tokens "
                                    f"{tokens_key}; it belongs to other tokens.")
            self._add_layer(spec)
        self._keys = [compute_key("sample", SAMPLE_KEY_VERSION, {"index": i, "id": sid},
                                  {"tokens": tokens_key, "hidden_states": self.layer_keys})
                      for i, sid in enumerate(self.sample_ids)]

    def _open(self) -> dict:
        if self._handles is None or self._pid != os.getpid():  # a forked child reopens
            st = self._store()
            tok = st.open(self.tokens_key)
            self._handles = {"tokens": tok.array("token_ids"),
                             "loss_mask": tok.array("loss_mask") if self.has_loss_mask else None,
                             "layers": [st.open(k).array("hidden") for k in self.layer_keys]}
            self._pid = os.getpid()
        return self._handles

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def read(self, index: int) -> Sample:
        h = self._open()
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        ids = self._rows("tokens", a, b).astype(np.int64)
        mask = self.loss_mask(index)
        return self._sample(index, ids, mask, self._hidden(h["layers"], a, b))

    def _rows(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows of a per-token array of the tokens artifact. Its chunks hold ~256k tokens (4 bytes
        a row), so each decoded chunk is kept (a few per process): a random sample read would
        otherwise decode a whole chunk for a few hundred ids."""
        h = self._open()
        arr = h[name]
        cache = h.setdefault("chunks", {})
        cr = arr.chunk_rows
        parts = []
        for c in range(a // cr, (b - 1) // cr + 1 if b > a else a // cr):
            chunk = cache.get((name, c))
            if chunk is None:
                if len(cache) >= 8:
                    cache.pop(next(iter(cache)))
                chunk = cache[(name, c)] = arr.read(c * cr, (c + 1) * cr)
            lo = max(a, c * cr) - c * cr
            hi = min(b, (c + 1) * cr) - c * cr
            parts.append(chunk[lo:hi])
        if not parts:
            return arr.read(a, b)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _hidden(self, layers, a: int, b: int) -> np.ndarray:
        if len(layers) == 1:
            return layers[0].read_raw(a, b, mapped=True)
        out = np.empty((b - a, sum(self.widths)), dtype=np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype))
        # Each layer's rows go straight from its mapped chunks into its columns: one copy.
        col = 0
        for arr, w in zip(layers, self.widths):
            arr.read_raw(a, b, out=out[:, col:col + w], mapped=True)
            col += w
        return out

    def loss_mask(self, index: int) -> np.ndarray:
        """One sample's loss mask (int64)."""
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        if self.has_loss_mask:
            return self._rows("loss_mask", a, b).astype(np.int64)
        return self._prompt_mask(index, b - a)

    def read_tokens(self, index: int) -> np.ndarray:
        """One sample's token ids (int64)."""
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return self._rows("tokens", a, b).astype(np.int64)

    def read_layers(self, index: int) -> list[np.ndarray]:
        """One sample's rows of each layer, separately (storage dtype: bf16 as uint16 bits)."""
        h = self._open()
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return [arr.read_raw(a, b) for arr in h["layers"]]


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
    drafter_family: str | None = None  # the first --drafter's family (runner/drafters/family.py)

    tokens_node: object = None
    layer_nodes: list = field(default_factory=list)

    def identity(self) -> dict:
        """What the selection's bytes depend on (the set keys), for export manifests."""
        return {"tokens": self.tokens_key, "layers": self.layers, "hidden_states": self.layer_keys}

    def source(self) -> "StoredSamples | ArtifactSamples":
        st = self.store
        t = self.tokens_node
        if t is None:  # an imported set (stored_selection): set-level artifacts
            return ArtifactSamples(st.url, self.tokens_key, self.layer_keys, layers=self.layers,
                                   endpoint_url=self.options.endpoint_url, store=st)
        return StoredSamples(st.url, t.partition.key, t.sample_keys, [n.partition.key for n in self.layer_nodes],
                             [n.sample_keys for n in self.layer_nodes], t.ids, layers=self.layers,
                             endpoint_url=self.options.endpoint_url, store=st)


def resolve_selection(opts: EvalOptions, *, store, layers: list[int] | None = None,
                      argv: list[str] | None = None, last_layer_last: bool = False, out=None,
                      export_format: str | None = None) -> Selection:
    """The stored artifacts of a selection; raises OfflineMissingError (exit 3) if any is missing.

    Layers: ``layers``, else ``opts.layers`` (their order), else the first drafter's
    ``target_layer_ids``. ``last_layer_last``: the target's last layer is moved (or added) to the
    end, as speculators' layout wants; an EAGLE-3 drafter's three layers are kept as they are
    (its ``fc`` reads exactly three) and the last layer added after them. ``out``: where notes go
    (default: stderr). The final state (layer ``"final"``, after the final norm) comes last, with
    ``--final-state`` or when ``export_format``'s layout of the drafter's family holds it
    (``runner.drafters.family.export_needs_final_state``: SpecForge's EAGLE-3 and DSpark files).
    """
    from .graph import RunContext, resolve, topo_order
    from ..drafters.family import export_needs_final_state
    from ..models.target import FINAL, read_model_info, sort_layers
    from ..stages import completions, drafter_eval, hidden_states, prompts, tokens

    from .pipeline import later_turns

    ctx = RunContext(store, opts, remotes=[], argv=argv or ["run", "hidden-states"], out=out)
    # With a multi-turn set (suite:mt-bench), the later turns too; while the answers they are asked
    # after are missing, those completions are what the selection lacks.
    first = prompts.build(ctx)
    whole, waiting = later_turns(ctx, first)
    tok = tokens.build(ctx, completions.build(ctx, whole if whole is not None else first))
    drafter_layers = drafter_family = None
    if layers is None:
        if opts.layers:
            layers = list(dict.fromkeys(opts.layers))
        elif opts.drafters:
            refs = drafter_eval.resolve_drafters(ctx)
            drafter_layers = list(refs[0].target_layer_ids)
            drafter_family = refs[0].family
            layers = list(drafter_layers)
        else:
            raise BadInputError("no hidden-state layers selected: pass --drafter DIR (its "
                                "dflash_config.target_layer_ids) or --layer K (repeatable).")
    info = read_model_info(tok.spec.target_dir)
    layers = [k for k in layers if k != FINAL]
    if last_layer_last:
        keep = layers if drafter_family == "eagle3" else [k for k in layers if k != info.num_layers - 1]
        layers = list(keep) + [info.num_layers - 1]
    final = bool(getattr(opts, "final_state", False)) or \
        (export_format is not None and export_needs_final_state(drafter_family, export_format))
    if final:
        layers.append(FINAL)
    nodes_by_layer = hidden_states.build(ctx, tok, sort_layers(layers))
    nodes = resolve(ctx, topo_order(list(nodes_by_layer.values()) + ([waiting] if waiting is not None else [])))
    wanted = ([waiting] if waiting is not None else []) + [tok] + [nodes_by_layer[k] for k in layers]
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
                     layer_keys=[nodes_by_layer[k].key for k in layers], target_dir=tok.spec.target_dir,
                     num_layers=info.num_layers, hidden_size=info.hidden_size, backend=hs0.inputs["backend"],
                     nodes=nodes, drafter_layers=drafter_layers, drafter_family=drafter_family, tokens_node=tok,
                     layer_nodes=[nodes_by_layer[k] for k in layers])


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def stored_selection(store, tokens_key: str, layers: list[int], *, backend: dict | None = None) -> Selection:
    """A selection named by the key `dfcache import` printed (an ``import`` artifact: its samples, in
    file order, from whichever segments hold them) and layer ids; or, for a set-level tokens
    artifact, the hidden-state artifacts over it, one per layer (``backend`` chooses when several
    classes exist)."""
    from ..models.target import layer_of_key

    tokens_key = store.resolve(tokens_key)
    m = store.manifest(tokens_key)
    if m.stage == "import":
        return _import_selection(store, m, list(layers))
    by_layer: dict[int, list] = {}
    for m in store.list_manifests(stage="hidden_states"):
        if m.upstream.get("tokens") == tokens_key and (backend is None or m.inputs.get("backend") == backend):
            by_layer.setdefault(layer_of_key(m.inputs["layer"]), []).append(m)
    missing = [k for k in layers if k not in by_layer]
    if missing:
        raise OfflineMissingError(f"no hidden states of layer(s) {', '.join(map(str, missing))} over tokens "
                                  f"{tokens_key} in {store.url}; `dfcache ls --stage hidden_states` shows "
                                  "which layers are there.")
    several = [k for k in layers if len(by_layer[k]) > 1]
    if several:
        raise BadInputError(f"layer(s) {', '.join(map(str, several))} over tokens {tokens_key} exist for several "
                            "backend classes; pass backend= (the 'backend' inputs of the one you mean).")
    chosen = [by_layer[k][0] for k in layers]
    art = store.manifest(chosen[0].key)
    spec = art.arrays["hidden"]
    return Selection(store=store, options=EvalOptions(), layers=list(layers), tokens_key=tokens_key,
                     layer_keys=[m.key for m in chosen], target_dir="", num_layers=-1,
                     hidden_size=int(spec.shape[1]), backend=chosen[0].inputs.get("backend"))


@dataclass
class _Listed:
    """A stored list of samples of one partition, shaped like the graph's per-sample nodes for
    :meth:`Selection.source`."""

    partition: object
    sample_keys: list[str]
    ids: list[str] = field(default_factory=list)


@dataclass
class _Part:
    key: str


def _import_selection(store, m, layers: list[int]) -> Selection:
    from dfcache.samples import index_of

    from ..peers.imports import read_import

    doc = read_import(store, m.key)
    have = list(doc["layers"])
    absent = [k for k in layers if k not in have]
    if absent or not layers:
        raise BadInputError(f"the import {m.key[:12]} holds layers {have}; layer(s) "
                            f"{', '.join(map(str, absent)) or '(none given)'} are not among them. Pass layers={have} "
                            "or a subset, in the order to concatenate.")
    parts = {k: p for k, p in zip(have, doc["layer_partitions"])}
    keys = {k: ks for k, ks in zip(have, doc["hidden_states"])}
    segs = index_of(store).segments(parts[layers[0]])
    width = next((int(s.arrays["hidden"].shape[1]) for s in segs.values() if "hidden" in s.arrays), -1)
    backend = (m.provenance or {}).get("declared_backend")
    return Selection(store=store, options=EvalOptions(), layers=layers, tokens_key=m.key,
                     layer_keys=[parts[k] for k in layers], target_dir=(m.provenance or {}).get("target_dir", ""),
                     num_layers=-1, hidden_size=width, backend=backend,
                     tokens_node=_Listed(_Part(doc["tokens_partition"]), list(doc["tokens"]), list(doc["ids"])),
                     layer_nodes=[_Listed(_Part(parts[k]), list(keys[k])) for k in layers])


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
        if a == "--final-state":
            continue
        if not any(a.startswith(d + "=") for d in drop):
            out.append(a)
    from ..models.target import FINAL

    return [*head, "run", "hidden-states", *out, *(x for k in layers if k != FINAL for x in ("--layer", str(k))),
            *(["--final-state"] if FINAL in layers else [])]
