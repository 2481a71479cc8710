"""Bad input through the command line: one table of cases, each run as `dfcache ...` in its own
process against a copy of a store holding prompts, completions and tokens.

Every case must give: the exit code DESIGN §7 assigns (0 ok, 1 internal, 2 usage, 3 offline-missing,
4 network, 5 integrity, 6 bad input), one `error:` line (a click usage error prints its own
`Error:` block), no traceback, the words that name what is wrong, and an unchanged store (the
listing of artifacts/ before and after). Where a code is a decision, docs/reliability.md says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from rel_helpers import MAX_NEW, NUM_PROMPTS, artifacts_listing, copy_store, has_stage
from servers import ClosedPort, ScriptedServer, SilentListener

from dfcache.errors import (EXIT_BAD_INPUT, EXIT_INTEGRITY, EXIT_NETWORK, EXIT_OFFLINE_MISSING, EXIT_OK,
                            EXIT_USAGE)

DEAD = "http://127.0.0.1:9"
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "reliability", "AWS_SECRET_ACCESS_KEY": "reliability", "AWS_REGION": "us-east-1"}


@dataclass
class Ctx:
    store: Path
    tmp: Path
    target: str
    url: str = DEAD
    files: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)  # the base store's artifacts, by stage

    def run(self, stage: str, *extra, target: str | None = None, url: str | None = None, max_new: int = MAX_NEW,
            prompts: int = NUM_PROMPTS) -> list:
        return ["run", stage, "--target", target or self.target, "--server", url or self.url, "--num-prompts", prompts,
                "--max-new-tokens", max_new, *extra]


@dataclass
class Case:
    id: str
    code: int
    words: list[str]
    argv: Callable[[Ctx], list]
    setup: Callable[[Ctx], None] | None = None
    server: str | None = None  # a ScriptedServer chat mode, or "closed", "silent", "loading"
    needs: str | None = None  # a runner stage module this case needs
    heavy: bool = False  # loads torch (run in the fork server that has it imported)
    env: dict | None = None
    xfail: str | None = None  # a known gap, reported, not fixed here
    absent: list[str] = field(default_factory=list)  # words the message must not contain


def prompt_file(text: str | bytes) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        p = ctx.tmp / "prompts.jsonl"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        ctx.files["prompts"] = p
    return setup


def model_dir(keep: tuple[str, ...] = (), config: bytes | None = None) -> Callable[[Ctx], None]:
    """A copy of the tiny target with only the files in ``keep`` (and a replaced config)."""
    def setup(ctx: Ctx) -> None:
        d = ctx.tmp / "model"
        d.mkdir()
        for f in Path(ctx.target).iterdir():
            if f.name in keep:
                shutil.copy(f, d / f.name)
        if config is not None:
            (d / "config.json").write_bytes(config)
        ctx.files["model"] = d
    return setup


def drafter(edit: Callable[[dict], None] = lambda cfg: None, weights: Callable[[Path], None] | None = None
            ) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        from runner.models.train_tiny import make_untrained_drafter

        d = ctx.tmp / "drafter"
        make_untrained_drafter(Path(ctx.target), d, seed=1)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        if weights is not None:
            weights(d / "model.safetensors")
        ctx.files["drafter"] = d
    return setup


def truncate(f: Path) -> None:
    """A download or copy that stopped half-way."""
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def overwrite(f: Path) -> None:
    f.write_bytes(b"<html>404 Not Found</html>\n" * 10)


def model_with(keep: tuple[str, ...], weights: Callable[[Path], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        model_dir(keep)(ctx)
        weights(ctx.files["model"] / "model.safetensors")
    return setup


TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")
P = "{prompts}"


def _no_layer_ids(cfg: dict) -> None:
    cfg.get("dflash_config", {}).pop("target_layer_ids", None)


def _other_hidden(cfg: dict) -> None:
    cfg["hidden_size"] = cfg.get("hidden_size", 128) * 2


def _layer_past_the_end(cfg: dict) -> None:
    cfg["dflash_config"]["target_layer_ids"] = [1, 6]


def a_file(name: str = "store-file") -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        (ctx.tmp / name).write_text("not a store\n")
    return setup


def pulled_without_upstream(ctx: Ctx) -> None:
    """An artifact whose upstream is not in the store, as `pull --no-upstream` or `gc --force` leave it."""
    from dfcache.keys import compute_key
    from dfcache.store import open_store

    gone = "ab" * 16
    key = compute_key("evaluation", 1, {}, {"states": gone})
    with open_store(ctx.store).writer(key, stage="evaluation", stage_version=1, inputs={},
                                      upstream={"states": gone}) as w:
        w.put_json("summary", {"tau": 2.5})


def a_dir_or_fifo(kind: str) -> Callable[[Ctx], None]:
    """A prompt path that is not a regular file: a directory, or a FIFO (opening a FIFO for reading
    waits for a writer forever; the run must say what it is, not hang)."""
    def setup(ctx: Ctx) -> None:
        p = ctx.tmp / "prompts.jsonl"
        p.mkdir() if kind == "dir" else os.mkfifo(p)
        ctx.files["prompts"] = p
    return setup


def drafter_config(raw: bytes) -> Callable[[Ctx], None]:
    """A drafter whose config.json is replaced by ``raw`` (weights left as they are)."""
    def setup(ctx: Ctx) -> None:
        drafter()(ctx)
        (ctx.files["drafter"] / "config.json").write_bytes(raw)
    return setup


def chat_template(text: str) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        model_dir(TARGET_FILES + ("model.safetensors",))(ctx)
        (ctx.files["model"] / "chat_template.jinja").write_text(text)
    return setup


def _mask_outside_vocab(cfg: dict) -> None:
    cfg["dflash_config"]["mask_token_id"] = 100000  # the tiny target has 512 ids


def only_role(*roles: str) -> str:
    msgs = [{"role": r, "content": f"a {r} turn"} for r in roles]
    return json.dumps({"id": "p0", "messages": msgs}) + "\n"


SIX = "".join(f'{{"id": "p{i}", "prompt": "question {i}"}}\n' for i in range(6))
FILE_STORE = "{tmp}/store-file is a file, not a directory"


CASES = [
    # ---- prompt files (exit 6: bad input), checked before anything runs
    Case("prompts: malformed JSON line", EXIT_BAD_INPUT, [f"{P}:2", "not valid JSON"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         prompt_file('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "unterminated\n')),
    Case("prompts: a line that is not an object", EXIT_BAD_INPUT, [f"{P}:1", "JSON object"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file('["a", "b"]\n')),
    Case("prompts: missing id", EXIT_BAD_INPUT, [f"{P}:1", '"id"'],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file('{"prompt": "hi"}\n')),
    Case("prompts: duplicate ids", EXIT_BAD_INPUT, [f"{P}:3", "duplicate id 'a'", "line 1"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         prompt_file('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')),
    Case("prompts: a lone UTF-16 surrogate escape", EXIT_BAD_INPUT, [f"{P}:2", "surrogate", "fix or drop"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         prompt_file('{"id": "a", "prompt": "ok \\ud83d\\ude00"}\n{"id": "b", "prompt": "hi \\ud800 x"}\n')),
    Case("prompts: empty file", EXIT_BAD_INPUT, [P, "empty"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file("")),
    Case("prompts: blank lines only", EXIT_BAD_INPUT, [P, "empty"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file("\n   \n\n")),
    Case("prompts: messages of the wrong shape", EXIT_BAD_INPUT, [f"{P}:1", '"messages"'],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         prompt_file('{"id": "a", "messages": [{"role": "user"}]}\n')),
    Case("prompts: not UTF-8", EXIT_BAD_INPUT, [P, "UTF-8"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file(b'{"id": "a", "prompt": "\xff\xfe"}\n')),
    Case("prompts: file does not exist", EXIT_BAD_INPUT, ["{tmp}/nope.jsonl", "does not exist"],
         lambda c: ["run", "prompts", "--prompts", c.tmp / "nope.jsonl"]),
    Case("prompts: unknown built-in set", EXIT_BAD_INPUT, ["builtin:nope", "builtin:coding"],
         lambda c: ["run", "prompts", "--prompts", "builtin:nope"]),
    Case("prompts: --num-prompts 0", EXIT_USAGE, ["--num-prompts 0", "positive number"],
         lambda c: ["run", "prompts", "--num-prompts", "0"]),
    Case("prompts: a line nested 100,000 brackets deep", EXIT_BAD_INPUT, [f"{P}:2", "nested too deeply"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         prompt_file('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n"),
         absent=["RecursionError", "internal error"]),
    Case("prompts: messages with only a system turn", EXIT_BAD_INPUT, [f"{P}:1", 'no "user" turn', "roles: system"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file(only_role("system"))),
    Case("prompts: messages with only an assistant turn", EXIT_BAD_INPUT, [f"{P}:1", 'no "user" turn'],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file(only_role("assistant"))),
    Case("prompts: a role that is no role (wizard)", EXIT_BAD_INPUT, [f"{P}:1", "unknown role 'wizard'", "user"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], prompt_file(only_role("user", "wizard"))),
    Case("prompts: the path is a directory", EXIT_BAD_INPUT, [f"prompt file {P} is a directory"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"]], a_dir_or_fifo("dir"), absent=["does not exist"]),
    Case("prompts: the path is a FIFO (never opened, never waited on)", EXIT_BAD_INPUT,
         [f"prompt file {P} is a FIFO"], lambda c: ["run", "prompts", "--prompts", c.files["prompts"]],
         a_dir_or_fifo("fifo"), absent=["does not exist"]),
    Case("prompts: --num-prompts past the end of the set", EXIT_BAD_INPUT,
         ["--num-prompts 99", f"{P} holds only 6 prompt(s)", "--num-prompts 6 or fewer"],
         lambda c: ["run", "prompts", "--prompts", c.files["prompts"], "--num-prompts", "99"], prompt_file(SIX)),
    # ---- layer ids (exit 6), checked when the graph is built, before any work
    Case("layers: id past the last layer", EXIT_BAD_INPUT, ["layer id 6 is out of range", "ids 0..5", "--layer,"],
         lambda c: c.run("hidden-states", "--offline", "--layer", "1", "--layer", "6"), needs="hidden_states",
         absent=["--layers"]),
    Case("layers: run hidden-states --drafter takes the drafter's target_layer_ids", EXIT_BAD_INPUT,
         ["layer id 6 is out of range", "target_layer_ids"],
         lambda c: c.run("hidden-states", "--offline", "--drafter", c.files["drafter"]), drafter(_layer_past_the_end),
         needs="hidden_states", absent=["no hidden-state layers requested"]),
    Case("layers: negative id", EXIT_BAD_INPUT, ["layer id -1 is out of range"],
         lambda c: c.run("hidden-states", "--offline", "--layer", "-1"), needs="hidden_states"),
    Case("layers: none requested", EXIT_BAD_INPUT, ["no hidden-state layers requested", "--layer (repeatable"],
         lambda c: c.run("hidden-states", "--offline"), needs="hidden_states", absent=["--layers"]),
    Case("layers: not an integer", EXIT_USAGE, ["'--layer'", "valid integer"],
         lambda c: c.run("hidden-states", "--offline", "--layer", "one")),
    # ---- the target model (exit 6)
    Case("target: directory does not exist", EXIT_BAD_INPUT, ["{tmp}/no-such-model", "does not exist"],
         lambda c: c.run("tokens", "--offline", target=str(c.tmp / "no-such-model"))),
    Case("target: empty directory", EXIT_BAD_INPUT, ["{tmp}/model", "no model files"],
         lambda c: c.run("tokens", "--offline", target=str(c.files["model"])), model_dir(())),
    Case("target: a file, not a directory", EXIT_BAD_INPUT, ["is a file"],
         lambda c: c.run("tokens", "--offline", target=str(Path(c.target) / "config.json"))),
    Case("target: config.json is not JSON", EXIT_BAD_INPUT, ["{tmp}/model/config.json", "not valid JSON"],
         lambda c: c.run("hidden-states", "--offline", "--layer", "1", target=str(c.files["model"])),
         model_dir(TARGET_FILES + ("model.safetensors",), config=b"{not json"), needs="hidden_states"),
    Case("target: config.json is a JSON array", EXIT_BAD_INPUT, ["{tmp}/model/config.json is a JSON array",
                                                                   "not an object"],
         lambda c: c.run("tokens", "--offline", target=str(c.files["model"])),
         model_dir(TARGET_FILES + ("model.safetensors",), config=b"[1, 2, 3]\n"), absent=["internal error"]),
    Case("target: chat template with a syntax error, checked before any work", EXIT_BAD_INPUT,
         ["chat template of {tmp}/model has a syntax error", "line 1", "chat_template.jinja"],
         lambda c: ["run", "completions", "--target", c.files["model"], "--completions", "local",
                    "--num-prompts", "2", "--max-new-tokens", "4"], chat_template("{% if %}hello{% endif %}"),
         absent=["TemplateSyntaxError", "internal error"]),
    Case("target: --max-new-tokens past its context window", EXIT_BAD_INPUT,
         ["--max-new-tokens 5000", "context window (4096 tokens", "below 4096"],
         lambda c: ["run", "completions", "--target", c.target, "--completions", "local", "--num-prompts", "2",
                    "--max-new-tokens", "5000"]),
    Case("target: no tokenizer", EXIT_BAD_INPUT, ["{tmp}/model", "no tokenizer files"],
         lambda c: c.run("tokens", "--offline", target=str(c.files["model"])),
         model_dir(("config.json", "model.safetensors", "chat_template.jinja"))),
    Case("target: no weights, local completions", EXIT_BAD_INPUT, ["{tmp}/model", "has no weights"],
         lambda c: ["run", "completions", "--target", c.files["model"], "--completions", "local",
                    "--num-prompts", "2", "--max-new-tokens", "4"], model_dir(TARGET_FILES)),
    Case("target: tokenizer_config.json without tokenizer.json", EXIT_BAD_INPUT,
         ["{tmp}/model has tokenizer_config.json but no tokenizer.json", "copy tokenizer.json"],
         lambda c: ["run", "completions", "--target", c.files["model"], "--completions", "local",
                    "--num-prompts", "2", "--max-new-tokens", "4"],
         model_dir(("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja",
                    "model.safetensors"))),
    Case("target: truncated model.safetensors, local completions", EXIT_BAD_INPUT,
         ["{tmp}/model/model.safetensors is not a valid safetensors file", "truncated", "re-download"],
         lambda c: ["run", "completions", "--target", c.files["model"], "--completions", "local",
                    "--num-prompts", "2", "--max-new-tokens", "4"],
         model_with(TARGET_FILES + ("model.safetensors",), truncate)),
    # ---- drafters (exit 6)
    Case("drafter: config without target_layer_ids", EXIT_BAD_INPUT, ["target_layer_ids"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]), drafter(_no_layer_ids),
         needs="drafter_eval", heavy=True),
    Case("drafter: hidden size differs from the target's", EXIT_BAD_INPUT, ["hidden"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]), drafter(_other_hidden),
         needs="drafter_eval", heavy=True),
    Case("drafter: truncated model.safetensors, checked before any stage runs", EXIT_BAD_INPUT,
         ["{tmp}/drafter/model.safetensors is not a valid safetensors file", "truncated", "re-download"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]), drafter(weights=truncate),
         needs="drafter_eval"),
    Case("drafter: model.safetensors that is not safetensors", EXIT_BAD_INPUT,
         ["{tmp}/drafter/model.safetensors is not a valid safetensors file", "header length"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]), drafter(weights=overwrite),
         needs="drafter_eval"),
    Case("drafter: config.json is a JSON array", EXIT_BAD_INPUT, ["{tmp}/drafter/config.json", "a JSON array",
                                                                    "not an object"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]), drafter_config(b"[]\n"),
         needs="drafter_eval", absent=["internal error"]),
    Case("drafter: mask_token_id outside the target's vocabulary, refused before any stage runs", EXIT_BAD_INPUT,
         ["mask_token_id 100000 is outside the target's vocabulary", "ids 0..511"],
         lambda c: c.run("eval", "--offline", "--drafter", c.files["drafter"]),
         drafter(_mask_outside_vocab), needs="drafter_eval"),
    Case("drafter: directory does not exist", EXIT_BAD_INPUT, ["{tmp}/no-drafter"],
         lambda c: c.run("eval", "--offline", "--drafter", c.tmp / "no-drafter"), needs="drafter_eval"),
    # ---- the completions server (exit 4): one check up front, no retry loop, nothing cached
    Case("server: HTTP 500", EXIT_NETWORK, ["HTTP 500", "CUDA out of memory (scripted)"],
         lambda c: c.run("tokens", url=c.url, max_new=MAX_NEW + 1), server="500"),
    Case("server: garbage instead of JSON", EXIT_NETWORK, ["not valid JSON"],
         lambda c: c.run("tokens", url=c.url, max_new=MAX_NEW + 1), server="garbage"),
    Case("server: answer times out", EXIT_NETWORK, ["within 1 s", "--request-timeout"],
         lambda c: c.run("tokens", "--request-timeout", "1", url=c.url, max_new=MAX_NEW + 1), server="hang"),
    Case("server: wrong model name", EXIT_NETWORK, ["'not-the-target'", "scripted-model"],
         lambda c: c.run("tokens", "--served-model", "not-the-target", url=c.url, max_new=MAX_NEW + 1), server="ok"),
    Case("server: nothing listens", EXIT_NETWORK, ["connection refused", "--wait-server"],
         lambda c: c.run("tokens", url=c.url, max_new=MAX_NEW + 1), server="closed"),
    Case("server: still loading (503)", EXIT_NETWORK, ["not ready"],
         lambda c: c.run("tokens", url=c.url, max_new=MAX_NEW + 1), server="loading"),
    Case("server: accepts but never answers", EXIT_NETWORK, ["{url}", "readiness check", "--wait-server"],
         lambda c: c.run("tokens", "--request-timeout", "1", url=c.url, max_new=MAX_NEW + 1), server="silent",
         absent=["--request-timeout"]),  # the check's own 10 s, which --request-timeout does not change
    Case("server: missing completions while offline", EXIT_OFFLINE_MISSING, ["offline mode is on", "produce it with"],
         lambda c: c.run("tokens", "--offline", max_new=MAX_NEW + 1)),
    # ---- remotes
    Case("remote: S3 endpoint unreachable (pull)", EXIT_NETWORK, ["s3://bkt/r", "connection refused"],
         lambda c: ["pull", "s3://bkt/r", "--all", "--endpoint-url", c.url], server="closed", env=FAKE_AWS),
    Case("remote: S3 endpoint unreachable (ls --remote)", EXIT_NETWORK, ["s3://bkt/r"],
         lambda c: ["ls", "--remote", "s3://bkt/r", "--endpoint-url", c.url], server="closed", env=FAKE_AWS),
    # A refused endpoint whose port holds "416" once read as an HTTP 416 (an empty object): exit 2,
    # "store format None". Random ports made it a rare flake of the two cases above.
    Case("remote: S3 endpoint unreachable at a port with 416 in it (pull)", EXIT_NETWORK,
         ["s3://bkt/r", "connection refused"],
         lambda c: ["pull", "s3://bkt/r", "--all", "--endpoint-url", c.url], server="closed-416", env=FAKE_AWS,
         absent=["store format"]),
    Case("remote: S3 endpoint unreachable at a port with 416 in it (ls --remote)", EXIT_NETWORK,
         ["s3://bkt/r", "connection refused"],
         lambda c: ["ls", "--remote", "s3://bkt/r", "--endpoint-url", c.url], server="closed-416", env=FAKE_AWS,
         absent=["store format"]),
    Case("remote: file:// remote that does not exist", EXIT_USAGE, ["file://{tmp}/no-remote"],
         lambda c: c.run("tokens", "--remote", f"file://{c.tmp}/no-remote")),
    Case("remote: unsupported scheme", EXIT_USAGE, ["http:// scheme is not supported"],
         lambda c: c.run("tokens", "--remote", "http://example.invalid/x")),
    Case("remote: S3 remote while offline, everything local", EXIT_OK, ["not consulted"],
         lambda c: c.run("tokens", "--offline", "--remote", "s3://bkt/r", "--endpoint-url", DEAD), env=FAKE_AWS),
    # ---- the store and the command line (exit 2)
    Case("store: a directory that is not a store", EXIT_USAGE, ["{tmp}/junk", "not a dfcache store"],
         lambda c: ["--store", c.tmp / "junk", "ls"],
         lambda c: ((c.tmp / "junk").mkdir(), (c.tmp / "junk" / "x.txt").write_text("x"))),
    Case("store: damaged store marker", EXIT_INTEGRITY, ["dfcache-store.json", "damaged"],
         lambda c: ["--store", c.tmp / "broken", "ls"],
         lambda c: (shutil.copytree(c.store, c.tmp / "broken"), (c.tmp / "broken" / "dfcache-store.json").write_text("{"))),
    Case("usage: gc without --dry-run or --yes", EXIT_USAGE, ["--dry-run", "--yes"], lambda c: ["gc"]),
    Case("usage: show with a prefix that is not hex", EXIT_USAGE, ["'zz'"], lambda c: ["show", "zz"]),
    Case("usage: verify a key that is not there", EXIT_USAGE, ["no artifact key starts with 0123"],
         lambda c: ["verify", "0123"]),
    Case("usage: unknown run target", EXIT_USAGE, ["unknown target 'everything'"], lambda c: ["run", "everything"]),
    Case("usage: --max-new-tokens 0", EXIT_USAGE, ["--max-new-tokens 0"], lambda c: c.run("tokens", max_new=0)),
    Case("gc: --key of an artifact that others depend on", EXIT_USAGE,
         ["that others depend on", "{key_completions} is needed by {key_tokens}", "--force"],
         lambda c: ["gc", "--yes", "--key", c.keys["completions"][:12]]),
    # A dry run shows what --force would remove (it used to exit 2 and show nothing) and warns.
    Case("gc: --stage whose artifacts others depend on, dry run", EXIT_OK,
         ["warning: 1 of these artifact(s) are needed by others", "{key_prompts} is needed by {key_completions}",
          "--force"], lambda c: ["gc", "--dry-run", "--stage", "prompts"]),
    Case("gc: --stage whose artifacts others depend on, --yes", EXIT_USAGE,
         ["that others depend on", "{key_prompts} is needed by {key_completions}", "--force"],
         lambda c: ["gc", "--yes", "--stage", "prompts"]),
    Case("usage: --end-rule continuation (not wired: refused before any key)", EXIT_USAGE,
         ["--end-rule continuation is not available yet", "--end-rule within"],
         lambda c: c.run("eval", "--offline", "--end-rule", "continuation")),
    Case("usage: --tree-budget 0", EXIT_USAGE, ["--tree-budget 0"], lambda c: c.run("eval", "--tree-budget", "0")),
    Case("usage: --top-p 5", EXIT_USAGE, ["--top-p 5", "(0, 1]"], lambda c: c.run("tokens", "--top-p", "5")),
    Case("usage: --temperature -1", EXIT_USAGE, ["--temperature -1"], lambda c: c.run("tokens", "--temperature", "-1")),
    Case("usage: --wait-server inf (would wait forever)", EXIT_USAGE, ["--wait-server inf", "finite"],
         lambda c: c.run("tokens", "--wait-server", "inf")),
    Case("usage: --request-timeout nan", EXIT_USAGE, ["--request-timeout nan"],
         lambda c: c.run("tokens", "--request-timeout", "nan")),
    Case("usage: --max-new-tokens 1000000000000", EXIT_USAGE, ["--max-new-tokens 1000000000000", "at most"],
         lambda c: c.run("tokens", max_new=1_000_000_000_000)),
    Case("usage: --revision with a local directory names --revision", EXIT_USAGE,
         ["--revision abc123", "drop --revision"],
         lambda c: c.run("tokens", "--offline", "--revision", "abc123"), absent=["--target-revision"]),
    # ---- a store path that is a file (exit 2), whatever the command and wherever --store stands
    Case("store: a file (ls)", EXIT_USAGE, [FILE_STORE], lambda c: ["--store", c.tmp / "store-file", "ls"], a_file()),
    Case("store: a file (ls --store after the command)", EXIT_USAGE, [FILE_STORE],
         lambda c: ["ls", "--store", c.tmp / "store-file"], a_file()),
    Case("store: a file (verify)", EXIT_USAGE, [FILE_STORE], lambda c: ["verify", "--store", c.tmp / "store-file"],
         a_file()),
    Case("store: a file (gc)", EXIT_USAGE, [FILE_STORE],
         lambda c: ["--store", c.tmp / "store-file", "gc", "--dry-run"], a_file()),
    Case("store: a file (run)", EXIT_USAGE, [FILE_STORE],
         lambda c: ["--store", c.tmp / "store-file", *c.run("tokens", "--offline")], a_file()),
    # ---- a broken chain is a warning, not a failure (docs/reliability.md says why)
    Case("verify: an artifact whose upstream is not in the store", EXIT_OK,
         ["warning: 1 artifact(s) depend on upstream artifacts that are not in this store", "pull --no-upstream"],
         lambda c: ["verify"], pulled_without_upstream),
    # ---- ls filters that can never match (exit 2, with the valid choices)
    Case("ls: --stage that is no stage", EXIT_USAGE, ["--stage 'nonsense'", "hidden_states", "tokens"],
         lambda c: ["ls", "--stage", "nonsense"]),
    Case("ls: --backend that is a device, not a kernel", EXIT_USAGE, ["--backend 'cuda'", "fla, torch"],
         lambda c: ["ls", "--backend", "cuda"]),
]


def _server(kind: str | None):
    if kind is None:
        return None
    if kind == "closed":
        return ClosedPort()
    if kind == "closed-416":
        return ClosedPort(ports=range(41600, 41700))
    if kind == "silent":
        return SilentListener()
    if kind == "loading":
        return ScriptedServer(chat="ok", health="loading").start()
    return ScriptedServer(chat=kind).start()


def staging_listing(store: Path) -> list[str]:
    return sorted(p.name for p in (Path(store) / "staging").iterdir()) if (Path(store) / "staging").is_dir() else []


def check_one_message(r, code: int) -> str:
    err = r.err
    assert "Traceback" not in err, err
    if code == EXIT_OK:
        assert "error" not in err.lower(), err
        return err
    if code == EXIT_USAGE and "Error:" in err and "error:" not in err:  # click's own usage error
        assert err.count("Error:") == 1, err
        return err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and err.count("error:") == 1, f"not one error message:\n{err}"
    return err


def _run_case(case: Case, zygote, heavy_zygote, base_store, tiny_target, tmp_path, extra: tuple = ()):
    """Set the case up, run it (with ``extra`` arguments at the end) and return what it gave."""
    if case.needs and not has_stage(case.needs):
        pytest.skip(f"needs runner/stages/{case.needs}.py (the {case.needs.replace('_', ' ')} stage), not there yet")
    store = copy_store(base_store, tmp_path / "store")
    ctx = Ctx(store=store, tmp=tmp_path, target=str(tiny_target), keys=dict(base_store["keys"]))
    if case.setup:
        case.setup(ctx)
    server = _server(case.server)
    if server is not None:
        ctx.url = server.url
    before = artifacts_listing(store)
    staging_before = staging_listing(store)
    argv = [str(a) for a in case.argv(ctx)] + list(extra)
    if argv[0] != "--store":
        argv = ["--store", str(store), *argv]
    try:
        zyg = heavy_zygote if case.heavy else zygote
        t0 = time.monotonic()
        r = zyg.cli(*argv, env=case.env, timeout=300)
        seconds = time.monotonic() - t0
    finally:
        if server is not None:
            (server.stop if hasattr(server, "stop") else server.close)()
    assert r.code == case.code, f"{case.id}: exit {r.code}, want {case.code}\n{r.err[-3000:]}"
    err = check_one_message(r, case.code)
    fmt = {"tmp": str(tmp_path), "prompts": str(ctx.files.get("prompts")), "url": ctx.url,
           **{f"key_{stage}": key[:12] for stage, key in ctx.keys.items()}}
    for w in case.words:
        w = w.format(**fmt)
        assert w in err, f"{case.id}: {w!r} not in the message:\n{err}"
    for w in case.absent:
        assert w.format(**fmt) not in err, f"{case.id}: {w!r} should not be in the message:\n{err}"
    assert artifacts_listing(store) == before, f"{case.id}: the store changed"
    if case.server is None:  # (a failed generation request may keep resumable progress)
        assert staging_listing(store) == staging_before, f"{case.id}: left {staging_listing(store)} in staging"
    if case.code != EXIT_OK:
        ok = zygote.cli("--store", store, "verify", timeout=120)
        assert ok.code == 0, f"{case.id}: the store does not verify afterwards:\n{ok.err[-2000:]}"
    return r, seconds


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=False)]
                                                 if c.xfail else []) for c in CASES])
def test_bad_input(case: Case, zygote, heavy_zygote, base_store, tiny_target, tmp_path, figures):
    r, seconds = _run_case(case, zygote, heavy_zygote, base_store, tiny_target, tmp_path)
    figures.record("bad_input_cases", **{case.id: {"exit": r.code, "seconds": round(seconds, 2)}})


# One case of every exit code and kind of failure (a stage's error, click's own usage error, the
# store, the network, offline, integrity), run again with --json at the end of the line.
JSON_CASES = ["prompts: malformed JSON line", "layers: not an integer", "usage: unknown run target",
              "store: a file (ls --store after the command)", "server: missing completions while offline",
              "remote: S3 endpoint unreachable (ls --remote)", "store: damaged store marker"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in JSON_CASES], ids=lambda c: c.id)
def test_bad_input_under_json_is_one_object_on_stdout(case: Case, zygote, heavy_zygote, base_store, tiny_target,
                                                      tmp_path):
    r, _ = _run_case(case, zygote, heavy_zygote, base_store, tiny_target, tmp_path, extra=("--json",))
    lines = r.out.splitlines()
    assert len(lines) == 1, f"{case.id}: stdout is not one JSON line:\n{r.out}"
    obj = json.loads(lines[0])
    assert obj["exit_code"] == case.code and obj["error"], obj
    assert obj["error"].splitlines()[0] in r.err  # the same message as the human line
    if case.code == EXIT_OFFLINE_MISSING:
        assert obj["missing"] and obj["missing"][0]["stage"] == "completions", obj


def test_gc_dry_run_lists_what_force_would_remove(zygote, base_store, tmp_path):
    """`gc --dry-run --stage S` of artifacts others depend on exited 2 and listed nothing; it lists
    what `--force` would remove (exit 0), warns which of it others need, and removes nothing."""
    store = copy_store(base_store, tmp_path / "store")
    before = artifacts_listing(store)
    prompts, completions = base_store["keys"]["prompts"], base_store["keys"]["completions"]
    r = zygote.cli("--store", store, "gc", "--dry-run", "--stage", "prompts")
    assert r.code == EXIT_OK, r.err
    assert f"would remove: artifact {prompts}" in r.out and "run with --yes --force to remove" in r.out, r.out
    assert f"{prompts[:12]} is needed by {completions[:12]}" in r.err and "error" not in r.err.lower()
    j = zygote.cli("--store", store, "--json", "gc", "--dry-run", "--stage", "prompts")
    doc = json.loads(j.out)
    assert j.code == EXIT_OK and doc["needed_by"] == {prompts: [completions]}, j.out
    assert [i["name"] for i in doc["items"]] == [prompts] and doc["removed"] == []
    assert artifacts_listing(store) == before


def test_same_answers_through_python_m_dfcache(base_store, env, tmp_path):
    """The table runs `dfcache.cli.main` in forked processes; three cases through the real entry
    point (`python -m dfcache`, fresh interpreter) give the same codes and messages."""
    store = copy_store(base_store, tmp_path / "store")
    before = artifacts_listing(store)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    clean = {k: v for k, v in env.items()}
    for args, code, word in [
        (["run", "prompts", "--prompts", tmp_path / "p.jsonl"], EXIT_BAD_INPUT, "duplicate id 'a'"),
        (["run", "tokens", "--target", tmp_path / "none", "--offline"], EXIT_BAD_INPUT, "does not exist"),
        (["gc"], EXIT_USAGE, "--dry-run"),
    ]:
        r = subprocess.run([sys.executable, "-m", "dfcache", "--store", str(store), *map(str, args)],
                           capture_output=True, text=True, env=clean, timeout=120)
        assert r.returncode == code, r.stderr
        assert "Traceback" not in r.stderr and word in r.stderr and r.stderr.count("error:") == 1
    assert artifacts_listing(store) == before


# ------------------------------------------------------------------------------ a full disk


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or os.environ.get("DFCACHE_RELIABILITY_NO_TMPFS") == "1":  # (the latter tests the fallback)
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not has_stage("hidden_states"), reason="runner/stages/hidden_states/ (the hidden-states "
                    "stage) is not there yet")
def test_full_disk(heavy_zygote, base_store, tmp_path, figures):
    """A store on a nearly full 2 MB tmpfs (or, where mounting is not allowed, a process whose file
    size limit is 16 KB): `run hidden-states` fails with one message (exit 2), commits nothing, and
    leaves no partial artifact; with space again the same command completes."""
    mnt = tmp_path / "mnt"
    mounted = _tmpfs(mnt, "2m")
    try:
        store = copy_store(base_store, mnt / "store")
        args = ["--store", store, "run", "hidden-states", *base_store["args"], "--offline", "--layer", "1",
                "--layer", "3", "--backend", "torch", "--device", "cpu", "--dtype", "float32"]
        if mounted:
            filler = mnt / "filler"
            filler.write_bytes(b"\0" * max(0, shutil.disk_usage(mnt).free - 24 * 1024))
            how, run = "tmpfs", lambda: heavy_zygote.cli(*args, timeout=300)
        else:
            filler = None
            how, run = "RLIMIT_FSIZE", lambda: heavy_zygote.run("children:cli_with_fsize_limit", str(16 * 1024),
                                                                 *map(str, args), timeout=300)
        before = artifacts_listing(store)
        r = run()
        assert r.code == EXIT_USAGE, f"{how}: exit {r.code}\n{r.err[-3000:]}"
        err = check_one_message(r, EXIT_USAGE)
        assert f"into the store {store}" in err and ("No space left" in err or "File too large" in err), err
        assert artifacts_listing(store) == before
        assert not [p for p in (store / "staging").iterdir() if p.name.endswith(".tmp")]
        if filler is not None:
            filler.unlink()
        again = heavy_zygote.cli(*args, "--json", timeout=300)
        assert again.code == 0, again.err
        assert heavy_zygote.cli("--store", store, "verify").code == 0
        figures.record("bad_input_cases", **{f"store: full disk ({how})": {"exit": r.code}})
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_example_built_on_a_full_disk_is_one_clear_error(heavy_zygote, tmp_path, figures):
    """`run eval --example` building its tiny models where the disk is full (a file size limit of
    1 MB: the target's weights are 4 MB) gives exit 2 and one message naming the place, not
    "internal error: SafetensorError" (exit 1); the failed build leaves no temporary directory."""
    store = tmp_path / "store"
    r = heavy_zygote.run("children:cli_with_fsize_limit", str(1 << 20), "--store", str(store), "run", "eval",
                         "--example", "--offline", timeout=300)
    assert r.code == EXIT_USAGE, f"exit {r.code}\n{r.err[-3000:]}"
    err = check_one_message(r, EXIT_USAGE)
    assert f"cannot build the --example models under {store}/example" in err and "File too large" in err, err
    assert "SafetensorError" not in err and "internal error" not in err
    left = [p.name for p in (store / "example").iterdir()] if (store / "example").exists() else []
    assert not [n for n in left if n.endswith((".tmp", ".deleted"))], left
    assert artifacts_listing(store) == []
    figures.record("bad_input_cases", **{"store: --example built on a full disk (RLIMIT_FSIZE)": {"exit": r.code}})


_BUILD = r"""
import os, signal, sys
from pathlib import Path
from runner.models.example import _build_once, _new_build_dir

where = Path(sys.argv[2])
if sys.argv[1] == "killed":  # a build stopped half-way, then SIGKILLed by the test
    def build(d):
        (d / "half.bin").write_bytes(b"x" * 1000)
        os.write(1, b"building\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    _build_once(where / "drafter-trained", build)
else:  # a live build: holds its directory's lock until its stdin closes
    tmp, fd = _new_build_dir(where / "drafter-untrained")
    os.write(1, (str(tmp) + "\n").encode())
    sys.stdin.read()
"""


def test_a_killed_example_build_is_cleaned_by_the_next_build_and_a_live_one_is_not(env, tmp_path):
    """A build killed half-way leaves `example/.drafter-trained.*.tmp/`; the next build removes it
    (it holds no lock), never the directory of a build still running (it holds its lock), and
    builds its own model."""
    from runner.models.example import DONE, _build_once

    where = tmp_path / "example"
    killed = subprocess.Popen([sys.executable, "-c", _BUILD, "killed", str(where)], stdout=subprocess.PIPE,
                              env=env, text=True)
    assert killed.stdout.readline() == "building\n"
    killed.kill()
    killed.wait(60)
    stale = [p for p in where.iterdir() if p.name.startswith(".drafter-trained.") and p.name.endswith(".tmp")]
    assert len(stale) == 1 and (stale[0] / "half.bin").exists()
    live = subprocess.Popen([sys.executable, "-c", _BUILD, "live", str(where)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        live_dir = Path(live.stdout.readline().strip())
        assert live_dir.is_dir()
        _build_once(where / "drafter-trained", lambda d: (d / "model.bin").write_bytes(b"ok"))
        assert (where / "drafter-trained" / DONE).exists() and (where / "drafter-trained" / "model.bin").exists()
        assert not stale[0].exists(), "the killed build's temporary directory is still there"
        assert live_dir.is_dir(), "a live build's directory was removed"
        assert [p.name for p in where.iterdir() if p.name.endswith(".deleted")] == []
    finally:
        live.stdin.close()
        live.wait(60)


# ------------------------------------------------------------------------------ Ctrl-C


N_SIGINT = 18


def test_sigint_mid_run_exits_130_keeps_progress_and_resumes(base_store, env, tmp_path, figures):
    """SIGINT to `dfcache run` while completions stream in: exit 130 with one message, every
    committed artifact kept, and the same command then requests only the prompts not yet saved."""
    store = copy_store(base_store, tmp_path / "store")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(N_SIGINT)))
    before = artifacts_listing(store)
    # The server holds every request after the sixth: the interrupt comes while the seventh is in
    # flight, however loaded the machine (six answers committed, twelve to go).
    with ScriptedServer(chat="ok", hold_after=N_SIGINT // 3) as server:
        args = [sys.executable, "-m", "dfcache", "--store", str(store), "run", "completions", "--target",
                str(base_store["args"][1]), "--server", server.url, "--prompts", str(prompts), "--concurrency", "1",
                "--max-new-tokens", "4"]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 300
        while server.count("POST", "/v1/chat/completions") <= N_SIGINT // 3 and time.monotonic() < deadline:
            assert p.poll() is None, p.communicate()
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        first = server.count("POST", "/v1/chat/completions")
        server.released.set()  # the next run is answered at once
        assert p.returncode == 130, err
        assert "Traceback" not in err and "interrupted" in err and "run the same command again" in err, err
        after = artifacts_listing(store)
        assert set(before) <= set(after), "a committed artifact was lost"
        new = {line.split("/")[1] for line in set(after) - set(before) if line.count("/") == 1}
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        second = server.count("POST", "/v1/chat/completions") - first
    assert r.returncode == 0, r.stderr
    assert re.search(r"completions: [1-9][0-9]* of %d already stored" % N_SIGINT, r.stderr), r.stderr
    assert second < N_SIGINT and first + second <= N_SIGINT + 1, (first, second)  # the one in flight may repeat
    figures.record("bad_input_cases", **{"interrupted: SIGINT mid-run": {
        "exit": 130, "requests_before": first, "requests_after_resume": second, "new_artifacts": len(new)}})


@pytest.mark.skipif(not has_stage("hidden_states"), reason="runner/stages/hidden_states/ (the hidden-states "
                    "stage) is not there yet")
def test_sigint_mid_hidden_states_resumes(heavy_zygote, base_store, tmp_path, figures):
    """SIGINT once extraction has committed a segment: exit 130, every committed segment kept,
    and the rerun computes only the samples still missing."""
    store = copy_store(base_store, tmp_path / "store")
    before = artifacts_listing(store)
    args = ["--store", store, "run", "hidden-states", *base_store["args"], "--offline", "--layer", "2",
            "--backend", "torch", "--device", "cpu", "--dtype", "float32", "--batch-tokens", "24"]
    small = {"DFCACHE_SEGMENT_BYTES": str(128 * 4)}  # one sample a segment
    # Stopped just after its first segment is published (children.py: a pause), then interrupted
    # there: Ctrl-C lands mid-extraction however loaded the machine is.
    pause = json.dumps({"after_op": "rename ", "op": 1})
    child = heavy_zygote.spawn("children:paused_cli", pause, *map(str, args), name="hs-sigint", env=small)
    deadline = time.monotonic() + 300
    while "\nZ " not in "\n" + child.err:
        assert child.poll() is None, f"never reached its pause:\n{child.err[-3000:]}"
        assert time.monotonic() < deadline, child.err[-3000:]
        time.sleep(0.01)
    assert len(artifacts_listing(store)) > len(before)
    child.kill(signal.SIGINT)
    child.kill(signal.SIGCONT)  # the interrupt is handled as the process goes on
    code = child.wait(120)
    assert code == 130, child.err
    assert "Traceback" not in child.err and "interrupted" in child.err
    kept = artifacts_listing(store)
    assert set(before) < set(kept), "the committed segment was lost"
    again = heavy_zygote.cli(*map(str, args), "--json", timeout=300, env=small)
    assert again.code == 0, again.err
    (hs,) = [r["samples"] for r in json.loads(again.out)["stages"] if r["stage"] == "hidden_states"]
    assert hs["reused"] >= 1 and hs["reused"] + hs["computed"] == hs["total"], hs
    figures.record("bad_input_cases", **{"interrupted: SIGINT mid hidden-states": {"exit": 130, "resumed": True}})
