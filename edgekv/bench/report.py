"""Tables (markdown) and plots from the JSON-lines results of the quality and speed sweeps."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .runner import RESULTS_FILE, load_rows
from .speed import SPEED_FILE
from .tasks import QA_TASKS

TASK_LABEL = {"passkey": "passkey", "niah_single": "NIAH-1", "niah_multikey": "NIAH-MK", "niah_multivalue": "NIAH-MV",
              "vt": "VT", "cwe": "CWE", "multiturn": "MT", "ppl": "PPL"}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _method_order(methods: set[str]) -> list[str]:
    first = ["full", "context_shift"]
    return [m for m in first if m in methods] + sorted(m for m in methods if m not in first)


class Table:
    """Aggregates quality rows: mean score per (model, cache type, length, method, ratio, task)."""

    def __init__(self, rows: list[dict]) -> None:
        from .runner import row_key

        rows = list({row_key(r): r for r in rows}.values())  # one row per key (the last written)
        # A cache type measured both with and without flash attention gets one column each.
        fas: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            fas[r["cache_type"]].add(r.get("flash_attn", "on"))
        rows = [r if len(fas[r["cache_type"]]) == 1 else
                {**r, "cache_type": f"{r['cache_type']} FA {r.get('flash_attn', 'on')}"} for r in rows]
        self.rows = [r for r in rows if r.get("score") is not None]
        self.errors = [r for r in rows if r.get("score") is None]
        self.cell: dict[tuple, list[dict]] = defaultdict(list)
        for r in self.rows:
            self.cell[(r["model"], r["cache_type"], r["length"], r["protocol"], r["method"], r["ratio"], r["task"])].append(r)

    def configs(self) -> list[tuple[str, str, int, str]]:
        return sorted({(r["model"], r["cache_type"], r["length"], r["protocol"]) for r in self.rows},
                      key=lambda c: (c[0], c[2], c[1], c[3]))

    def tasks(self) -> list[str]:
        present = {r["task"] for r in self.rows}
        return [t for t in (*QA_TASKS, "multiturn", "ppl") if t in present]

    def divergence(self, cfg: tuple, method: str, ratio: float) -> tuple[float, float]:
        """(mean KL from the full cache in nats, top-1 agreement %) over the ppl continuations."""
        rs = self.cell.get((*cfg, method, ratio, "ppl"), [])
        if not rs or any("kl" not in r for r in rs):  # rows from before KL was measured: no partial mean
            return float("nan"), float("nan")
        return _mean([r["kl"] for r in rs]), 100.0 * _mean([r["top1"] for r in rs])

    def turns(self, cfg: tuple, method: str, ratio: float) -> list[float]:
        """Multi-turn accuracy % per turn (the cache compressed again before each)."""
        rs = [r["turn_scores"] for r in self.cell.get((*cfg, method, ratio, "multiturn"), []) if "turn_scores" in r]
        return [100.0 * _mean([t[j] for t in rs]) for j in range(min(map(len, rs)))] if rs else []

    def evals(self, cfg: tuple) -> list[tuple[str, float]]:
        pairs = {(r["method"], r["ratio"]) for r in self.rows if (r["model"], r["cache_type"], r["length"], r["protocol"]) == cfg}
        order = _method_order({m for m, _ in pairs})
        return sorted(pairs, key=lambda p: (order.index(p[0]), p[1]))

    def score(self, cfg: tuple, method: str, ratio: float, task: str) -> tuple[float, int]:
        rs = self.cell.get((*cfg, method, ratio, task), [])
        if not rs:
            return float("nan"), 0
        if task == "ppl":  # perplexity over all evaluated tokens: exp(mean nll)
            n = sum(r["n_eval"] for r in rs)
            return math.exp(sum(r["nll"] * r["n_eval"] for r in rs) / n), len(rs)
        return 100.0 * _mean([r["score"] for r in rs]), len(rs)

    def qa_avg(self, cfg: tuple, method: str, ratio: float) -> float:
        vals = [self.score(cfg, method, ratio, t)[0] for t in self.tasks() if t in QA_TASKS]
        vals = [v for v in vals if not math.isnan(v)]
        return _mean(vals)

    def kv(self, cfg: tuple, method: str, ratio: float) -> tuple[float, float]:
        """(mean KV MiB, mean kept fraction) over the pair's one-question and ppl rows (a multi-turn
        context is shorter: its later turns take part of the length)."""
        rs = [r for t in self.tasks() if t != "multiturn" for r in self.cell.get((*cfg, method, ratio, t), [])]
        return (_mean([r["kv_bytes"] / 2**20 for r in rs]),
                _mean([r["kept"] for r in rs if r.get("kept") is not None]))


def _fmt(v: float, digits: int = 1) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def markdown(results_dir: Path) -> str:
    rows = load_rows(results_dir / RESULTS_FILE)
    out: list[str] = []
    if rows:
        out += quality_markdown(Table(rows))
    speed = load_rows(results_dir / SPEED_FILE)
    if speed:
        out += speed_markdown(speed)
    if not out:
        out = [f"no results in {results_dir}"]
    return "\n".join(out) + "\n"


def quality_markdown(tab: Table) -> list[str]:
    from .text import SOURCE

    tasks = tab.tasks()
    qa = [t for t in tasks if t in QA_TASKS]
    kl = any("kl" in r for r in tab.rows)
    out = ["# edgekv quality benchmark", ""]
    proto = {r["protocol"] for r in tab.rows}
    tmpl = {r["template"] for r in tab.rows}
    out.append(
        f"Protocol: {', '.join(sorted(proto))} (agnostic = the context is compressed before the question "
        f"arrives); prompt template: {', '.join(sorted(tmpl))}; greedy decoding. Ratio = fraction of the "
        "context's KV cells removed. Scores are % (mean over samples; multi-answer tasks give partial "
        "credit); MT = multi-turn (one context, a question per turn, the cache compressed again before "
        "each, to the first compression's cells; not in QA avg); PPL = exp(mean NLL) of the tokens that follow "
        "the compressed passage; KL = mean KL divergence (nats) of the next-token distribution from the full "
        "cache's (same cache type) over those tokens, "
        "top-1 = how often both caches' most likely token agree. "
        "`context_shift` is llama.cpp's context shift with n_ctx = the cells the other methods keep "
        f"(KV column: its allocation). Haystack and PPL text: {SOURCE}."
    )
    out.append("")
    for cfg in tab.configs():
        model, ct, length, protocol = cfg
        evals = tab.evals(cfg)
        ns = sorted({tab.score(cfg, m, r, t)[1] for m, r in evals for t in tasks} - {0})
        n_txt = str(ns[0]) if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"
        out.append(f"## {model}, {length} tokens, KV cache {ct}, query-{protocol} (n = {n_txt} per cell)")
        out.append("")
        head = ["method", "ratio", *[TASK_LABEL.get(t, t) for t in qa]]
        if qa:
            head.append("QA avg")
        if "multiturn" in tasks:
            head.append("MT")
        if "ppl" in tasks:
            head.append("PPL")
            if kl:
                head += ["KL", "top-1 %"]
        head += ["kept %", "KV MiB", "n"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
        for m, r in evals:
            cells = [m, "–" if r == 0 else f"{r:g}"]
            cells += [_fmt(tab.score(cfg, m, r, t)[0], 0) for t in qa]
            if qa:
                cells.append(_fmt(tab.qa_avg(cfg, m, r)))
            if "multiturn" in tasks:
                cells.append(_fmt(tab.score(cfg, m, r, "multiturn")[0], 1))
            if "ppl" in tasks:
                cells.append(_fmt(tab.score(cfg, m, r, "ppl")[0], 2))
                if kl:
                    d, t1 = tab.divergence(cfg, m, r)
                    cells += [_fmt(d, 3), _fmt(t1, 1)]
            mib, kept = tab.kv(cfg, m, r)
            nn = sorted({tab.score(cfg, m, r, t)[1] for t in tasks} - {0})
            cells += [_fmt(100 * kept, 1), _fmt(mib, 2), "/".join(map(str, nn)) or "0"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        per_turn = {(m, r): tab.turns(cfg, m, r) for m, r in evals}
        width = max((len(v) for v in per_turn.values()), default=0)
        if width:
            out.append(f"Multi-turn, accuracy % per turn ({model}, {length} tokens, {ct}, query-{protocol}):")
            out.append("")
            out.append("| method | ratio | " + " | ".join(f"turn {j + 1}" for j in range(width)) + " |")
            out.append("|---|---|" + "---:|" * width)
            for (m, r), v in per_turn.items():
                if v:
                    out.append(f"| {m} | {'–' if r == 0 else f'{r:g}'} | " + " | ".join(_fmt(x, 0) for x in v) + " |")
            out.append("")
    # KV quantisation alone: the full cache across cache types.
    by = defaultdict(dict)
    for cfg in tab.configs():
        if (cfg[0], cfg[2], cfg[3]) and ("full", 0.0) in tab.evals(cfg):
            by[(cfg[0], cfg[2], cfg[3])][cfg[1]] = cfg
    multi = {k: v for k, v in by.items() if len(v) > 1}
    if multi:
        out.append("## KV quantisation alone (full cache)")
        out.append("")
        out.append("| model | length | cache | QA avg | PPL | KV MiB |")
        out.append("|---|---:|---|---:|---:|---:|")
        for (model, length, _p), cts in sorted(multi.items()):
            for ct, cfg in sorted(cts.items()):
                ppl = tab.score(cfg, "full", 0.0, "ppl")[0] if "ppl" in tasks else float("nan")
                out.append(f"| {model} | {length} | {ct} | {_fmt(tab.qa_avg(cfg, 'full', 0.0))} | {_fmt(ppl, 2)} | "
                           f"{_fmt(tab.kv(cfg, 'full', 0.0)[0], 2)} |")
        out.append("")
    # Quantise, evict, or both: the points no other point beats with fewer KV bytes.
    for (model, length, protocol), front in frontiers(tab).items():
        if len({p.cache for p in front.points}) < 2:
            continue
        out.append(f"## Pareto frontier: QA average against KV MiB ({model}, {length} tokens, query-{protocol})")
        out.append("")
        out.append("Every (method, ratio, cache type) measured; on the frontier are those that no other "
                   "reaches with as few or fewer KV bytes and a higher QA average.")
        out.append("")
        out.append("| KV MiB | cache | method | ratio | QA avg |")
        out.append("|---:|---|---|---:|---:|")
        for pt in front.best:
            out.append(f"| {_fmt(pt.mib, 2)} | {pt.cache} | {pt.method} | {'–' if pt.ratio == 0 else f'{pt.ratio:g}'} "
                       f"| {_fmt(pt.qa, 1)} |")
        out.append("")
    if tab.errors:
        out.append(f"{len(tab.errors)} evaluations failed (e.g. a budget below what the method must keep): "
                   + "; ".join(sorted({e.get('error', '?')[:120] for e in tab.errors})[:3]))
        out.append("")
    times = [r["prefill_s"] for r in tab.rows if r.get("prefill_s")]
    if times:
        toks = [r["prompt_tokens"] for r in tab.rows if r.get("prefill_s")]
        out.append(f"Prefill throughput over the sweep: {sum(toks) / sum(times):.0f} tok/s (mean of every row's sample; "
                   "rows share a sample's prefill).")
        out.append("")
    return out


def speed_markdown(rows: list[dict]) -> list[str]:
    out = ["# edgekv speed and memory", ""]
    out.append("Decode tok/s at the given context (greedy, batch 1, the model's own tokens fed back); "
               "`compress s` = one compression event of the whole context (one-shot) or the mean over "
               "streaming events; overhead = compression time / prefill time. Peak RSS is the process "
               "high-water mark during that measurement. Fresh context: a new context holding as many cells "
               "of the same text, decoded in blocks alternating with the compressed one.")
    out.append("")
    head = ["model", "cache", "FA", "context", "mode", "method", "ratio", "prefill tok/s", "decode tok/s",
            "fresh context tok/s", "cells", "KV MiB", "compress s", "events", "overhead %", "peak RSS MiB"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "|".join(["---"] * 7 + ["---:"] * (len(head) - 7)) + "|")
    for r in sorted(rows, key=lambda r: (r["model"], r["cache_type"], r.get("flash_attn", "on"), r["length"],
                                         r["mode"] != "oneshot", r["method"] != "full", r["method"], r["ratio"])):
        out.append("| " + " | ".join([
            r["model"], r["cache_type"], r.get("flash_attn", "on"), str(r["length"]), r["mode"], r["method"],
            "–" if not r["ratio"] else f"{r['ratio']:g}",
            _fmt(r.get("prefill_tok_s"), 0), _fmt(r.get("decode_tok_s"), 1), _fmt(r.get("fresh_decode_tok_s"), 1),
            str(r.get("cells", "–")),
            _fmt(r.get("kv_bytes", 0) / 2**20, 2), _fmt(r.get("compress_s"), 3), str(r.get("compressions", "–")),
            _fmt(r.get("overhead_pct"), 1), _fmt(r.get("peak_rss_mib"), 0),
        ]) + " |")
    out.append("")
    return out


# ---------------------------------------------------------------------------
# plots


@dataclass(frozen=True)
class Point:
    """One (method, ratio, cache type) of a sweep: its mean KV MiB and QA average."""

    mib: float
    qa: float
    cache: str
    method: str
    ratio: float


@dataclass
class Frontier:
    points: list[Point]

    @property
    def best(self) -> list[Point]:
        """The Pareto frontier, fewest bytes first: each point beats every point with fewer
        bytes (a higher QA average), so no other point has as few bytes and a higher average."""
        out: list[Point] = []
        for pt in sorted(self.points, key=lambda p: (p.mib, -p.qa)):
            if not out or pt.qa > out[-1].qa:
                out.append(pt)
        return out


def frontiers(tab: Table) -> dict[tuple[str, int, str], Frontier]:
    """Per (model, length, protocol): every measured point across cache types."""
    out: dict[tuple[str, int, str], Frontier] = {}
    for cfg in tab.configs():
        model, ct, length, protocol = cfg
        front = out.setdefault((model, length, protocol), Frontier([]))
        for m, r in tab.evals(cfg):
            qa = tab.qa_avg(cfg, m, r)
            if not math.isnan(qa):
                front.points.append(Point(tab.kv(cfg, m, r)[0], qa, ct, m, r))
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _value(tab: Table, cfg: tuple, method: str, ratio: float, task: str) -> float:
    return tab.qa_avg(cfg, method, ratio) if task == "qa_avg" else tab.score(cfg, method, ratio, task)[0]


def plot_quality(tab: Table, results_dir: Path) -> list[Path]:
    plt = _plt()
    written: list[Path] = []
    tasks = tab.tasks()
    for cfg in tab.configs():
        model, ct, length, protocol = cfg
        evals = tab.evals(cfg)
        methods = _method_order({m for m, _ in evals})
        panels = tasks + (["qa_avg"] if len([t for t in tasks if t in QA_TASKS]) > 1 else [])
        ncol = min(4, len(panels))
        nrow = math.ceil(len(panels) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 3.0 * nrow), squeeze=False)
        for ax, task in zip(axes.flat, panels, strict=False):
            for m in methods:
                rs = sorted(r for mm, r in evals if mm == m)
                if rs == [0.0]:
                    ax.axhline(_value(tab, cfg, m, 0.0, task), color="k", ls="--", lw=1, label=m)
                    continue
                ax.plot(rs, [_value(tab, cfg, m, r, task) for r in rs], marker="o", ms=3, label=m)
            ax.set_title("QA average" if task == "qa_avg" else TASK_LABEL.get(task, task), fontsize=9)
            ax.set_xlabel("ratio removed", fontsize=8)
            ax.set_ylabel("perplexity" if task == "ppl" else "score %", fontsize=8)
            if task == "ppl":
                ax.set_yscale("log")
            else:
                ax.set_ylim(-3, 103)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
        fig.suptitle(f"{model}, {length} tokens, {ct} KV, query-{protocol}", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 0.96))
        p = results_dir / f"accuracy_vs_ratio_{model}_{length}_{ct.replace('/', '-')}_{protocol}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    # Accuracy against KV bytes: every (method, ratio, cache type) of one model and length.
    groups = defaultdict(list)
    for cfg in tab.configs():
        groups[(cfg[0], cfg[2], cfg[3])].append(cfg)
    markers = {"f16": "o", "q8_0": "s", "q4_0": "^", "f32": "D", "bf16": "v"}
    for (model, length, protocol), cfgs in groups.items():
        fig, ax = plt.subplots(figsize=(10, 5.6))
        methods = _method_order({m for c in cfgs for m, _ in tab.evals(c)})
        cmap = plt.get_cmap("tab20" if len(methods) > 10 else "tab10")
        shades = [*range(0, cmap.N, 2), *range(1, cmap.N, 2)]  # tab20's dark shades first: neighbours differ
        colors = {m: cmap(shades[i % cmap.N]) for i, m in enumerate(methods)}
        other = iter("PX<>*hp")  # K/V mixes and rarer types
        for cfg in cfgs:
            if cfg[1] not in markers:
                markers[cfg[1]] = next(other, "x")
            marker = markers[cfg[1]]
            for m in methods:
                pts = [(tab.kv(cfg, m, r)[0], tab.qa_avg(cfg, m, r)) for mm, r in tab.evals(cfg) if mm == m]
                pts = sorted(p for p in pts if not math.isnan(p[1]))
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                        color=colors[m], ls="-" if cfg[1] == "f16" else ":", ms=4,
                        label=f"{m} ({cfg[1]})")
        best = frontiers(tab)[(model, length, protocol)].best
        if len({c[1] for c in cfgs}) > 1 and len(best) > 1:  # quantise, evict, or both: what no point beats
            ax.step([p.mib for p in best], [p.qa for p in best], where="post", color="k", lw=1.6, alpha=0.55,
                    zorder=0, label="Pareto frontier")
            for p in best:  # name the points a user would pick
                name = p.method if p.method == "full" else f"{p.method}@{p.ratio:g}"
                ax.annotate(f"{name} {p.cache}", (p.mib, p.qa), textcoords="offset points", xytext=(4, -9),
                            fontsize=6.5, color="k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV cache MiB (log2)")
        ax.set_ylabel("QA average score %")
        ax.set_title(f"{model}, {length} tokens, query-{protocol}", fontsize=10)
        ax.legend(fontsize=6.5, ncol=1 if len(ax.get_lines()) <= 30 else 2, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), frameon=False)
        fig.tight_layout()
        p = results_dir / f"accuracy_vs_kv_bytes_{model}_{length}_{protocol}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def plot_speed(rows: list[dict], results_dir: Path) -> list[Path]:
    plt = _plt()
    written = []
    by_model = defaultdict(list)
    for r in rows:
        if r["mode"] == "oneshot" and r.get("decode_tok_s"):
            by_model[(r["model"], f"{r['cache_type']}, FA {r.get('flash_attn', 'on')}")].append(r)
    if not by_model:
        return written
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, ((model, ct), rs) in enumerate(sorted(by_model.items())):
        series = defaultdict(list)
        for r in rs:
            label = "full" if r["method"] == "full" else f"{r['method']}@{r['ratio']:g}"
            series[label].append((r["length"], r["decode_tok_s"]))
        for j, (label, pts) in enumerate(sorted(series.items(), key=lambda kv: (kv[0] != "full", kv[0]))):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=f"C{j}",
                    ls=["-", "--", ":", "-."][i % 4], label=f"{label} ({model}, {ct})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens prefilled)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("decode speed against context length", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = results_dir / "decode_vs_context.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def write_report(results_dir: Path) -> tuple[Path, list[Path]]:
    """Write report.md and every plot the results allow; returns their paths."""
    results_dir = Path(results_dir)
    md = markdown(results_dir)
    path = results_dir / "report.md"
    path.write_text(md, encoding="utf-8")
    plots: list[Path] = []
    rows = load_rows(results_dir / RESULTS_FILE)
    if rows:
        tab = Table(rows)
        if tab.rows:
            plots += plot_quality(tab, results_dir)
    speed = load_rows(results_dir / SPEED_FILE)
    if speed:
        plots += plot_speed(speed, results_dir)
    return path, plots
