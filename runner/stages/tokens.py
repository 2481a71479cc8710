"""Stage `tokens`: prompt + completion token ids of every sample, as the target sees them.

Key recipe (``KEY`` below; ``build()`` makes its nodes through it)::

    key = compute_key('tokens', 1, inputs, upstream)
    inputs:
        target           fingerprint of the target directory
        tokenizer        xxh3_128 over the tokenizer files' names and contents
        chat_template    xxh3_128 of the chat template text
        enable_thinking  bool
    upstream:
        completions      the completions key

Prompt ids: ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
enable_thinking=...)``, then the tokenizer on that text without added special tokens (the
template holds them). Completion ids: as the completions artifact gives them (server or local
ids), else the completion text retokenized the same way, plus the first end-of-sequence id when
the completion finished with "stop" (a greedy generation ends with its stop token; a server's
text drops it).

Output (one artifact):
    array ``token_ids``       int32, every sample's prompt then completion, concatenated
    array ``offsets``         int64, n+1: sample i is ``token_ids[offsets[i]:offsets[i+1]]``
    array ``prompt_lens``     int32, n
    array ``completion_lens`` int32, n
    document ``samples``      ``[{"id", "finish_reason", "tokens_source", "eos_appended",
                                 "prompt_len", "completion_len"}]``

Imported sets (`dfcache import`, runner/imports.py) are tokens artifacts too, with an
``imported`` input (the ids' digest) instead of an upstream, and one more array, ``loss_mask``
int8 (the peer's own mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dfcache.errors import BadInputError

from ..graph import KeyRecipe, Node, RunContext
from ..summaries import completions_origin
from ..models.resolve import eos_token_ids, resolved_target

KEY = KeyRecipe("tokens", 1, inputs={
    "target": "fingerprint of the target directory",
    "tokenizer": "xxh3_128 over the tokenizer files' names and contents",
    "chat_template": "xxh3_128 of the chat template text",
    "enable_thinking": "bool",
}, upstream={"completions": "the completions key"})
NAME = KEY.stage
VERSION = KEY.version


def build(ctx: RunContext, completions_node: Node) -> Node:
    opts = ctx.options
    target = resolved_target(ctx)
    inputs = {"target": target.fingerprint, "tokenizer": target.tokenizer_fingerprint,
              "chat_template": target.chat_template_hash, "enable_thinking": bool(opts.enable_thinking)}
    return KEY.node(inputs=inputs, upstream={"completions": completions_node.key},
                     needs="cpu", deps=[completions_node], label="tokens",
                     payload={"target_dir": str(target.dir),
                              "prompts_key": completions_node.upstream.get("prompts")},
                     summary=f"prompt + completion ids ({completions_node.label or 'completions'})")


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    from .completions.sources import encode_prompt, load_tokenizer
    from . import completions as completions_stage
    from . import prompts as prompts_stage

    for node in nodes:
        target_dir = node.payload["target_dir"]
        ckey = node.upstream["completions"]
        pkey = node.payload.get("prompts_key") or ctx.store.manifest(ckey).upstream["prompts"]
        records = prompts_stage.read_records(ctx.store, pkey)
        comps = completions_stage.read_completions(ctx.store, ckey)
        if len(comps) != len(records):
            raise BadInputError(f"completions {ckey} has {len(comps)} samples but prompts {pkey} has "
                                f"{len(records)}; delete the completions artifact and run again.")
        tok = load_tokenizer(target_dir, ctx.cache)
        eos = eos_token_ids(target_dir) or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        enable_thinking = bool(node.inputs["enable_thinking"])
        pieces, prompt_lens, comp_lens, samples = [], [], [], []
        for rec, c in zip(records, comps):
            p_ids = encode_prompt(tok, rec["messages"], enable_thinking)
            eos_appended = False
            if c.token_ids is not None:
                c_ids = list(c.token_ids)
            else:
                c_ids = list(tok(c.text, add_special_tokens=False)["input_ids"])
                if c.finish_reason == "stop" and eos and (not c_ids or c_ids[-1] not in eos):
                    c_ids.append(int(eos[0]))
                    eos_appended = True
            if not c_ids:
                raise BadInputError(f"completion {c.index} ({c.id!r}) of {ckey} has no tokens; delete "
                                    "that artifact and produce it again.")
            pieces.append(np.asarray(p_ids + c_ids, dtype=np.int64))
            prompt_lens.append(len(p_ids))
            comp_lens.append(len(c_ids))
            samples.append({"id": c.id, "finish_reason": c.finish_reason, "tokens_source": c.tokens_source,
                            "eos_appended": eos_appended, "prompt_len": len(p_ids),
                            "completion_len": len(c_ids)})
        ids = np.concatenate(pieces)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise BadInputError(f"token ids of {ckey} fall outside int32; the completions are corrupt.")
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(p) for p in pieces])
        with ctx.store.writer(node.key, stage=NAME, stage_version=VERSION, inputs=node.inputs,
                              upstream=node.upstream, summary=f"ids of {completions_origin(ctx.store, ckey)}") as w:
            w.write_array("token_ids", ids.astype(np.int32))
            w.write_array("offsets", offsets)
            w.write_array("prompt_lens", np.asarray(prompt_lens, dtype=np.int32))
            w.write_array("completion_lens", np.asarray(comp_lens, dtype=np.int32))
            w.put_json("samples", samples)


@dataclass
class Tokens:
    """The token ids of a tokens artifact. Sample i is ``token_ids[offsets[i]:offsets[i+1]]``,
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


def read_tokens(store, key: str) -> Tokens:
    art = store.open(key)
    samples = art.json("samples")
    return Tokens(token_ids=art.array("token_ids").read(), offsets=art.array("offsets").read(),
                  prompt_lens=art.array("prompt_lens").read(),
                  completion_lens=art.array("completion_lens").read(),
                  sample_ids=[s["id"] for s in samples], finish_reasons=[s["finish_reason"] for s in samples])
