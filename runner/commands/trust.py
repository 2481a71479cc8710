"""`dfcache doctor`, `dfcache parity`, `dfcache compare-backends`, `dfcache explain`: the trust tools
on the command line.

Registered by ``runner.commands.run.register``. ``doctor`` and ``explain`` import neither torch nor
transformers; ``parity`` and ``compare-backends`` run models and import them when they start working.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from dfcache.cli.common import emit_json, get_store, state
from dfcache.errors import EXIT_BAD_INPUT


def _json(local: bool) -> bool:
    return local or state.json


def _bars(json_out: bool) -> bool:
    """Progress bars: on a terminal, without --json or --no-progress (the global option)."""
    return sys.stderr.isatty() and not _json(json_out) and not state.no_progress


def quiet_libraries(*, bars: bool, notices: bool) -> None:
    from .common import quiet_libraries as quiet

    quiet(bars=bars, notices=notices)


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(target: str = typer.Option(..., "--target", help="Target model: a local directory or a Hugging Face id in the local cache."),
               drafter: str = typer.Option(..., "--drafter", help="DFlash drafter checkpoint directory."),
               revision: Optional[str] = typer.Option(None, "--revision", "--target-revision", help="Revision of a Hugging Face id."),
               completions_from: Optional[str] = typer.Option(None, "--completions-from", help="Key (or prefix) of cached completions, tokens or an eval, to check template and thinking mode."),
               json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
        """Check that a drafter and a target belong together; exit 6 on any error."""
        from ..trust.doctor import format_report, run_doctor

        store = get_store(create=False) if completions_from else None
        rep = run_doctor(target, drafter, target_revision=revision, store=store, completions_from=completions_from)
        if _json(json_out):
            out = rep.to_dict()
            if not rep.ok:
                out.update(error=f"{rep.count('error')} check(s) failed", exit_code=EXIT_BAD_INPUT)
            emit_json(out)
        else:
            print(format_report(rep))
        if not rep.ok:
            raise typer.Exit(EXIT_BAD_INPUT)

    @app.command("explain")
    def explain(a: str = typer.Argument(..., metavar="A", help="A report key or unique prefix, or KEY:ROW (a row's number or drafter name)."),
                b: str = typer.Argument(..., metavar="B", help="The other report (or row), the same way; or published (published:zlab, published:ddtree): the published τ of A's target and suites, with the settings that differ."),
                top: int = typer.Option(10, "--top", help="Per-prompt τ deltas to list per row pair (--json lists all)."),
                json_out: bool = typer.Option(False, "--json", help="Print the explanation as JSON.")) -> None:
        """Why two τ differ: the key inputs that differ, the prompt overlap, per-prompt τ deltas."""
        from dfcache.errors import UsageError

        from ..trust.explain import explain as run_explain, format_explain

        if top < 1:
            raise UsageError(f"--top {top}: give a positive number of prompts.")
        res = run_explain(get_store(create=False), a, b)
        if _json(json_out):
            emit_json(res)
        else:
            print(format_explain(res, top=top))

    @app.command("parity")
    def parity(target: Optional[str] = typer.Option(None, "--target", help="Target model directory or cached Hugging Face id."),
               drafter: Optional[str] = typer.Option(None, "--drafter", help="DFlash drafter checkpoint directory."),
               example: bool = typer.Option(False, "--example", help="The embedded tiny example's target and trained drafter (built once next to the store)."),
               prompts: str = typer.Option("builtin:coding", "--prompts", help="A JSONL file or builtin:NAME."),
               num_prompts: int = typer.Option(4, "--num-prompts", help="Prompts to decode online."),
               max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
               dtype: str = typer.Option("float32", "--dtype", help="float32 (must match every block) or bfloat16 (τ must agree within the 95% interval)."),
               device: str = typer.Option("cpu", "--device", help="cpu|cuda"),
               backend: str = typer.Option("auto", "--backend", help="auto|fla|torch, for both sides."),
               attn_implementation: str = typer.Option("sdpa", "--attn-implementation", help="sdpa|eager|flash_attention_2"),
               tree_budget: Optional[List[int]] = typer.Option(None, "--tree-budget", help="Also check DDTree with this budget (repeatable)."),
               enable_thinking: bool = typer.Option(False, "--enable-thinking/--no-enable-thinking"),
               online_loop: str = typer.Option("cache", "--online-loop", help="cache: the target as a serving engine runs it (KV cache, one verify forward a block); recompute: the whole prefix re-run each round."),
               trace: Optional[str] = typer.Option(None, "--trace", help="Write one JSON line per online chain block to this file."),
               serving_features: bool = typer.Option(False, "--serving-features", help="Also walk the cached completions with the drafter's context from verify forwards, as a serving engine computes it (reported, not judged)."),
               max_mismatches: int = typer.Option(5, "--show-mismatches", help="How many first mismatches to list."),
               json_out: bool = typer.Option(False, "--json")) -> None:
        """Real greedy speculative decoding vs the offline eval from the store, block by block."""
        from ..trust.parity import ParityOptions, format_parity, run_parity

        popts = ParityOptions(target=target, drafter=drafter, prompts=prompts, num_prompts=num_prompts,
                              max_new_tokens=max_new_tokens, dtype=dtype, device=device, backend=backend,
                              attn_implementation=attn_implementation, tree_budgets=list(tree_budget or []),
                              enable_thinking=enable_thinking, show_mismatches=max_mismatches,
                              progress=_bars(json_out), online_loop=online_loop,
                              example=example, trace=trace, serving_features=serving_features)
        # transformers' own "Loading weights" bars and notices follow ours (--no-progress, no terminal)
        quiet_libraries(bars=popts.progress, notices=popts.progress or not state.no_progress)
        res = run_parity(get_store(), popts)
        if _json(json_out):
            out = res.to_dict()
            if not res.ok:
                out.update(error=("offline differs from online on some block (float32)" if res.exact_required else
                                  "τ online and offline differ beyond the interval of their paired difference"),
                           exit_code=EXIT_BAD_INPUT)
            emit_json(out)
        else:
            print(format_parity(res))
        if not res.ok:
            raise typer.Exit(EXIT_BAD_INPUT)

    @app.command("compare-backends")
    def compare_backends(
        target: str = typer.Option(..., "--target", help="Target model directory or cached Hugging Face id."),
        revision: Optional[str] = typer.Option(None, "--revision", "--target-revision"),
        drafter: List[str] = typer.Option(..., "--drafter", help="DFlash drafter checkpoint (repeatable)."),
        trained_on: Optional[str] = typer.Option(None, "--trained-on", help="fla|torch: what the drafters were trained on."),
        backend: List[str] = typer.Option(..., "--backend", help="fla|torch, at least two (or one with several --codec); the first is the reference."),
        codec: Optional[List[str]] = typer.Option(None, "--codec", help="How states are stored, e.g. --codec none --codec fp8-e4m3: τ and per-layer error of lossy states vs exact ones (one --backend)."),
        completions_backend: Optional[str] = typer.Option(None, "--completions-backend", help="Whose local completions all backends share (default: the first --backend)."),
        prompts: str = typer.Option("builtin:coding", "--prompts"),
        num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
        max_blocks: Optional[int] = typer.Option(None, "--max-blocks"),
        completions: str = typer.Option("local", "--completions", help="server|local (server when --server is given)."),
        server: Optional[str] = typer.Option(None, "--server"),
        server_api: str = typer.Option("openai", "--server-api"),
        served_model: Optional[str] = typer.Option(None, "--served-model"),
        wait_server: float = typer.Option(0.0, "--wait-server"),
        enable_thinking: bool = typer.Option(False, "--enable-thinking/--no-enable-thinking"),
        device: str = typer.Option("auto", "--device", help="auto|cuda|cpu for extraction."),
        eval_device: str = typer.Option("auto", "--eval-device", help="auto|cuda|cpu: where drafters are evaluated (auto: CUDA where usable, else CPU), whatever device made the states."),
        dtype: str = typer.Option("bfloat16", "--dtype"),
        attn_implementation: str = typer.Option("sdpa", "--attn-implementation"),
        tree_budget: Optional[List[int]] = typer.Option(None, "--tree-budget"),
        offline: bool = typer.Option(False, "--offline"),
        remote: Optional[List[str]] = typer.Option(None, "--remote"),
        endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url"),
        no_progress: bool = typer.Option(False, "--no-progress"),
        json_out: bool = typer.Option(False, "--json"),
    ) -> None:
        """Each drafter's τ on every backend's states over the same tokens, with per-layer diffs."""
        from dfcache.config import offline_from_env
        from dfcache.errors import UsageError

        from .run import open_remotes
        from ..trust.compare_backends import format_compare, run_compare
        from ..core.options import EvalOptions

        if server is not None and completions == "local":
            completions = "server"
        for name, value, allowed in (("--device", device, ("auto", "cuda", "cpu")),
                                     ("--dtype", dtype, ("bfloat16", "float32")),
                                     ("--attn-implementation", attn_implementation, ("sdpa", "eager", "flash_attention_2")),
                                     ("--eval-device", eval_device, ("auto", "cuda", "cpu"))):
            if value not in allowed:
                raise UsageError(f"{name} {value!r} is not one of {', '.join(allowed)}.")
        opts = EvalOptions(target=target, target_revision=revision, drafters=list(drafter), trained_on=trained_on,
                           prompts=prompts, num_prompts=num_prompts, completions=completions, server=server,
                           server_api=server_api, served_model=served_model, wait_server=wait_server,
                           max_new_tokens=max_new_tokens, enable_thinking=enable_thinking, device=device, dtype=dtype,
                           tree_budgets=list(tree_budget or []), max_blocks=max_blocks,
                           offline=offline or state.offline or offline_from_env(), remotes=list(remote or []),
                           endpoint_url=endpoint_url, json=_json(json_out),
                           progress=not no_progress and _bars(json_out),
                           attn_implementation=attn_implementation, eval_device=eval_device)
        quiet_libraries(bars=opts.progress, notices=opts.progress or not (no_progress or state.no_progress))
        res = run_compare(get_store(), opts, list(backend), completions_backend=completions_backend,
                          remotes=open_remotes(opts), codecs=list(codec or []) or None,
                          argv=["compare-backends", "--target", target] + [a for d in drafter for a in ("--drafter", d)])
        if _json(json_out):
            emit_json(res)
        else:
            print(format_compare(res))
