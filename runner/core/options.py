"""Every option of `dfcache run|plan`, as one plain dataclass the CLI fills in.

:meth:`EvalOptions.validate` is the one place option values are checked: the CLI and the Python
API both reach it (``RunContext`` calls it), and the stages trust what it let through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dfcache.errors import UsageError
from dfcache.fp8 import check_applies, compression_choices

MAX_NEW_TOKENS = 2**31 - 1  # token ids and counts are stored as int32

CHOICES = {  # option -> (its flag, allowed values)
    "completions": ("--completions", ("server", "local")),
    "server_api": ("--server-api", ("openai", "sglang")),
    "backend": ("--backend", ("auto", "fla", "torch")),
    "device": ("--device", ("auto", "cuda", "cpu")),
    "eval_device": ("--eval-device", ("auto", "cuda", "cpu")),
    "dtype": ("--dtype", ("bfloat16", "float32")),
    "compression": ("--compression", compression_choices()),
    "attn_implementation": ("--attn-implementation", ("sdpa", "eager", "flash_attention_2")),
    "end_rule": ("--end-rule", ("within", "continuation")),
}


@dataclass
class EvalOptions:
    # what to evaluate
    example: bool = False
    target: str | None = None  # a local directory, or a Hugging Face id resolved in the local cache
    target_revision: str | None = None
    drafters: list[str] = field(default_factory=list)
    trained_on: str | None = None  # fla|torch: the backend the drafters' training states came from
    # a prompt set (builtin:NAME, suite:NAME, hf:NAME[:CONFIG][:SPLIT], a JSONL/JSON/Parquet file), or
    # several: one set whose ids are SET/ID, reported per set (runner/suites/)
    prompts: "str | list[str]" = "builtin:coding"
    num_prompts: int | None = None  # the first N prompts (of each set, when there are several)
    prompt_field: str | None = None  # the row field holding the prompt text (hf:, JSON, Parquet, JSONL rows)
    messages_field: str | None = None  # the row field holding a chat (a list of {role, content})
    id_field: str | None = None  # the row field naming each prompt (default: "id", else the row number)
    mix: str | None = None  # SET=WEIGHT,...: the traffic-weighted τ over the sets of a run (weights sum to 1)
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
    # keep completions whose ids were rebuilt from text and failed their check (count against the
    # server's usage, decode round trip); marked in every report row that uses them
    accept_retokenized: bool = False
    # hidden states
    layers: list[int] | None = None  # explicit layer ids (run hidden-states without a drafter)
    backend: str = "auto"  # auto|fla|torch
    device: str = "auto"  # auto|cuda|cpu
    dtype: str = "bfloat16"  # bfloat16|float32
    batch_tokens: int = 16384
    # none|zstd|shuffle-zstd|bitshuffle-lz4 (lossless, not keyed), fp8-e4m3[+lossless] (lossy, keyed): dfcache.fp8
    compression: str = "none"
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
    # seconds between progress lines when there are no bars (stderr not a terminal); None: no
    # lines (the Python API's default). The command line sets it unless --no-progress.
    progress_every: float | None = None
    # hidden states (extraction)
    attn_implementation: str = "sdpa"  # sdpa|eager|...: keyed with the backend class
    key_versions: list[str] = field(default_factory=list)  # packages whose versions join hidden-state keys

    def validate(self) -> "EvalOptions":
        """Raise UsageError naming the first bad option and its fix."""
        for name, (flag, allowed) in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise UsageError(f"{flag} {value!r} is not one of {', '.join(allowed)}.")
        check_applies(self.compression, stage="hidden_states", dtype=self.dtype)  # fp8-* on float32 states
        if self.end_rule == "continuation":
            # Refused rather than keyed: it needs the target's greedy tokens past the end of every
            # completion, which no completion source stores yet; accepting it changed the keys and
            # still computed the within-output rule.
            raise UsageError("--end-rule continuation is not available yet: it needs the target's greedy "
                             "continuation past each completion, which dfcache does not store; use "
                             "--end-rule within (the default). docs/metrics.md describes both rules.")
        if not isinstance(self.prompts, str) and (
                not self.prompts or not all(isinstance(p, str) and p for p in self.prompts)):
            raise UsageError("--prompts: give a prompt set (e.g. builtin:coding, suite:gsm8k, hf:NAME, or a file).")
        if self.mix is not None:
            from ..suites.sets import parse_mix_form

            parse_mix_form(self.mix)
        if self.trained_on not in (None, "fla", "torch"):
            raise UsageError(f"--trained-on {self.trained_on!r} is not one of fla, torch.")
        for flag, value in (("--num-prompts", self.num_prompts), ("--max-new-tokens", self.max_new_tokens),
                            ("--max-blocks", self.max_blocks), ("--concurrency", self.concurrency)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{flag} {value}: give a positive number.")
        if not isinstance(self.batch_tokens, int) or self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens {self.batch_tokens!r}: give a positive number of tokens.")
        if any(int(b) < 1 for b in self.tree_budgets):
            raise UsageError(f"--tree-budget {min(int(b) for b in self.tree_budgets)}: budgets are positive "
                             "numbers of drafted nodes.")
        if self.max_new_tokens is not None and self.max_new_tokens > MAX_NEW_TOKENS:
            # Token counts are stored as int32; a target's own context window is checked against
            # its config.json when the graph is built (runner/stages/completions).
            raise UsageError(f"--max-new-tokens {self.max_new_tokens}: more than any model can generate; give "
                             f"at most {MAX_NEW_TOKENS} (and no more than the target's context window).")
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise UsageError(f"--request-timeout {self.request_timeout:g}: give a positive number of seconds.")
        if not (math.isfinite(self.wait_server) and self.wait_server >= 0):
            # inf waited forever: the wait is meant to be bounded (DESIGN §5).
            raise UsageError(f"--wait-server {self.wait_server:g}: give 0 (check once) or a finite number of "
                             "seconds to wait for the server.")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"--temperature {self.temperature:g}: give 0 (greedy) or a positive number.")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            # A probability mass: servers refuse anything else (vLLM, SGLang: "top_p must be in (0, 1]").
            raise UsageError(f"--top-p {self.top_p:g}: give a probability in (0, 1] (1 keeps every token).")
        if self.completions == "server" and not self.server:
            raise UsageError("--completions server needs --server URL (e.g. --server http://127.0.0.1:30000), "
                             "or use --completions local.")
        if self.completions == "local" and float(self.temperature) != 0.0:
            raise UsageError(f"local completions are greedy, but --temperature is {self.temperature:g}; pass "
                             "--temperature 0, or use --completions server to sample.")
        return self
