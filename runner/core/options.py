"""The options of `dfcache run|plan`, declared once: :data:`RUN_OPTIONS`.

Everything else is derived from that table: :class:`EvalOptions` (the dataclass the stages read
and the Python API's keywords), the typer parameters of ``run``/``plan`` (and of ``watch``,
``export`` and ``concat``, which take the same selection; runner/commands/run_options.py), the
cached-run fast path's parser (runner/commands/fast_run.py), the command lines of "produce it
with:" messages (:func:`run_argv`) and the option tables of docs/cli.md
(:func:`markdown_tables`; tests/test_run_options.py fails if any of them disagrees). Adding an
option is one row here, and a stage reading ``ctx.options.<name>``.

:meth:`EvalOptions.validate` is the one place option values are checked: the CLI and the Python
API both reach it (``RunContext`` calls it), and the stages trust what it let through.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, field, fields, make_dataclass

from dfcache.errors import UsageError
from dfcache.fp8 import check_applies, compression_choices

MAX_NEW_TOKENS = 2**31 - 1  # token ids and counts are stored as int32

# The help's groups, in the order `dfcache run -h` shows them.
GROUPS = {
    "models": "Target and drafters",
    "prompts": "Prompts and completions",
    "server": "Completion server",
    "extraction": "Hidden states (extraction)",
    "eval": "Eval",
    "store": "Store and remotes",
    "output": "Output",
}

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
KERNELS = ("auto", "fla", "torch")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("bfloat16", "float32")


class RunOption:
    """One option of `dfcache run|plan`. (A plain class: a dataclass costs a cached run's import
    of this module a millisecond more to build.)"""

    __slots__ = ("name", "flags", "type", "default", "help", "group", "keys", "choices", "metavar", "repeat", "off",
                 "comma", "fast", "field")

    def __init__(self, name: str, flags: tuple[str, ...], type: type, default, help: str, group: str, *,
                 keys: tuple[str, ...] = (), choices: tuple[str, ...] = (), metavar: str | None = None,
                 repeat: bool = False, off: str | None = None, comma: bool = False, fast: bool = True,
                 field: bool = True) -> None:
        self.name = name  # the EvalOptions field and the Python API's keyword (the typer parameter's too)
        self.flags = flags  # the first is how messages spell it; the others are aliases
        self.type = type  # str, int, float or bool: of each value, for a repeatable option
        self.default = default
        self.help = help
        self.group = group  # a key of GROUPS
        self.keys = keys  # the stage keys it is material of (empty: none; it changes no key)
        self.choices = choices
        self.metavar = metavar  # default: the choices, a|b|c
        self.repeat = repeat  # given once per value, a list (``--drafter A --drafter B``)
        self.off = off  # a switch's off spelling (--no-enable-thinking)
        self.comma = comma  # one comma-separated value, a list (``--key-versions fla,torch``)
        self.fast = fast  # the cached-run fast path takes it (else the full command line answers)
        self.field = field  # an EvalOptions field (False: the command's own, such as --shard)

    def __repr__(self) -> str:
        return f"RunOption({self.name!r}, {self.flags!r})"

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def one_or_list(self) -> bool:
        """Repeatable, and one value is kept as itself (``--prompts``: a set, or a list of sets)."""
        return self.repeat and self.default is not None and not isinstance(self.default, tuple)

    @property
    def is_list(self) -> bool:
        return self.comma or (self.repeat and not self.one_or_list)

    @property
    def cli_default(self):
        """The typer parameter's default (a repeatable option's: a list, or None for none)."""
        if self.one_or_list:
            return [self.default]
        return None if (self.repeat or self.comma) else self.default

    @property
    def shown_metavar(self) -> str | None:
        if self.type is bool:
            return None
        return self.metavar or ("|".join(self.choices) if self.choices else None)

    def spell(self, value) -> list[str]:
        """The command-line arguments that give ``value`` (a switch: its on or off flag)."""
        if self.type is bool:
            return [self.flag] if value else ([self.off] if self.off else [])
        if self.comma:
            return [self.flag, value if isinstance(value, str) else ",".join(value)]
        values = value if self.repeat and isinstance(value, (list, tuple)) else [value]
        return [a for v in values if v is not None for a in (self.flag, _spell_value(v))]


def _spell_value(v) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    return str(v)


_O = RunOption
RUN_OPTIONS: tuple[RunOption, ...] = (  # in the order `run -h` lists them and messages spell them
    _O("example", ("--example",), bool, False, "Build and use the embedded tiny example (target, drafters, prompts).",
       "models"),
    _O("target", ("--target",), str, None, "Target model: a local directory or a Hugging Face id in the local cache.",
       "models", keys=("completions", "tokens", "hidden_states", "drafter_eval"), metavar="MODEL"),
    _O("target_revision", ("--revision", "--target-revision"), str, None,
       "Revision of a Hugging Face id (commit or branch in the local cache).", "models",
       keys=("completions", "tokens", "hidden_states", "drafter_eval"), metavar="REV"),
    _O("drafters", ("--drafter",), str, (), "A drafter checkpoint directory (DFlash, EAGLE-3 or DSpark: the "
       "family is read from its config), a training run's directory or a quoted glob (repeatable).", "models", keys=("drafter_eval", "report"), metavar="PATH", repeat=True),
    _O("trained_on", ("--trained-on",), str, None, "Backend the drafters were trained on (a mismatch is flagged "
       "when the report is shown).", "models", choices=("fla", "torch")),
    _O("prompts", ("--prompts",), str, "builtin:coding", "A prompt set: builtin:NAME (coding, reasoning), suite:NAME "
       "(gsm8k, math500, humaneval, mbpp, mt-bench, alpaca, ...), hf:NAME[:CONFIG][:SPLIT] from the local datasets "
       "cache, or a JSONL, JSON or Parquet file. Repeatable: one report with τ per set.", "prompts", keys=("prompts",),
       metavar="SET", repeat=True),
    _O("num_prompts", ("--num-prompts",), int, None, "Use the first N prompts (of each set).", "prompts",
       keys=("prompts",), metavar="N"),
    _O("prompt_field", ("--prompt-field",), str, None, "The row field holding the prompt text (hf:, JSON, Parquet, "
       "JSONL rows).", "prompts", keys=("prompts",), metavar="FIELD"),
    _O("messages_field", ("--messages-field",), str, None, "The row field holding a chat: a list of {role, content} "
       "(or ShareGPT {from, value}).", "prompts", keys=("prompts",), metavar="FIELD"),
    _O("id_field", ("--id-field",), str, None, "The row field naming each prompt (default: id, else the row number).",
       "prompts", keys=("prompts",), metavar="FIELD"),
    _O("mix", ("--mix",), str, None, "SET=WEIGHT,...: the traffic-weighted τ over this run's prompt sets, with a "
       "bootstrap interval (weights sum to 1).", "eval", metavar="SET=W,..."),
    _O("max_new_tokens", ("--max-new-tokens",), int, 256, "Tokens to generate per completion at most.", "prompts",
       keys=("completions",), metavar="N"),
    _O("max_blocks", ("--max-blocks",), int, None, "Evaluate at most N blocks per response.", "eval",
       keys=("drafter_eval",), metavar="N"),
    _O("completions", ("--completions",), str, "local", "Where completions come from (server when --server is "
       "given).", "prompts", keys=("completions",), choices=("server", "local")),
    _O("server", ("--server",), str, None, "Base URL of an OpenAI-compatible or SGLang server (the served model "
       "is keyed, not the URL).", "server", metavar="URL", fast=False),
    _O("server_api", ("--server-api",), str, "openai", "The server's API: OpenAI-compatible, or SGLang's /generate.",
       "server", keys=("completions",), choices=("openai", "sglang"), fast=False),
    _O("served_model", ("--served-model",), str, None, "Model name the server must serve (default: its only model).",
       "server", keys=("completions",), metavar="NAME", fast=False),
    _O("wait_server", ("--wait-server",), float, 0.0, "Seconds to wait for the server to be ready (checked once, "
       "up front).", "server", metavar="SECONDS", fast=False),
    _O("concurrency", ("--concurrency",), int, 8, "Concurrent requests to the server.", "server", metavar="N",
       fast=False),
    _O("request_timeout", ("--request-timeout",), float, 600.0, "Seconds to wait for one server answer (a whole "
       "generation).", "server", metavar="SECONDS", fast=False),
    _O("temperature", ("--temperature",), float, 0.0, "Sampling temperature (0: greedy; local completions are "
       "greedy).", "prompts", keys=("completions",), metavar="T"),
    _O("top_p", ("--top-p",), float, 1.0, "Nucleus sampling mass, in (0, 1].", "prompts", keys=("completions",),
       metavar="P"),
    _O("seed", ("--seed",), int, None, "Sampling seed sent to the server.", "prompts", keys=("completions",),
       metavar="N"),
    _O("enable_thinking", ("--enable-thinking",), bool, False, "Render the chat template in thinking mode.",
       "prompts", keys=("completions", "tokens"), off="--no-enable-thinking"),
    _O("accept_retokenized", ("--accept-retokenized",), bool, False, "Keep server completions whose ids, rebuilt "
       "from text, fail their check (count, round trip); marked in the report.", "prompts"),
    _O("layers", ("--layer",), int, None, "Layer ids to extract (run hidden-states without a drafter; "
       "repeatable).", "extraction", keys=("hidden_states",), metavar="K", repeat=True),
    _O("final_state", ("--final-state",), bool, False, "Also extract the target's state after its final norm "
       "(layer 'final': what its lm_head reads; EAGLE-3's and DSpark's training data).", "extraction",
       keys=("hidden_states",)),
    _O("backend", ("--backend",), str, "auto", "Kernel family of the target's forward: fla (CUDA), torch, or auto.",
       "extraction", keys=("hidden_states", "completions (local)"), choices=KERNELS),
    _O("device", ("--device",), str, "auto", "Where hidden states (and local completions) are computed.",
       "extraction", keys=("hidden_states", "completions (local)"), choices=DEVICES),
    _O("eval_device", ("--eval-device",), str, "auto", "Where drafters are evaluated (auto: CUDA where usable, else "
       "CPU), whatever device made the states.", "eval", keys=("drafter_eval",), choices=DEVICES),
    _O("dtype", ("--dtype",), str, "bfloat16", "Compute dtype of the target and the drafters.", "extraction",
       keys=("hidden_states", "drafter_eval", "completions (local)"), choices=DTYPES),
    _O("batch_tokens", ("--batch-tokens",), int, 16384, "Tokens per extraction batch.", "extraction", metavar="N"),
    _O("compression", ("--compression",), str, "none", "How hidden states are stored: none|zstd|shuffle-zstd|"
       "bitshuffle-lz4 (lossless, not keyed: shuffle-zstd is the smallest, bitshuffle-lz4 the fastest); "
       "fp8-e4m3[+LOSSLESS] stores bf16 states as FP8 with a per-token scale (lossy, keyed apart).", "extraction",
       keys=("hidden_states (fp8 only)",), choices=compression_choices(), metavar="CODEC"),
    _O("attn_implementation", ("--attn-implementation",), str, "sdpa", "The target's attention kernels (keyed with "
       "the backend).", "extraction", keys=("hidden_states", "completions (local)"),
       choices=ATTN_IMPLEMENTATIONS),
    _O("key_versions", ("--key-versions",), str, (), "Comma list of packages (fla,transformers,torch,...) whose "
       "exact versions join the hidden-state key (opt-in).", "extraction", keys=("hidden_states",),
       metavar="PKG,...", comma=True, fast=False),
    _O("tree_budgets", ("--tree-budget",), int, (), "DDTree budget evaluated beside the chain (repeatable).", "eval",
       keys=("drafter_eval",), metavar="N", repeat=True),
    _O("eagle_steps", ("--eagle-steps",), int, None, "EAGLE-3 drafters: drafts per block of the chain (default: "
       "the checkpoint's speculative_tokens, else 5).", "eval", keys=("drafter_eval",), metavar="N"),
    _O("eagle_trees", ("--eagle-tree",), str, (), "EAGLE-3 drafters: also EAGLE's dynamic tree with SGLang's "
       "--speculative-eagle-topk, -num-steps, -num-draft-tokens (repeatable).", "eval", keys=("drafter_eval",),
       metavar="TOPK,STEPS,TOKENS", repeat=True, fast=False),
    _O("end_rule", ("--end-rule",), str, "within", "How the last block of a completion counts (continuation is not "
       "wired yet; docs/metrics.md).", "eval", keys=("drafter_eval",), choices=("within", "continuation")),
    _O("remotes", ("--remote",), str, (), "A remote store to look in before computing (repeatable).", "store",
       metavar="URL|NAME", repeat=True, fast=False),
    _O("endpoint_url", ("--endpoint-url",), str, None, "S3 endpoint for --remote.", "store", metavar="URL",
       fast=False),
    _O("shard", ("--shard",), str, None, "Be worker I of N (I/N, or 'slurm' in a Slurm array): make this worker's "
       "share of the samples (docs/distributed.md; run only).", "store", metavar="I/N|slurm", fast=False,
       field=False),
    _O("estimate", ("--estimate",), bool, False, "plan only: the tokens to extract, the bytes per codec and the "
       "hours, from the last extraction of the same target shape (or the GPU bench's figures).", "output",
       fast=False, field=False),
)
del _O

BY_NAME = {o.name: o for o in RUN_OPTIONS}
BY_FLAG = {f: o for o in RUN_OPTIONS for f in (*o.flags, *((o.off,) if o.off else ()))}
CHOICES = {o.name: (o.flag, o.choices) for o in RUN_OPTIONS if o.choices}  # name -> (its flag, allowed values)


def _field(o: RunOption):
    # Annotations as strings, as ``from __future__ import annotations`` writes them (no typing import).
    if o.one_or_list:
        return o.name, f"{o.type.__name__} | list[{o.type.__name__}]", field(default=o.default)
    if o.repeat or o.comma:
        ann = f"list[{o.type.__name__}]" + (" | None" if o.default is None else "")
        return o.name, ann, field(default=None) if o.default is None else field(default_factory=lambda: list(o.default))
    return o.name, o.type.__name__ + (" | None" if o.default is None else ""), field(default=o.default)


# Fields of a run that are no option of `run`: the dfcache command line's global options and how
# progress shows (set from them by the command line; the Python API's own keywords).
_STATE = [
    ("offline", "bool", field(default=False)),
    ("json", "bool", field(default=False)),
    ("progress", "bool", field(default=True)),
    # seconds between progress lines when there are no bars (stderr not a terminal); None: no
    # lines (the Python API's default). The command line sets it unless --no-progress.
    ("progress_every", "float | None", field(default=None)),
]


def validate(self: "EvalOptions") -> "EvalOptions":
    """Raise UsageError naming the first bad option and its fix."""
    for name, (flag, allowed) in CHOICES.items():
        value = getattr(self, name)
        if value not in allowed and not (value is None and BY_NAME[name].default is None):
            raise UsageError(f"{flag} {value!r} is not one of {', '.join(allowed)}.")
    check_applies(self.compression, stage="hidden_states", dtype=self.dtype)  # fp8-* on float32 states
    if not isinstance(self.prompts, str) and (
            not self.prompts or not all(isinstance(p, str) and p for p in self.prompts)):
        raise UsageError("--prompts: give a prompt set (e.g. builtin:coding, suite:gsm8k, hf:NAME, or a file).")
    if self.mix is not None:
        from ..suites.sets import parse_mix_form

        parse_mix_form(self.mix)
    if self.eagle_trees:
        from ..drafters.family import eagle_trees

        eagle_trees(self)  # TOPK,STEPS,TOKENS each positive (UsageError otherwise)
    if self.end_rule == "continuation":
        # Refused rather than keyed: it needs the target's greedy tokens past the end of every
        # completion, which no completion source stores yet; accepting it changed the keys and
        # still computed the within-output rule.
        raise UsageError("--end-rule continuation is not available yet: it needs the target's greedy "
                         "continuation past each completion, which dfcache does not store; use "
                         "--end-rule within (the default). docs/metrics.md describes both rules.")
    for flag, value in (("--num-prompts", self.num_prompts), ("--max-new-tokens", self.max_new_tokens),
                        ("--max-blocks", self.max_blocks), ("--concurrency", self.concurrency),
                        ("--eagle-steps", self.eagle_steps)):
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


EvalOptions = make_dataclass(
    "EvalOptions", [_field(o) for o in RUN_OPTIONS if o.field] + _STATE, namespace={
        "validate": validate, "__module__": __name__,
        # (given, or dataclasses computes one from the signature: a millisecond of a cached run)
        "__doc__": "A run's options: a field per option of RUN_OPTIONS (its name), and the run's offline, json "
                   "and progress settings."})
del validate


def option_names() -> list[str]:
    """The Python API's option keywords: every EvalOptions field."""
    return [f.name for f in fields(EvalOptions)]


