"""`dfcache plan` and `dfcache run`: the eval graph on the command line.

Registered into the `dfcache` app by dfcache.cli (no entry point needed). Building the
plan imports neither torch nor transformers; a run whose every artifact is cached never does.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

import typer

from dfcache.cli.common import get_store, progress_enabled, state
from dfcache.errors import UsageError

from .common import _print_plan, open_remotes, print_run, quiet_libraries  # noqa: F401  (public here too)
from ..core.options import EvalOptions

RUN_TARGETS = {"eval": "eval", "prompts": "prompts", "completions": "completions", "tokens": "tokens",
               "hidden-states": "hidden-states", "hidden_states": "hidden-states"}


def _make_command(mode: str):
    def command(
        ctx: typer.Context,
        target: str = typer.Argument("eval", help="eval, or a stage to stop at: prompts, completions, tokens, hidden-states."),
        example: bool = typer.Option(False, "--example", help="Build and use the embedded tiny example (target, drafters, prompts)."),
        model: Optional[str] = typer.Option(None, "--target", help="Target model: a local directory or a Hugging Face id in the local cache."),
        revision: Optional[str] = typer.Option(None, "--revision", "--target-revision", help="Revision of a Hugging Face id (commit or branch in the local cache)."),
        drafter: Optional[List[str]] = typer.Option(None, "--drafter", help="A DFlash drafter checkpoint directory (repeatable)."),
        trained_on: Optional[str] = typer.Option(None, "--trained-on", help="Backend the drafters were trained on: fla|torch."),
        prompts: List[str] = typer.Option(["builtin:coding"], "--prompts", metavar="SET", help="A prompt set: builtin:NAME (coding, reasoning), suite:NAME (gsm8k, math500, humaneval, mbpp, mt-bench, alpaca, ...), hf:NAME[:CONFIG][:SPLIT] from the local datasets cache, or a JSONL, JSON or Parquet file. Repeatable: one report with τ per set."),
        num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use the first N prompts (of each set)."),
        prompt_field: Optional[str] = typer.Option(None, "--prompt-field", metavar="FIELD", help="The row field holding the prompt text (hf:, JSON, Parquet, JSONL rows)."),
        messages_field: Optional[str] = typer.Option(None, "--messages-field", metavar="FIELD", help="The row field holding a chat: a list of {role, content} (or ShareGPT {from, value})."),
        id_field: Optional[str] = typer.Option(None, "--id-field", metavar="FIELD", help="The row field naming each prompt (default: id, else the row number)."),
        mix: Optional[str] = typer.Option(None, "--mix", metavar="SET=W,...", help="SET=WEIGHT,...: the traffic-weighted τ over this run's prompt sets, with a bootstrap interval (weights sum to 1)."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
        max_blocks: Optional[int] = typer.Option(None, "--max-blocks", help="Evaluate at most N blocks per response."),
        completions: str = typer.Option("local", "--completions", help="server|local (server when --server is given)."),
        server: Optional[str] = typer.Option(None, "--server", help="Base URL of an OpenAI-compatible or SGLang server."),
        server_api: str = typer.Option("openai", "--server-api", help="openai|sglang"),
        served_model: Optional[str] = typer.Option(None, "--served-model", help="Model name the server must serve (default: its only model)."),
        wait_server: float = typer.Option(0.0, "--wait-server", help="Seconds to wait for the server to be ready (checked once, up front)."),
        concurrency: int = typer.Option(8, "--concurrency", help="Concurrent requests to the server."),
        request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds to wait for one server answer (a whole generation)."),
        temperature: float = typer.Option(0.0, "--temperature"),
        top_p: float = typer.Option(1.0, "--top-p"),
        seed: Optional[int] = typer.Option(None, "--seed"),
        enable_thinking: bool = typer.Option(False, "--enable-thinking/--no-enable-thinking"),
        accept_retokenized: bool = typer.Option(False, "--accept-retokenized", help="Keep server completions whose ids, rebuilt from text, fail their check (count, round trip); marked in the report."),
        layers: Optional[List[int]] = typer.Option(None, "--layer", help="Layer ids to extract (run hidden-states without a drafter)."),
        backend: str = typer.Option("auto", "--backend", help="auto|fla|torch"),
        device: str = typer.Option("auto", "--device", help="auto|cuda|cpu: where hidden states (and local completions) are computed."),
        eval_device: str = typer.Option("auto", "--eval-device", help="auto|cuda|cpu: where drafters are evaluated (auto: CUDA where usable, else CPU), whatever device made the states."),
        dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16|float32"),
        batch_tokens: int = typer.Option(16384, "--batch-tokens", help="Tokens per extraction batch."),
        compression: str = typer.Option("none", "--compression", help="none|zstd|shuffle-zstd|bitshuffle-lz4 (lossless) for hidden states: shuffle-zstd is the smallest, bitshuffle-lz4 the fastest; fp8-e4m3[+LOSSLESS] stores bf16 states as FP8 with a per-token scale (lossy, keyed apart)."),
        attn_implementation: str = typer.Option("sdpa", "--attn-implementation", help="sdpa|eager|flash_attention_2: the target's attention kernels (keyed with the backend)."),
        key_versions: Optional[str] = typer.Option(None, "--key-versions", help="Comma list of packages (fla,transformers,torch,...) whose exact versions join the hidden-state key (opt-in)."),
        tree_budget: Optional[List[int]] = typer.Option(None, "--tree-budget", help="DDTree budget (repeatable)."),
        end_rule: str = typer.Option("within", "--end-rule", help="within: how the last block of a completion counts (continuation is not wired yet; see docs/metrics.md)."),
        remote: Optional[List[str]] = typer.Option(None, "--remote", help="A remote store to look in before computing (repeatable)."),
        endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3 endpoint for --remote."),
        shard: Optional[str] = typer.Option(None, "--shard", help="Be worker I of N (I/N, or 'slurm' in a Slurm array): make this worker's share of the samples (docs/distributed.md)."),
        estimate: bool = typer.Option(False, "--estimate", help="plan only: the tokens to extract, the bytes per codec and the hours, from the last extraction of the same target shape (or the GPU bench's figures)."),
    ):
        # --store, --json, --debug, --offline and --no-progress are the dfcache CLI's global
        # options, which it adds to every command (dfcache.cli.common.GLOBAL_OPTIONS).
        from dfcache.config import offline_from_env, progress_interval

        if server is not None:
            # --server alone means "completions from that server": silently generating locally
            # (the default) while a server was named would cost hours on a large target.
            source = ctx.get_parameter_source("completions")
            if source is None or source.name != "COMMANDLINE":
                completions = "server"
            elif completions == "local":
                raise UsageError("--completions local does not use --server; drop --server, or pass "
                                 "--completions server to take completions from it.")
        if target not in RUN_TARGETS:
            raise UsageError(f"unknown target {target!r}; use eval, prompts, completions, tokens or hidden-states.")
        opts = EvalOptions(
            example=example, target=model, target_revision=revision, drafters=list(drafter or []),
            trained_on=trained_on, prompts=prompts[0] if len(prompts) == 1 else list(prompts), num_prompts=num_prompts,
            prompt_field=prompt_field, messages_field=messages_field, id_field=id_field, mix=mix, completions=completions,
            server=server, server_api=server_api, served_model=served_model, wait_server=wait_server,
            concurrency=concurrency, request_timeout=request_timeout, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p,
            seed=seed, enable_thinking=enable_thinking, accept_retokenized=accept_retokenized, layers=list(layers) if layers else None,
            backend=backend, device=device, dtype=dtype, batch_tokens=batch_tokens,
            compression=compression, tree_budgets=list(tree_budget or []), max_blocks=max_blocks,
            end_rule=end_rule, eval_device=eval_device, offline=state.offline or offline_from_env(),
            remotes=list(remote or []), endpoint_url=endpoint_url, json=state.json,
            progress=progress_enabled(), progress_every=None if state.no_progress else progress_interval(),
            attn_implementation=attn_implementation, key_versions=_key_versions(key_versions))
        if shard is not None and mode != "run":
            raise UsageError(f"--shard applies to `dfcache run` only (it splits the work of a run between "
                             f"workers); drop it from `dfcache {'plan' if mode == 'plan' else ctx.info_name}`.")
        if estimate and mode != "plan":
            raise UsageError(f"--estimate applies to `dfcache plan` only (it prices the work a plan shows); drop it "
                             f"from `dfcache {ctx.info_name}`, or run `dfcache plan ... --estimate` first.")
        if mode == "options":  # `dfcache watch` and `dfcache export` take these options, validated the same way
            return opts.validate()
        run_pipeline(mode, RUN_TARGETS[target], opts, argv=_run_argv(ctx, target), shard=shard, estimate=estimate)

    command.__doc__ = ("Show the graph and each node's status; does no work." if mode == "plan" else
                       "Run the graph up to TARGET, reusing everything cached.")
    return command


def _key_versions(value: str | None) -> list[str]:
    from ..core.provenance_keys import parse_key_versions

    return parse_key_versions(value)


def _arg(v) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    return str(v)


def _run_argv(ctx: typer.Context, target: str) -> list[str]:
    """This invocation as ``run`` arguments, rebuilt from what the command line gave.

    Fix messages ("produce it with: dfcache run ...") are built from it. Rebuilt rather than
    taken from ``sys.argv``, which is not this command's when ``dfcache.cli.main([...])`` is
    called from Python, and is a ``plan`` line when planning. Only options given on the command
    line appear, in declaration order.
    """
    args: list[str] = []

    def add(c, skip: tuple[str, ...] = ()) -> None:
        for p in c.command.params:
            opts = getattr(p, "opts", None)
            if p.param_type_name != "option" or not opts or p.name in skip or p.name not in c.params:
                continue
            source = c.get_parameter_source(p.name)
            if source is None or source.name != "COMMANDLINE":
                continue
            value = c.params[p.name]
            if p.is_flag:
                if value:
                    args.append(opts[0])
                elif p.secondary_opts:
                    args.append(p.secondary_opts[0])
                continue
            for v in (value if p.multiple else [value]):
                if v is not None:
                    args.extend([opts[0], _arg(v)])

    root = ctx.find_root()
    if root is not ctx:
        add(root, skip=("version", "debug"))
    args += ["run", target]
    add(ctx, skip=("_global_debug", "shard", "estimate"))  # a fix names the whole job, not one worker's share
    return args


# What `dfcache ls --stage` and `ls --backend` accept before the store holds any such artifact.
STAGE_NAMES = ("prompts", "completions", "tokens", "hidden_states", "drafter_eval", "report", "import")
KERNELS = ("fla", "torch")


def register(app: typer.Typer) -> None:
    state.known_stages.update(STAGE_NAMES)
    state.known_kernels.update(KERNELS)
    state.recomputers["hidden_states"] = _recompute_hidden_states  # set-level imports
    state.recomputers["import"] = _recompute_hidden_states
    app.command("plan", context_settings={"allow_interspersed_args": True})(_make_command("plan"))
    app.command("run", context_settings={"allow_interspersed_args": True})(_make_command("run"))
    from .peers import register as register_peers
    from .trust import register as register_trust_tools
    from .watch import register as register_watch

    register_peers(app)
    register_trust_tools(app)
    register_watch(app)


def _recompute_hidden_states(store, keys, n, **kw) -> dict:
    from ..peers.recompute import verify_hook  # imports torch only when asked to recompute

    return verify_hook(store, keys, n, **kw)


def run_pipeline(mode: str, upto: str, opts: EvalOptions, argv: list[str] | None = None, shard: str | None = None,
                 estimate: bool = False):
    """Plan (and for mode "run", execute) the graph through runner.api, and print. Returns (ctx, nodes).

    A run is one worker of a distributed run under torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or with
    ``--shard I/N``: it makes its share, and only the worker that speaks for the job prints the
    summary (docs/distributed.md); other torchrun ranks print nothing and return (None, None)."""
    from .. import api
    from ..core.graph import check_offline

    opts.validate()  # before anything is opened; RunContext checks again for Python callers
    quiet_libraries(bars=opts.progress, notices=opts.progress or not state.no_progress)

    started = time.perf_counter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if mode == "plan":
        ctx, nodes = api.resolve_graph(upto, opts, get_store(), argv=argv, log=log)
        if estimate:
            from ..core.estimate import describe, estimate as price

            est = price(ctx, nodes)
            _print_plan(nodes, opts, est, describe(est))
        else:
            _print_plan(nodes, opts)
        if opts.offline:
            check_offline(ctx, nodes)
        return ctx, nodes
    from ..distributed import discover, run_worker

    worker = discover(shard)
    done = run_worker(upto, opts, get_store(), worker=worker, argv=argv, log=log)
    if done.ctx is None:
        return None, None
    result = api.worker_result(upto, done, time.perf_counter() - started)
    print_run(result, opts, done if worker.distributed else None)
    return done.ctx, done.nodes
