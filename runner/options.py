"""Every option of `dfcache run|plan`, as one plain dataclass the CLI fills in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalOptions:
    # what to evaluate
    example: bool = False
    target: str | None = None  # a local directory, or a Hugging Face id resolved in the local cache
    target_revision: str | None = None
    drafters: list[str] = field(default_factory=list)
    trained_on: str | None = None  # fla|torch: the backend the drafters' training states came from
    prompts: str = "builtin:coding"
    num_prompts: int | None = None
    # completions
    completions: str = "local"  # server|local
    server: str | None = None
    server_api: str = "openai"  # openai|sglang
    served_model: str | None = None  # the model name the server must report; default: its only one
    wait_server: float = 0.0
    concurrency: int = 8
    request_timeout: float = 600.0
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    enable_thinking: bool = False
    # hidden states
    layers: list[int] | None = None  # explicit layer ids (run hidden-states without a drafter)
    backend: str = "auto"  # auto|fla|torch
    device: str = "auto"  # auto|cuda|cpu
    dtype: str = "bfloat16"  # bfloat16|float32
    batch_tokens: int = 16384
    compression: str = "none"  # none|zstd
    # eval
    tree_budgets: list[int] = field(default_factory=list)
    max_blocks: int | None = None
    end_rule: str = "within"  # within (continuation is refused; see docs/metrics.md)
    eval_device: str = "auto"  # auto|cuda|cpu: where drafter_eval runs, whatever made the states
    # where things come from
    offline: bool = False
    remotes: list[str] = field(default_factory=list)
    endpoint_url: str | None = None
    json: bool = False
    progress: bool = True
    # hidden states (extraction)
    attn_implementation: str = "sdpa"  # sdpa|eager|...: keyed with the backend class
    key_versions: list[str] = field(default_factory=list)  # packages whose versions join hidden-state keys
