"""`dfcache parity`: real greedy speculative decoding against the offline eval, block by block
(runner/trust/parity.py). Runs models, and imports them when it starts working.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from dfcache.cli.common import emit_json, examples, get_store, state
from dfcache.errors import EXIT_BAD_INPUT

from .common import json_output, quiet_libraries, show_bars
from .run_options import declared

_EXAMPLES = examples(
    "dfcache parity --example",
    "dfcache parity --target ./qwen3-8b --drafter ./dflash-ckpt --device cuda --dtype bfloat16",
    "dfcache parity --example --tree-budget 8 --json",
)


def parity(target: Optional[str] = declared("target"),
           drafter: Optional[str] = declared("drafters", help="A drafter checkpoint directory (DFlash, EAGLE-3 or DSpark)."),
           example: bool = declared("example", False, help="The embedded tiny example's target and trained drafter (built once next to the store)."),
           prompts: str = declared("prompts", "builtin:coding"),
           num_prompts: int = declared("num_prompts", 4, help="Prompts to decode online."),
           max_new_tokens: int = declared("max_new_tokens", 64),
           dtype: str = declared("dtype", "float32", help="float32 (must match every block) or bfloat16 (τ must agree within the 95% interval)."),
           device: str = declared("device", "cpu", help="Where both sides run."),
           backend: str = declared("backend", "auto", help="Kernel family of the target's forward, for both sides."),
           attn_implementation: str = declared("attn_implementation", "sdpa"),
           tree_budget: Optional[List[int]] = declared("tree_budgets", help="Also check DDTree with this budget (repeatable)."),
           eagle_tree: Optional[List[str]] = declared("eagle_trees", help="EAGLE-3 drafters: also check EAGLE's dynamic tree (SGLang's topk, num-steps, num-draft-tokens; repeatable)."),
           enable_thinking: bool = declared("enable_thinking", False),
           online_loop: str = typer.Option("cache", "--online-loop", metavar="cache|recompute", help="cache: the target as a serving engine runs it (KV cache, one verify forward a block); recompute: the whole prefix re-run each round."),
           trace: Optional[str] = typer.Option(None, "--trace", metavar="PATH", help="Write one JSON line per online chain block to this file."),
           serving_features: bool = typer.Option(False, "--serving-features", help="Also walk the cached completions with the drafter's context from verify forwards, as a serving engine computes it (reported, not judged)."),
           max_mismatches: int = typer.Option(5, "--show-mismatches", metavar="N", help="How many first mismatches to list."),
           json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON.")) -> None:
    """Real greedy speculative decoding vs the offline eval from the store, block by block."""
    from ..trust.parity import ParityOptions, format_parity, run_parity

    popts = ParityOptions(target=target, drafter=drafter, prompts=prompts, num_prompts=num_prompts,
                          max_new_tokens=max_new_tokens, dtype=dtype, device=device, backend=backend,
                          attn_implementation=attn_implementation, tree_budgets=list(tree_budget or []),
                          enable_thinking=enable_thinking, show_mismatches=max_mismatches,
                          progress=show_bars(json_out), online_loop=online_loop,
                          example=example, trace=trace, serving_features=serving_features,
                          eagle_trees=list(eagle_tree or []))
    # transformers' own "Loading weights" bars and notices follow ours (--no-progress, no terminal)
    quiet_libraries(bars=popts.progress, notices=popts.progress or not state.no_progress)
    res = run_parity(get_store(), popts)
    if json_output(json_out):
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


def register(app: typer.Typer) -> None:
    app.command('parity', epilog=_EXAMPLES)(parity)
