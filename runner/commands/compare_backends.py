"""`dfcache compare-backends`: each drafter's τ on two (or more) backends' hidden states
(runner/trust/compare_backends.py). Runs models, and imports them when it starts working.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from dfcache.cli.common import emit_json, examples, get_store, state

from .common import json_output, quiet_libraries, show_bars
from .run_options import declared

_EXAMPLES = examples(
    "dfcache compare-backends --target ./qwen3-8b --drafter ./dflash-ckpt --backend fla --backend torch",
    "dfcache compare-backends --target ./qwen3-8b --drafter ./d1 --drafter ./d2 --backend fla --backend torch --num-prompts 16",
)


def compare_backends(
    target: str = declared("target", ...),
    revision: Optional[str] = declared("target_revision"),
    drafter: List[str] = declared("drafters", ...),
    trained_on: Optional[str] = declared("trained_on"),
    backend: List[str] = typer.Option(..., "--backend", metavar="fla|torch", help="A backend whose states to compare: at least two (or one with several --codec); the first is the reference (repeatable)."),
    codec: Optional[List[str]] = typer.Option(None, "--codec", metavar="CODEC", help="How states are stored, e.g. --codec none --codec fp8-e4m3: τ and per-layer error of lossy states vs exact ones (one --backend)."),
    completions_backend: Optional[str] = typer.Option(None, "--completions-backend", metavar="fla|torch", help="Whose local completions all backends share (default: the first --backend)."),
    prompts: str = declared("prompts", "builtin:coding"),
    num_prompts: Optional[int] = declared("num_prompts"),
    max_new_tokens: int = declared("max_new_tokens", 256),
    max_blocks: Optional[int] = declared("max_blocks"),
    completions: str = declared("completions", "local"),
    server: Optional[str] = declared("server"),
    server_api: str = declared("server_api", "openai"),
    served_model: Optional[str] = declared("served_model"),
    wait_server: float = declared("wait_server", 0.0),
    enable_thinking: bool = declared("enable_thinking", False),
    device: str = declared("device", "auto", help="Where hidden states are extracted."),
    eval_device: str = declared("eval_device", "auto"),
    dtype: str = declared("dtype", "bfloat16"),
    attn_implementation: str = declared("attn_implementation", "sdpa"),
    tree_budget: Optional[List[int]] = declared("tree_budgets"),
    offline: bool = typer.Option(False, "--offline", help="Never touch the network (--offline or DFCACHE_OFFLINE=1)."),
    remote: Optional[List[str]] = declared("remotes"),
    endpoint_url: Optional[str] = declared("endpoint_url"),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars and no library progress output."),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Each drafter's τ on every backend's states over the same tokens, with per-layer diffs."""
    from dfcache.config import offline_from_env

    from ..core.execution import open_remotes
    from ..trust.compare_backends import format_compare, run_compare
    from ..core.options import EvalOptions

    if server is not None and completions == "local":
        completions = "server"
    opts = EvalOptions(target=target, target_revision=revision, drafters=list(drafter), trained_on=trained_on,
                       prompts=prompts, num_prompts=num_prompts, completions=completions, server=server,
                       server_api=server_api, served_model=served_model, wait_server=wait_server,
                       max_new_tokens=max_new_tokens, enable_thinking=enable_thinking, device=device, dtype=dtype,
                       tree_budgets=list(tree_budget or []), max_blocks=max_blocks,
                       offline=offline or state.offline or offline_from_env(), remotes=list(remote or []),
                       endpoint_url=endpoint_url, json=json_output(json_out),
                       progress=not no_progress and show_bars(json_out),
                       attn_implementation=attn_implementation, eval_device=eval_device).validate()
    quiet_libraries(bars=opts.progress, notices=opts.progress or not (no_progress or state.no_progress))
    res = run_compare(get_store(), opts, list(backend), completions_backend=completions_backend,
                      remotes=open_remotes(opts), codecs=list(codec or []) or None,
                      argv=["compare-backends", "--target", target] + [a for d in drafter for a in ("--drafter", d)])
    if json_output(json_out):
        emit_json(res)
    else:
        print(format_compare(res))


def register(app: typer.Typer) -> None:
    app.command('compare-backends', epilog=_EXAMPLES)(compare_backends)
