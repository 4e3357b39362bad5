"""`edgekv bench`: quality, speed, report, and the scripts in bench/ (list, run).

Mounted by ``edgekv/cli.py`` as ``app.add_typer(bench_app, name="bench")``;
also runnable on its own: ``python -m edgekv.bench.cli quality ...``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import EdgekvError
from .runner import DEFAULT_TASKS as _DEFAULT_TASKS

bench_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Benchmarks: quality (RULER-style tasks, perplexity), speed and memory, reports.",
)

DEFAULT_OUT = Path("bench/results")
DEFAULT_TASKS = ",".join(_DEFAULT_TASKS)

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="GGUF path or registry name; comma-separated for several (default smollm2-135m)."),
]
OutOpt = Annotated[Path, typer.Option("--out", help="Results directory (JSON lines, report.md, plots).")]
CacheOpt = Annotated[str, typer.Option("--cache-types", help="KV cache types, comma-separated: f16, q8_0, q4_0, ...; K/V apart as q8_0/q4_0")]
FaHelp = ("Flash attention: auto (edgekv's: off for an unquantised V cache on the CPU, where it is 2.4-3.5x "
          "slower to decode; on for a quantised V cache), on or off.")
ThreadsOpt = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads (default: all cores).")]


def _fail(e: Exception) -> None:
    typer.echo("edgekv: error: " + (" ".join(str(e).split()) or "unknown error"), err=True)
    raise typer.Exit(2)


def _floats(s: str, opt: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise EdgekvError(f"{opt} takes comma-separated numbers, got {s!r}") from None


def _layer_counts(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise EdgekvError(f"--n-gpu-layers takes comma-separated layer counts (e.g. 0,-1), got {s!r}") from None
    if not out:
        raise EdgekvError("--n-gpu-layers needs at least one layer count")
    return out


def _ints(s: str, opt: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if not x:
            continue
        mult = 1024 if x.endswith("k") else 1
        try:
            out.append(int(float(x.rstrip("k")) * mult))
        except ValueError:
            raise EdgekvError(f"{opt} takes comma-separated lengths (e.g. 1k,2k or 1024), got {s!r}") from None
    return out


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _models(s: str | None) -> list[str | None]:
    return [None] if not s else _list(s)


@bench_app.command()
def quality(
    model: ModelOpt = None,
    methods: Annotated[str, typer.Option(help="Methods, comma-separated, or 'all' (every registered method).")] = "all",
    n: Annotated[int, typer.Option("--n", help="Samples per task, length and cache type.")] = 20,
    ratios: Annotated[str, typer.Option(help="Compression ratios = fraction of the context's cells REMOVED.")] = "0.5,0.75,0.875,0.9375",
    lengths: Annotated[str, typer.Option(help="Context lengths in tokens (1k = 1024); lengths above the model's trained context are skipped.")] = "1k",
    tasks: Annotated[str, typer.Option(help="Tasks, comma-separated, or 'all': passkey, niah_single, niah_multikey, niah_multivalue, vt, cwe, multiturn, ppl.")] = DEFAULT_TASKS,
    cache_types: CacheOpt = "f16",
    flash_attn: Annotated[str, typer.Option("--flash-attn", "-fa", help=FaHelp)] = "auto",
    out: OutOpt = DEFAULT_OUT,
    seed: Annotated[int, typer.Option(help="Seed of the task generators.")] = 0,
    query_aware: Annotated[bool, typer.Option("--query-aware/--query-agnostic", help="Put the question at the end of the compressed context (attention methods see it) instead of after the compression.")] = False,
    chat: Annotated[bool, typer.Option("--chat/--raw", help="Wrap the prompt in the model's chat template.")] = True,
    n_ppl: Annotated[int | None, typer.Option("--n-ppl", help="Samples of the ppl task (default: --n).")] = None,
    n_shift: Annotated[int, typer.Option("--n-shift", help="Samples per task for llama.cpp's context shift, which needs its own prefill per ratio (0 = all --n).")] = 2,
    eval_tokens: Annotated[int, typer.Option(help="ppl: tokens scored after the compressed passage.")] = 128,
    threads: ThreadsOpt = None,
    report: Annotated[bool, typer.Option("--report/--no-report", help="Write report.md and plots at the end.")] = True,
) -> None:
    """Accuracy of every method x ratio x length x cache type on RULER-style tasks (resumable)."""
    from . import tasks as task_mod
    from .runner import Grid, run_quality

    try:
        task_list = list(task_mod.TASKS) if tasks.strip() == "all" else _list(tasks)
        grid = Grid(models=_models(model), methods=_list(methods), ratios=_floats(ratios, "--ratios"),
                    lengths=_ints(lengths, "--lengths"), tasks=task_list, cache_types=_list(cache_types), n=n, flash_attn=flash_attn,
                    n_ppl=n_ppl, n_shift=n_shift or None, seed=seed, query_aware=query_aware, chat=chat, eval_tokens=eval_tokens,
                    threads=threads, out=out)
        from .text import find_data_dir

        find_data_dir()  # fail now, not after loading the model
        path = run_quality(grid)
        typer.echo(f"results: {path}")
        if report:
            _report(out)
    except EdgekvError as e:
        _fail(e)


@bench_app.command()
def speed(
    model: ModelOpt = None,
    methods: Annotated[str, typer.Option(help="Methods, comma-separated, or 'all' ('full' is always measured).")] = "all",
    ratio: Annotated[float, typer.Option(help="Fraction of cells removed by the compressed runs.")] = 0.75,
    lengths: Annotated[str, typer.Option(help="Context lengths (1k = 1024).")] = "1k,2k,4k",
    cache_types: CacheOpt = "f16",
    flash_attn: Annotated[str, typer.Option("--flash-attn", "-fa", help=FaHelp + " Comma-separated: each is measured.")] = "auto",
    decode_tokens: Annotated[int, typer.Option(help="Tokens decoded per measurement.")] = 64,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Also ingest the text through a bounded cache (compressing as it fills).")] = True,
    out: OutOpt = DEFAULT_OUT,
    threads: ThreadsOpt = None,
    n_gpu_layers: Annotated[str, typer.Option(
        "--n-gpu-layers", "-ngl", help="Layers offloaded to the GPU, their KV cache with them (-1: all). "
        "Comma-separated: each is measured in turn at every length, e.g. 0,-1 for the CPU against the GPU.")] = "0",
    report: Annotated[bool, typer.Option("--report/--no-report", help="Rewrite report.md and plots at the end.")] = True,
) -> None:
    """Prefill and decode tok/s, compression time and overhead, KV bytes and peak RSS."""
    from .speed import SpeedGrid, run_speed

    try:
        from ..methods import METHODS

        ms = list(METHODS) if methods.strip() == "all" else _list(methods)
        if "full" not in ms:
            ms.insert(0, "full")
        grid = SpeedGrid(models=_models(model), methods=ms, ratio=ratio, lengths=_ints(lengths, "--lengths"),
                         cache_types=_list(cache_types), flash_attn=_list(flash_attn), decode_tokens=decode_tokens, stream=stream,
                         threads=threads, n_gpu_layers=_layer_counts(n_gpu_layers), out=out)
        from .text import find_data_dir

        find_data_dir()
        path = run_speed(grid, log=lambda s: typer.echo(s, err=True))
        typer.echo(f"results: {path}")
        if report:
            _report(out)
    except EdgekvError as e:
        _fail(e)


def _report(directory: Path) -> None:
    from .report import write_report

    md, plots = write_report(directory)
    typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"wrote {md}" + "".join(f"\nwrote {p}" for p in plots))


@bench_app.command("report")
def report_cmd(
    directory: Annotated[Path, typer.Argument(help="Results directory of a quality and/or speed run.")] = DEFAULT_OUT,
) -> None:
    """Markdown tables and plots from a results directory."""
    try:
        if not directory.is_dir():
            raise EdgekvError(f"{directory} is not a directory")
        _report(directory)
    except EdgekvError as e:
        _fail(e)


@bench_app.command("list")
def list_cmd() -> None:
    """The single-purpose benchmarks in bench/, each run as `edgekv bench run NAME`."""
    from .scripts import scripts

    try:
        found = scripts()
    except EdgekvError as e:
        _fail(e)
    width = max(map(len, found))
    for name, what in found.items():
        typer.echo(f"{name:<{width}}  {what}")


@bench_app.command("run", add_help_option=False,
                   context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_cmd(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A script in bench/ (edgekv bench list); its own --help says more.")],
) -> None:
    """Run one of bench/'s single-purpose benchmarks with its own arguments."""
    from .scripts import run

    try:
        code = run(name, list(ctx.args))
    except EdgekvError as e:
        _fail(e)
    raise typer.Exit(code)


@bench_app.command("text")
def text_cmd(
    fetch: Annotated[bool, typer.Option("--fetch", help="Unpack the Debian package into the edgekv cache (no root needed).")] = False,
) -> None:
    """Where the benchmark's real text comes from, and whether it is installed."""
    from . import text

    try:
        if fetch:
            typer.echo(f"unpacked into {text.fetch()}")
        d = text.find_data_dir()
        b = text.books()
        words = sum(len(p.split()) for ps in b.values() for p in ps)
        typer.echo(f"{text.SOURCE}\n{d}\n{len(b)} books, {words} words")
    except EdgekvError as e:
        _fail(e)


def main() -> None:  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    bench_app(prog_name="edgekv bench")


if __name__ == "__main__":  # pragma: no cover - `python -m edgekv.bench.cli`
    sys.exit(main())