def default_of(name: str):
    f = next(f for f in fields(EvalOptions) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def run_argv(upto: str, given: Mapping[str, object] | Iterable[tuple[str, object]], *, before: Iterable[str] = (),
             after: Iterable[str] = (), command: str = "run") -> list[str]:
    """A ``run`` command line, as "produce it with: dfcache ..." messages name it: ``before`` (global
    options given before the command), ``run UPTO``, the options in ``given`` (name -> value, the
    ones to spell) in :data:`RUN_OPTIONS` order, then ``after``. The command line, the cached-run
    fast path and the Python API all rebuild their commands with it."""
    values = dict(given.items() if isinstance(given, Mapping) else given)
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ValueError(f"not options of run: {unknown}")
    args = [*before, command, upto]
    for o in RUN_OPTIONS:
        if o.name in values:
            args += o.spell(values[o.name])
    return args + list(after)


def markdown_tables() -> str:
    """docs/cli.md's option tables of `dfcache run|plan`: one per group."""
    out = []
    for group, title in GROUPS.items():
        out += [f"**{title}**", "", "| option | default | key material of | |", "|---|---|---|---|"]
        for o in RUN_OPTIONS:
            if o.group != group:
                continue
            spelled = " / ".join(f"`{f}`" for f in (*o.flags, *((o.off,) if o.off else ())))
            if o.shown_metavar:
                spelled += f" {o.shown_metavar}".replace("|", "\\|")
            if o.repeat:
                spelled += " ..."
            default = "" if o.default is None or o.default is False or o.default == () else f"`{_spell_value(o.default)}`"
            out.append(f"| {spelled} | {default} | {', '.join(o.keys) or '(none)'} | {o.help.replace('|', '/')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":  # python -m runner.core.options: the tables for docs/cli.md
    print(markdown_tables(), end="")
