"""Stage `tokens`: prompt + completion token ids of every sample, as the target sees them.

Key recipe (per sample; ``KEY`` below, ``build()`` makes its nodes through it)::

    partition = compute_key('tokens', 2, inputs, upstream)
    sample    = sample_key(partition, completions sample key)
    inputs:
        target           fingerprint of the target directory
        tokenizer        xxh3_128 over the tokenizer files' names and contents
        chat_template    xxh3_128 of the chat template text
        enable_thinking  bool
    upstream:
        sample           the completions partition

Prompt ids: ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
enable_thinking=...)``, then the tokenizer on that text without added special tokens (the
template holds them). Completion ids: as the completion gives them (server or local ids), else
the completion text retokenized the same way, plus the first end-of-sequence id when the
completion finished with "stop" (a greedy generation ends with its stop token; a server's text
drops it), and checked (runner/stages/completions/ids.py: the count against the server's
``usage.completion_tokens``, the round trip, no U+FFFD; a reasoning parser's split put back
together in the chat template's form first).

Retokenization stays here, the check is made in both stages: the completions stage checks (and
refuses) before it caches an answer, this stage checks again when it makes the ids, which also
covers text-only completions cached before checks existed. A sample whose check fails gets no
tokens (the others do) and the run ends with exit 6 naming it, unless ``--accept-retokenized``
keeps it with the failed check recorded. ``check_use`` makes the same decision for a run that
computes hidden states or evals from stored tokens: the verdict is each run's, never stored.

Output, per sample: array ``ids`` (int32, prompt then completion) and the document
``{"finish_reason", "tokens_source", "eos_appended", "prompt_len", "completion_len"}``, plus
``ids_check`` for retokenized ids (``{"ok", "ids", "server_count", "round_trip", "problem",
"replacement_chars", "reasoning_put_back"}``, facts only): what ``runner.core.completion_source.label_of``
reads to label a report row.

Imported samples (`dfcache import`, runner/peers/imports.py) are tokens samples too, of a root
partition (inputs as above plus ``imported``, no upstream; a sample named by the digest of its
ids and loss mask) with one more array, ``loss_mask`` int8 (the peer's own mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dfcache.errors import BadInputError

from ..core.graph import KeyRecipe, Node, RunContext, TokensSpec
from ..core.summaries import samples_origin
from ..models.resolve import check_chat_template, resolved_target

if TYPE_CHECKING:  # numpy is imported where arrays are made: planning a cached graph needs none
    import numpy as np

KEY = KeyRecipe("tokens", 2, inputs={
    "target": "fingerprint of the target directory",
    "tokenizer": "xxh3_128 over the tokenizer files' names and contents",
    "chat_template": "xxh3_128 of the chat template text",
    "enable_thinking": "bool",
}, upstream={"sample": "the completions partition"}, sample="completions sample key")
NAME = KEY.stage
VERSION = KEY.version


def build(ctx: RunContext, completions_node: Node) -> Node:
    opts = ctx.options
    target = resolved_target(ctx)
    inputs = {"target": target.fingerprint, "tokenizer": target.tokenizer_fingerprint,
              "chat_template": target.chat_template_hash, "enable_thinking": bool(opts.enable_thinking)}
    return KEY.samples(inputs=inputs, upstream_samples=completions_node.sample_keys,
                       upstream_bytes=completions_node.sample_key_bytes,
                       partition_upstream={"sample": completions_node.partition.key}, ids=completions_node.ids,
                       needs="cpu", deps=[completions_node], label="tokens",
                       precheck=lambda: check_chat_template(target.dir),  # before any work, if it renders
                       spec=TokensSpec(target_dir=str(target.dir), completions=completions_node,
                                       prompts=completions_node.spec.prompts),
                       summary=f"prompt + completion ids ({completions_node.label or 'completions'})")


COMMIT_EVERY = 4096


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    import numpy as np

    from dfcache.samples import SampleArray, SampleSet, SampleSink

    from .completions.ids import rebuild, refusal, stop_ids
    from .completions.sources import encode_prompt, load_tokenizer
    from . import prompts as prompts_stage

    accept = bool(ctx.options.accept_retokenized)
    for node in nodes:
        todo = node.positions_distinct(node.produce)
        if not todo:
            continue
        target_dir = node.spec.target_dir
        comps_node = node.spec.completions
        messages = prompts_stage.read_messages(ctx.store, node.spec.prompts, todo)
        comps = SampleSet(ctx.store, comps_node.partition.key, [comps_node.sample_keys[i] for i in todo]).docs()
        tok = load_tokenizer(target_dir, ctx.cache)
        eos = stop_ids(target_dir, tok)
        enable_thinking = bool(node.inputs["enable_thinking"])
        refused: list[dict] = []
        with SampleSink(ctx.store, node.partition, arrays={"ids": SampleArray((), "int32")},
                        summary=f"ids of {samples_origin(ctx.store, comps_node)}", max_samples=COMMIT_EVERY) as sink:
            for i, msgs, c in zip(todo, messages, comps):
                p_ids = encode_prompt(tok, msgs, enable_thinking)
                eos_appended = False
                doc = {}
                if c.get("token_ids") is not None:
                    c_ids = list(c["token_ids"])
                else:
                    r = rebuild(tok, eos, msgs, enable_thinking, c)
                    if r.problem is not None and not (r.acceptable and accept):
                        refused.append({"id": node.ids[i], "problem": r.problem, "acceptable": r.acceptable})
                        continue
                    c_ids, eos_appended = r.ids, r.eos_appended
                    doc["ids_check"] = r.check
                if not c_ids:
                    raise BadInputError(f"the completion of prompt {node.ids[i]!r} has no tokens; delete its "
                                        f"completions (dfcache gc) and produce them again.")
                ids = np.asarray(p_ids + c_ids, dtype=np.int64)
                if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
                    raise BadInputError(f"token ids of prompt {node.ids[i]!r} fall outside int32; the completion "
                                        "is corrupt.")
                sink.add(node.upstream_samples[i], {"ids": ids.astype(np.int32)},
                         {"finish_reason": c["finish_reason"], "tokens_source": c["tokens_source"],
                          "eos_appended": eos_appended, "prompt_len": len(p_ids), "completion_len": len(c_ids),
                          **doc})
        if refused:  # after the sink committed every sample that passed
            raise refusal(refused, total=len(todo), stage="tokens")


def check_use(ctx: RunContext, node: Node, positions: list[int]) -> None:
    """Before a stage computes from this tokens node's samples at ``positions``: refuse retokenized
    ids that are not verified (a failed check, or made before checks existed) unless this run
    passes ``--accept-retokenized``. The decision is the run's (the option is no key input), so a
    store holding samples that an earlier run accepted does not make a later run accept them.
    Reads the samples' documents only, which the consuming stage reads anyway."""
    if ctx.options.accept_retokenized or not positions or node.partition is None:
        return
    from dfcache.samples import SampleSet

    from .completions.ids import refusal

    positions = node.positions_distinct(positions)
    docs = SampleSet(ctx.store, node.partition.key, [node.sample_keys[i] for i in positions]).docs()
    refused = []
    for i, d in zip(positions, docs):
        if not isinstance(d, dict) or d.get("tokens_source") != "retokenized":
            continue  # server, local, imported ids
        check = d.get("ids_check")
        if isinstance(check, dict) and check.get("ok"):
            continue
        problem = check.get("problem") if isinstance(check, dict) else None
        refused.append({"id": node.ids[i], "acceptable": True,
                        "problem": problem or "ids rebuilt from text before dfcache checked them (no check recorded)"})
    if refused:
        raise refusal(refused, total=len(positions), stage="use")


