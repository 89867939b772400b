"""PNG plots of loadtest results (`run --plot` and `compare --plot`).

The series helpers (`cdf`, `token_times`, `token_rate_series`, `inflight_series`,
`latency_ms`, `choose_bin_s`) are pure so they can be tested without matplotlib; matplotlib
is imported only inside the drawing functions, so `import loadtest.plots` works without it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MISSING_MPL = "matplotlib is needed for --plot: pip install matplotlib"
LATENCIES = ("TTFT", "TPOT", "ITL", "E2E")


# ---- pure series helpers ------------------------------------------------------------------

def cdf(values: Iterable[float | None]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and the fraction of values <= each (ends at 1.0).

    None and NaN are dropped, so a latency list with gaps plots as-is."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def token_times(request: dict[str, Any]) -> list[float]:
    """Arrival times (s from run start) of a request's content chunks: start_s + ttft_s,
    then + each itl_s in turn. Empty when no first token arrived."""
    ttft = request.get("ttft_s")
    if ttft is None:
        return []
    t = float(request["start_s"]) + float(ttft)
    times = [t]
    for gap in request.get("itl_s") or []:
        t += gap
        times.append(t)
    return times


def token_rate_series(requests: Sequence[dict[str, Any]], bin_s: float, *,
                      end_s: float | None = None, only_ok: bool = True,
                      ) -> tuple[list[float], list[float]]:
    """Output tokens/s over time: token arrivals counted into bins [k*bin_s, (k+1)*bin_s),
    divided by bin_s. Returns (bin starts, tokens/s).

    Bins cover 0 .. max(end_s, last arrival); a token exactly at the end falls in the last
    bin. Only successful requests count by default, to match the summary's throughput."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    times = [t for r in requests if r.get("ok") or not only_ok for t in token_times(r)]
    end = max([end_s or 0.0, *times])
    if end <= 0 and not times:
        return [], []
    n_bins = max(1, math.ceil(end / bin_s - 1e-9))
    counts = [0] * n_bins
    for t in times:
        counts[min(max(int(t // bin_s), 0), n_bins - 1)] += 1
    return [k * bin_s for k in range(n_bins)], [c / bin_s for c in counts]


def inflight_series(requests: Sequence[dict[str, Any]], times: Sequence[float]) -> list[int]:
    """How many requests were in flight (sent, not yet finished) at each time."""
    spans = [(float(r["start_s"]), float(r["start_s"]) + float(r.get("e2e_s") or 0.0))
             for r in requests]
    return [sum(1 for a, b in spans if a <= t < b) for t in times]


def choose_bin_s(duration_s: float) -> float:
    """1 s bins when that gives 20-100 bins, else the run length / 50."""
    if duration_s <= 0:
        return 1.0
    return 1.0 if 20 <= duration_s <= 100 else duration_s / 50


def latency_ms(requests: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """TTFT, TPOT, ITL (every gap) and E2E latencies in ms of the successful requests."""
    ok = [r for r in requests if r.get("ok")]
    out: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for r in ok:
        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
            if r.get(key) is not None:
                out[name].append(1000.0 * r[key])
        out["ITL"].extend(1000.0 * g for g in r.get("itl_s") or [])
    return out


def run_duration(result: dict[str, Any]) -> float:
    """The summary's duration, else the last request's end."""
    duration = (result.get("summary") or {}).get("duration_s")
    if duration:
        return float(duration)
    ends = [r["start_s"] + (r.get("e2e_s") or 0.0) for r in result.get("requests") or []]
    return max(ends, default=0.0)


def run_title(result: dict[str, Any]) -> str:
    """'label: transport, dataset, rate/concurrency, throughput' for a plot title."""
    cfg = result.get("config") or {}
    s = result.get("summary") or {}
    conc = cfg.get("max_concurrency")
    load = f"rate {cfg.get('request_rate', '?')}" + (f", concurrency {conc}" if conc else "")
    tput = (f"{s.get('output_throughput') or 0:.1f} out tok/s, "
            f"{s.get('request_throughput') or 0:.2f} req/s, "
            f"{s.get('successful_requests', 0)} ok / {s.get('failed_requests', 0)} failed")
    return (f"{result.get('label', 'run')}: {cfg.get('transport', '?')}, "
            f"{cfg.get('dataset', '?')}, {load}\n{tput}")


# ---- drawing ------------------------------------------------------------------------------

def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a RuntimeError that says how to get it."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError(MISSING_MPL) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _empty(ax: Any, text: str) -> None:
    """Mark a panel as having nothing to show."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _cdf_panel(ax: Any, series: dict[str, list[float]], title: str) -> None:
    """Overlaid CDF lines, log x when every value is positive."""
    drawn = False
    for name, values in series.items():
        xs, ys = cdf(values)
        if xs:
            # start each curve at 0 so a single value still draws (a vertical jump to 1)
            ax.step([xs[0], *xs], [0.0, *ys], where="post", label=f"{name} (n={len(xs)})")
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if not drawn:
        _empty(ax, "no successful requests")
        return
    if all(v > 0 for values in series.values() for v in values):
        ax.set_xscale("log")
    ax.legend(fontsize=8, loc="lower right")


def _throughput_panel(ax: Any, result: dict[str, Any]) -> None:
    """Output tokens/s per time bin, with requests in flight on a twin axis."""
    requests = result.get("requests") or []
    duration = run_duration(result)
    bin_s = choose_bin_s(duration)
    starts, rates = token_rate_series(requests, bin_s, end_s=duration)
    ax.set_title(f"output tokens/s over time ({bin_s:.3g} s bins)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tok/s")
    ax.grid(True, alpha=0.3)
    if not starts:
        _empty(ax, "no tokens")
        return
    ax.bar(starts, rates, width=bin_s, align="edge", alpha=0.6, label="output tok/s")
    ax.set_ylim(0, max(rates) * 1.05 or 1.0)
    if not any(rates):
        _empty(ax, "no output tokens from successful requests")
    twin = ax.twinx()
    twin.step(starts, inflight_series(requests, starts), where="post", color="C3",
              label="in flight")
    twin.set_ylabel("requests in flight")
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], fontsize=8, loc="upper right")


def _series(samples: Sequence[dict[str, Any]], key: str, scale: float = 1.0,
            ) -> tuple[list[float], list[float]]:
    """(t, value * scale) of the samples that have the key."""
    pairs = [(s["t"], s[key] * scale) for s in samples if s.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _server_panel(ax: Any, samples: Sequence[dict[str, Any]]) -> None:
    """KV cache usage (%) and running / waiting requests from the /metrics samples."""
    ax.set_title("server (/metrics)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV cache usage (%)")
    ax.grid(True, alpha=0.3)
    if not samples:
        _empty(ax, "no /metrics samples")
        return
    handles = ax.plot(*_series(samples, "kv_cache_usage", 100.0), color="C2",
                      label="KV cache usage %")
    ax.set_ylim(0, 105)
    twin = ax.twinx()
    handles += twin.plot(*_series(samples, "running"), color="C0", label="running")
    handles += twin.plot(*_series(samples, "waiting"), color="C1", label="waiting")
    twin.set_ylabel("requests")
    twin.set_ylim(bottom=0)
    ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper right")


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write the figure as PNG (making the folder) and free it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def plot_run(result: dict[str, Any], path: str | Path) -> Path:
    """One PNG for one run: latency CDFs, output tok/s over time, server metrics."""
    plt = _pyplot()
    fig, (ax_lat, ax_tok, ax_srv) = plt.subplots(3, 1, figsize=(10, 13))
    fig.suptitle(run_title(result), fontsize=11)
    _cdf_panel(ax_lat, latency_ms(result.get("requests") or []), "latency CDFs")
    _throughput_panel(ax_tok, result)
    _server_panel(ax_srv, result.get("server_metrics") or [])
    # fixed margins, not tight_layout: that lays out by drawing twice (~1 s per plot)
    fig.subplots_adjust(left=0.08, right=0.92, top=0.92, bottom=0.05, hspace=0.35)
    return _save(plt, fig, path)


def _bar_panel(ax: Any, labels: Sequence[str], groups: dict[str, list[float | None]],
               title: str) -> None:
    """Grouped bars: one group per run, one bar per metric, values written on the bars."""
    width = 0.8 / max(1, len(groups))
    for i, (name, values) in enumerate(groups.items()):
        xs = [k + i * width for k in range(len(labels))]
        bars = ax.bar(xs, [v or 0.0 for v in values], width=width, label=name)
        ax.bar_label(bars, labels=["-" if v is None else f"{v:.3g}" for v in values],
                     fontsize=8)
    ax.set_xticks([k + width * (len(groups) - 1) / 2 for k in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def plot_compare(results: Sequence[dict[str, Any]], labels: Sequence[str],
                 path: str | Path) -> Path:
    """One PNG comparing runs: overlaid TTFT / ITL / E2E CDFs and throughput bars."""
    if len(results) != len(labels):
        raise ValueError(f"{len(results)} results but {len(labels)} labels")
    plt = _pyplot()
    fig, axes = plt.subplot_mosaic([["TTFT", "ITL", "E2E"], ["tok", "tok", "req"]],
                                   figsize=(15, 9))
    fig.suptitle("loadtest comparison: " + ", ".join(labels), fontsize=11)
    lat = [latency_ms(r.get("requests") or []) for r in results]
    for name in ("TTFT", "ITL", "E2E"):
        _cdf_panel(axes[name], {lab: m[name] for lab, m in zip(labels, lat, strict=True)},
                   f"{name} CDF")
    sums = [r.get("summary") or {} for r in results]
    _bar_panel(axes["tok"], labels, {
        "output tok/s": [s.get("output_throughput") for s in sums],
        "total tok/s": [s.get("total_token_throughput") for s in sums]}, "token throughput")
    req: dict[str, list[float | None]] = {"request/s": [s.get("request_throughput")
                                                        for s in sums]}
    if any(s.get("goodput") for s in sums):
        req["goodput req/s"] = [(s.get("goodput") or {}).get("request_throughput")
                                for s in sums]
    _bar_panel(axes["req"], labels, req, "request throughput")
    fig.subplots_adjust(left=0.05, right=0.98, top=0.91, bottom=0.07, hspace=0.3, wspace=0.2)
    return _save(plt, fig, path)
