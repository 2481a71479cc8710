"""Stage `completions`: the target's completion of every prompt, from a server or local greedy.

Key recipe (per sample; ``KEY`` below, ``build()`` makes its nodes through it)::

    partition = compute_key('completions', 2, inputs, upstream)
    sample    = sample_key(partition, prompts sample key)
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
        sample           the prompts partition

The server URL is not key material (the same model behind another address gives the same
completions), and a server completion and a local one for the same target are different
samples (the endpoint is keyed). Planning never contacts the server: with every completion of a
set in the store, no request of any kind reaches it, whatever subset, superset or order of
prompts the set is.

Output, per sample: the document ``{"text", "finish_reason", "token_ids", "tokens_source":
"server"|"local"|"retokenized", "prompt_tokens", "completion_tokens"}``, plus, where they apply,
``reasoning_content`` (a server-side reasoning parser's split; ``text`` is then the content),
``server_ids_from`` (``token_ids`` | ``logprobs``: how a vLLM server gave its ids) and
``ids_check`` (text-only answers: the facts of the check below, as the tokens stage records them).

Ids. ``token_ids`` are the ids the server generated (vLLM is asked for them, SGLang's native API
returns them) or local greedy's; a server's ids are checked against its own text when they arrive,
and ids that disagree are refused. A text-only answer is checked here, before anything is cached
(runner/stages/completions/ids.py: the rebuilt ids' count against ``usage.completion_tokens``, the
round trip, no U+FFFD; a reasoning split is first put back together in the chat template's form).
The ids themselves are rebuilt again by the tokens stage, not stored here: the completions
artifact keeps what the server said, and the tokens stage keeps making ids (and checking) the one
way it has always made them, which also covers text-only completions cached before checks
existed. A sample that fails is not cached (the others are) and the run ends with exit 6 naming
it, unless ``--accept-retokenized`` keeps it with its failed check recorded. Whether a stored
failed sample may be used is decided by each run that uses it (``--accept-retokenized`` is no key
input: a verdict that depends on an option outside the key is never stored).

Only missing samples are requested. Finished completions are committed in segments every
``COMMIT_EVERY`` samples or ``COMMIT_EVERY_S`` seconds and when the run stops for any reason,
so an interrupted run (server killed, Ctrl-C, network error) keeps what it finished and the next
run requests only what is still missing. Failed or empty answers are never saved. Nothing is
retried: the first failure stops the run with exit 4.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dfcache.errors import BadInputError, UsageError

from ...core.graph import CompletionsSpec, KeyRecipe, Node, RunContext
from ...models.resolve import check_chat_template, context_window, require_weights, resolved_target
from .. import prompts as prompts_stage

KEY = KeyRecipe("completions", 2, inputs={
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
}, upstream={"sample": "the prompts partition"}, optional=frozenset({"backend"}), sample="prompts sample key")
NAME = KEY.stage
VERSION = KEY.version
ENDPOINTS = ("openai", "sglang", "local")
COMMIT_EVERY = 256  # samples a segment (at most)
COMMIT_EVERY_S = 5.0  # a segment at least this often while answers arrive


def endpoint_kind(opts) -> str:
    return "local" if opts.completions == "local" else opts.server_api


def build(ctx: RunContext, prompts_node: Node) -> Node:
    opts = ctx.options
    kind = endpoint_kind(opts)  # options are valid here: EvalOptions.validate() ran
    target = resolved_target(ctx)
    window = context_window(target.dir)
    if window is not None and opts.max_new_tokens >= window:
        # A well-formed count the model contradicts (6): a local run went on silently, a server
        # refuses every request (its max_model_len is at most this) after the prompts were stored.
        raise BadInputError(f"--max-new-tokens {opts.max_new_tokens} does not fit the target's context window "
                            f"({window} tokens, max_position_embeddings in {target.dir}/config.json), which "
                            f"the prompt shares; pass a --max-new-tokens below {window}, leaving room for the prompt.")
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
    samples = dict(upstream_samples=prompts_node.sample_keys, upstream_bytes=prompts_node.sample_key_bytes,
                   ids=prompts_node.ids,
                   partition_upstream={"sample": prompts_node.partition.key})
    if kind == "local":
        from .sources import local_kernel

        require_weights(target.dir, "local completions run the model: pass the directory that holds its "
                                    "weights with --target, or take completions from a server with --server URL.")
        backend = local_kernel(opts, target.dir)
        inputs["backend"] = backend.to_key()
        return KEY.samples(inputs=inputs, **samples,
                           needs="gpu" if backend.device == "cuda" else "cpu", deps=[prompts_node],
                           label=f"completions (local, {backend.label})",
                           precheck=lambda: check_chat_template(target.dir),
                           spec=CompletionsSpec(target_dir=str(target.dir), prompts=prompts_node),
                           summary=f"local greedy completions, {opts.max_new_tokens} new tokens max")
    from .sources import server_url

    server = server_url(opts.server)
    return KEY.samples(inputs=inputs, **samples, needs="network",
                     deps=[prompts_node], label=f"completions ({kind} server)", contacts=server,
                     fix=ctx.command_with(drop=("--offline",)),
                     spec=CompletionsSpec(target_dir=str(target.dir), prompts=prompts_node, server=server),
                     summary=f"completions from {kind} server {server}")


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
            source = make_source(ctx, node.spec.target_dir)
            try:
                source.check_server()
            finally:
                source.close()


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    for node in nodes:
        _produce_one(ctx, node)


def _produce_one(ctx: RunContext, node: Node) -> None:
    from dfcache.samples import SampleSink

    from .sources import make_source

    todo = node.positions_distinct(node.produce)
    if not todo:
        return
    messages = prompts_stage.read_messages(ctx.store, node.spec.prompts, todo)
    records = {i: {"id": node.ids[i], "messages": m} for i, m in zip(todo, messages)}
    stored = len(node.local) + len(node.in_remote)
    if stored:
        ctx.log(f"completions: {stored} of {len(node.sample_keys)} already stored, {len(todo)} to fetch")
    source = make_source(ctx, node.spec.target_dir)
    source.prepare()  # readiness and model check, once, before any generation request
    verify = None if source.kind == "local" else _Verifier(ctx, node)
    try:
        from ...core.summaries import prompt_set_name

        summary = f"{prompt_set_name(node.spec.prompts)}: {node.summary}"  # the set: ls --by selection
        with SampleSink(ctx.store, node.partition, summary=summary, provenance=source.provenance,
                        max_samples=COMMIT_EVERY, max_seconds=COMMIT_EVERY_S) as sink:
            refused = _run(ctx, sink, node, source, records, todo, verify)
    finally:
        source.close()
    if refused:  # after the sink committed every sample that passed
        from .ids import refusal

        order = {node.ids[i]: k for k, i in enumerate(todo)}  # prompt order, not the order answers came in
        raise refusal(sorted(refused, key=lambda r: order[r["id"]]), total=len(todo), stage="completions")


class _Verifier:
    """The checks of a server's answers (ids.py), with the target's tokenizer loaded once, at the
    first answer: a server that fails before answering fails without a tokenizer (or torch) loaded."""

    def __init__(self, ctx: RunContext, node: Node) -> None:
        self.ctx = ctx
        self.target_dir = node.spec.target_dir
        self.tokenizer = None
        self.eos: list[int] = []
        self.enable_thinking = bool(node.inputs["enable_thinking"])
        self.accept = bool(ctx.options.accept_retokenized)

    def __call__(self, doc: dict, messages: list[dict]) -> dict | None:
        """Check ``doc`` (adding ``ids_check`` to a text-only one); a refusal dict, or None to keep it."""
        from .ids import rebuild, server_ids_problem, stop_ids

        if self.tokenizer is None:
            from .sources import load_tokenizer

            self.tokenizer = load_tokenizer(self.target_dir, self.ctx.cache)
            self.eos = stop_ids(self.target_dir, self.tokenizer)
        if doc.get("token_ids") is not None:
            problem = server_ids_problem(self.tokenizer, doc["token_ids"], doc)
            return None if problem is None else {"problem": problem, "acceptable": False}
        r = rebuild(self.tokenizer, self.eos, messages, self.enable_thinking, doc)
        if r.check is not None:
            doc["ids_check"] = r.check
        if r.problem is None or (r.acceptable and self.accept):
            return None
        return {"problem": r.problem, "acceptable": r.acceptable}


def _run(ctx: RunContext, sink, node: Node, source, records: dict[int, dict], todo: list[int],
         verify: _Verifier | None = None) -> list[dict]:
    """Request the missing completions with a bounded pool, handing each to the sink as it finishes
    (checked by ``verify`` first). Returns the refused samples (``id``, ``problem``, ``acceptable``)."""
    workers = 1 if source.kind == "local" else max(1, int(ctx.options.concurrency))
    bar = ctx.progress(total=len(todo), desc="completions", unit="req")
    first_error: BaseException | None = None
    refused: list[dict] = []

    def save(i: int, c) -> None:
        doc = c.to_doc(i, records[i]["id"])
        for field in ("index", "id"):  # a sample is shared by every set and id that holds the prompt
            doc.pop(field, None)
        bar.update(1)
        # In this (the main) thread: HF fast tokenizers are not safe to call from many threads.
        refuse = verify(doc, records[i]["messages"]) if verify is not None else None
        if refuse is not None:
            refused.append({"id": records[i]["id"], **refuse})
            return
        sink.add(node.upstream_samples[i], doc=doc)

    try:
        if workers == 1:
            for i in todo:
                save(i, source.complete(records[i]))
            return refused
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

        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="completions")
        try:
            pending = {pool.submit(task, i): i for i in todo}
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
        return refused
    finally:
        bar.close()


@dataclass
class CompletionRecord:
    index: int
    id: str
    text: str
    finish_reason: str
    token_ids: list[int] | None
    tokens_source: str
    ids_check: dict | None = None  # text-only answers: the facts of their check (ids.py)
    reasoning_content: str | None = None


def read_completions(store, node: Node) -> list[CompletionRecord]:
    """Every completion of a completions node's prompt set, in prompt order."""
    from dfcache.samples import SampleSet

    docs = SampleSet(store, node.partition.key, node.sample_keys).docs()
    return [CompletionRecord(index=i, id=node.ids[i], text=d["text"], finish_reason=d["finish_reason"],
                             token_ids=d.get("token_ids"), tokens_source=d["tokens_source"],
                             ids_check=d.get("ids_check"), reasoning_content=d.get("reasoning_content"))
            for i, d in enumerate(docs)]