@dataclass
class Tokens:
    """The token ids of a prompt set. Sample i is ``token_ids[offsets[i]:offsets[i+1]]``,
    its first ``prompt_lens[i]`` ids being the prompt."""

    token_ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, n+1
    prompt_lens: np.ndarray  # int32, n
    completion_lens: np.ndarray  # int32, n
    sample_ids: list[str]
    finish_reasons: list[str]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def sample(self, i: int) -> np.ndarray:
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

    def prompt(self, i: int) -> np.ndarray:
        return self.sample(i)[: self.prompt_lens[i]]

    def completion(self, i: int) -> np.ndarray:
        return self.sample(i)[self.prompt_lens[i]:]


def read_tokens(store, node: Node, positions=None) -> Tokens:
    """The tokens of a tokens node's samples at ``positions`` (default: the whole set, in order)."""
    import numpy as np

    from dfcache.samples import SampleSet

    positions = list(range(len(node.sample_keys))) if positions is None else list(positions)
    ss = SampleSet(store, node.partition.key, [node.sample_keys[i] for i in positions])
    ids = ss.read_many("ids")
    docs = ss.docs()
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids])
    return Tokens(token_ids=np.concatenate(ids) if ids else np.zeros(0, np.int32), offsets=offsets,
                  prompt_lens=np.asarray([d["prompt_len"] for d in docs], dtype=np.int32),
                  completion_lens=np.asarray([d["completion_len"] for d in docs], dtype=np.int32),
                  sample_ids=[node.ids[i] for i in positions], finish_reasons=[d["finish_reason"] for d in docs])
