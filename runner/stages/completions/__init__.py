"""Stage `completions`: the target's completion of every prompt, from a server or local greedy.

Key recipe (``KEY`` below; ``build()`` makes its nodes through it)::

    key = compute_key('completions', 1, inputs, upstream)
    inputs:
        target           fingerprint of the target directory (config, tokenizer, weights)
        served_model     --served-model, or null for the server's only model (null for local)
        endpoint         "openai" | "sglang" | "local"
        chat_template    xxh3_128 of the target's chat template text
        enable_thinking  bool
        temperature      float
        top_p            float
        max_new_tokens   int
        seed             int or null
        backend          local only: the KernelSpec greedy generation runs with ({kernel, device,
                         dtype, attn_implementation}; it changes the ids) (only some runs have it)
    upstream:
        prompts          the prompts key

The server URL is not key material (the same model behind another address gives the same
completions), and a server completion and a local one for the same target are different
artifacts (the endpoint is keyed). Planning never contacts the server: with this artifact in
the store no request of any kind reaches it.

Output (one artifact):
    document ``c<i>`` per prompt i: ``{"index", "id", "text", "finish_reason", "token_ids",
        "tokens_source": "server"|"local"|"retokenized", "prompt_tokens", "completion_tokens"}``
    document ``index``: ``{"n", "endpoint", "served_model", "samples": [{"id", "finish_reason",
        "tokens_source", "completion_tokens"}]}``

Producing is resumable: every finished completion is saved as its own document and recorded in
the writer's checkpoint, so an interrupted run (server killed, Ctrl-C, network error) keeps what
it finished and the next run requests only the missing prompts. Failed or empty answers are
never saved. Nothing is retried: the first failure stops the run with exit 4.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

from dfcache.errors import UsageError

from ...graph import KeyRecipe, Node, RunContext
from ...models.resolve import require_weights, resolved_target
from .. import prompts as prompts_stage

KEY = KeyRecipe("completions", 1, inputs={
    "target": "fingerprint of the target directory (config, tokenizer, weights)",
    "served_model": "--served-model, or null for the server's only model (null for local)",
    "endpoint": '"openai" | "sglang" | "local"',
    "chat_template": "xxh3_128 of the target's chat template text",
    "enable_thinking": "bool",
    "temperature": "float",
    "top_p": "float",
    "max_new_tokens": "int",
    "seed": "int or null",
    "backend": "local only: the KernelSpec greedy generation runs with ({kernel, device, dtype, "
               "attn_implementation}; it changes the ids)",
}, upstream={"prompts": "the prompts key"}, optional=frozenset({"backend"}))
NAME = KEY.stage
VERSION = KEY.version
ENDPOINTS = ("openai", "sglang", "local")
_CHECKPOINT_EVERY_S = 0.5  # progress.json lists every saved document; rewriting it per item is O(n²)


def endpoint_kind(opts) -> str:
    return "local" if opts.completions == "local" else opts.server_api


def build(ctx: RunContext, prompts_node: Node) -> Node:
    opts = ctx.options
    kind = endpoint_kind(opts)  # options are valid here: EvalOptions.validate() ran
    target = resolved_target(ctx)
    inputs = {
        "target": target.fingerprint,
        "served_model": opts.served_model if kind != "local" else None,
        "endpoint": kind,
        "chat_template": target.chat_template_hash,
        "enable_thinking": bool(opts.enable_thinking),
        "temperature": float(opts.temperature),
        "top_p": float(opts.top_p),
        "max_new_tokens": int(opts.max_new_tokens),
        "seed": None if opts.seed is None else int(opts.seed),
    }
    n = len(prompts_node.payload or [])
    if kind == "local":
        from .sources import local_kernel

        require_weights(target.dir, "local completions run the model: pass the directory that holds its "
                                    "weights with --target, or take completions from a server with --server URL.")
        backend = local_kernel(opts, target.dir)
        inputs["backend"] = backend.to_key()
        return KEY.node(inputs=inputs, upstream={"prompts": prompts_node.key},
                         needs="gpu" if backend.device == "cuda" else "cpu", deps=[prompts_node],
                         label=f"completions (local, {backend.label})",
                         payload={"target_dir": str(target.dir)},
                         summary=f"{n} local greedy completions, {opts.max_new_tokens} new tokens max")
    from .sources import server_url

    server = server_url(opts.server)
    return KEY.node(inputs=inputs, upstream={"prompts": prompts_node.key}, needs="network",
                     deps=[prompts_node], label=f"completions ({kind} server)", contacts=server,
                     fix=ctx.command_with(drop=("--offline",)),
                     payload={"target_dir": str(target.dir), "server": server},
                     summary=f"{n} completions from {kind} server {server}")


def preflight(ctx: RunContext, nodes: list[Node]) -> None:
    """Check the server once, before any work, for each completions node that will contact it.

    Call after ``resolve`` (and ``check_offline``) and before ``execute``: an unreachable or
    not-ready server then fails the run (exit 4, after ``--wait-server`` at most) before other
    stages spend time. ``produce`` reuses the result and does not check again. Without this call
    the same check runs when the stage starts, still before any generation request.
    """
    from .sources import make_source

    for node in nodes:
        if node.stage == NAME and node.status == "network" and node.inputs["endpoint"] != "local":
            source = make_source(ctx, node.payload["target_dir"])
            try:
                source.check_server()
            finally:
                source.close()


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    for node in nodes:
        _produce_one(ctx, node)


def _produce_one(ctx: RunContext, node: Node) -> None:
    from .sources import make_source

    records = prompts_stage.read_records(ctx.store, node.upstream["prompts"])
    with ctx.store.writer(node.key, stage=NAME, stage_version=VERSION, inputs=node.inputs,
                          upstream=node.upstream, summary=node.summary, resumable=True) as w:
        state = w.state if w.resumed else {}
        done: dict[str, dict] = dict(state.get("done", {}))  # str(index) -> index entry
        w.state = {"done": done, "provenance": state.get("provenance", {})}
        missing = [i for i in range(len(records)) if str(i) not in done]
        if done:
            ctx.log(f"completions {node.key[:12]}: resuming, {len(done)} of {len(records)} already "
                    f"saved, {len(missing)} to go")
        if missing:
            source = make_source(ctx, node.payload["target_dir"])
            source.prepare()  # readiness and model check, once, before any generation request
            w.state["provenance"] = source.provenance
            try:
                _run(ctx, w, source, records, missing, done)
            finally:
                source.close()
        samples = [done[str(i)] for i in range(len(records))]
        prov = w.state.get("provenance", {})
        w.provenance.update(prov)
        w.put_json("index", {"n": len(records), "endpoint": node.inputs["endpoint"],
                             "served_model": prov.get("served_model"), "samples": samples})


def _run(ctx: RunContext, w, source, records: list[dict], missing: list[int], done: dict) -> None:
    """Request the missing completions with a bounded pool, saving each as it finishes."""
    workers = 1 if source.kind == "local" else max(1, int(ctx.options.concurrency))
    last_ckpt = time.monotonic()
    bar = ctx.progress(total=len(missing), desc="completions", unit="req")
    first_error: BaseException | None = None

    def save(i: int, c) -> None:
        nonlocal last_ckpt
        doc = c.to_doc(i, records[i]["id"])
        w.put_json(f"c{i}", doc)
        done[str(i)] = {"id": records[i]["id"], "finish_reason": c.finish_reason,
                        "tokens_source": c.tokens_source,
                        "completion_tokens": len(c.token_ids) if c.token_ids else c.completion_tokens}
        bar.update(1)
        now = time.monotonic()
        if now - last_ckpt >= _CHECKPOINT_EVERY_S:
            w.checkpoint()
            last_ckpt = now

    try:
        if workers == 1:
            for i in missing:
                save(i, source.complete(records[i]))
            return
        stop = threading.Event()

        def task(i: int):
            # Checked in the worker, so no new request leaves once any request has failed.
            if stop.is_set():
                return None
            try:
                return source.complete(records[i])
            except BaseException:
                stop.set()
                raise

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="completions")
        try:
            pending = {pool.submit(task, i): i for i in missing}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = pending.pop(fut)
                    if fut.cancelled():
                        continue
                    err = fut.exception()
                    if err is not None:
                        if first_error is None:
                            first_error = err
                            # Stop sending; requests already in flight may still finish and are kept.
                            for other in pending:
                                other.cancel()
                        continue
                    result = fut.result()
                    if result is not None:
                        save(i, result)
        finally:
            pool.shutdown(wait=first_error is not None, cancel_futures=True)
        if first_error is not None:
            raise first_error
    finally:
        bar.close()
        # Keep everything finished so far, whatever stopped the run (KeyboardInterrupt included).
        w.checkpoint()


@dataclass
class CompletionRecord:
    index: int
    id: str
    text: str
    finish_reason: str
    token_ids: list[int] | None
    tokens_source: str


def read_completions(store, key: str) -> list[CompletionRecord]:
    """Every completion of a committed completions artifact, in prompt order."""
    art = store.open(key)
    index = art.json("index")
    out = []
    for i in range(index["n"]):
        d = art.json(f"c{i}")
        out.append(CompletionRecord(index=i, id=d["id"], text=d["text"], finish_reason=d["finish_reason"],
                                    token_ids=d.get("token_ids"), tokens_source=d["tokens_source"]))
    return out
