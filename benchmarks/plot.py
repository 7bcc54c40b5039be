"""PNG plots of a benchmark's JSON, drawn where matplotlib is installed (not on the GPU hosts):

    pip install 'eagle3-serve[plots]'
    python benchmarks/plot.py speed_report.json [--out-dir DIR]     # default: beside the JSON

``benchmarks/speed_report.py`` JSON gives throughput_vs_batch.png, speedup_vs_batch.png,
verify_cost.png (forward ms against tokens per sequence, per context and per batch) and
tau_per_depth.png; ``benchmarks/replay_gates.py`` JSON gives replay_gates.png (speed-up per case,
titled REPLAY). Prints the files written.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> Path:
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def _by_config(rows: list[dict], key: str) -> dict[str, tuple[list, list]]:
    series = defaultdict(lambda: ([], []))
    for r in rows:
        if key in r:
            series[r["config"]][0].append(r["batch"])
            series[r["config"]][1].append(r[key])
    return series


def speed_report(report: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    title = f"{report['model']} on {report['device']}, {report['dtype']}"
    files = []
    for key, label, name in (("tokens_per_s", "tokens / s", "throughput_vs_batch.png"),
                             ("speedup_vs_target", "speed-up over target-only", "speedup_vs_batch.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for config, (xs, ys) in _by_config(report["throughput"], key).items():
            ax.plot(xs, ys, marker="o", label=config)
        if key == "speedup_vs_target":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(xscale="log", xlabel="batch size", ylabel=label, title=title)
        ax.set_xticks(report["batches"], [str(b) for b in report["batches"]])
        ax.legend(fontsize=8)
        files.append(_save(fig, out, name))
    files.append(_verify_cost(plt, report["verify_cost"], out, title))
    files.append(_tau(plt, report.get("tau_per_depth", {}), out, title))
    return files


def _verify_cost(plt, cost: dict, out: Path, title: str) -> Path:
    """ms[context][batch][tokens]: left, per context at the first batch; right, per batch at the first context."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for c, ctx in enumerate(cost["contexts"]):
        left.plot(cost["tokens"], cost["ms"][c][0], marker="o", label=f"context {ctx}")
    for b, batch in enumerate(cost["batches"]):
        right.plot(cost["tokens"], cost["ms"][0][b], marker="o", label=f"batch {batch}")
    left.set(title=f"batch {cost['batches'][0]}", xlabel="tokens per sequence (1 + tree nodes)", ylabel="forward ms")
    right.set(title=f"context {cost['contexts'][0]}", xlabel="tokens per sequence (1 + tree nodes)", ylabel="forward ms")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.suptitle(f"verify cost: {title}")
    return _save(fig, out, "verify_cost.png")


def _tau(plt, taus: dict, out: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(taus))
    for i, (config, t) in enumerate(taus.items()):
        depths = range(1, len(t["acceptance_per_depth"]) + 1)
        ax.bar([d + i * width for d in depths], t["acceptance_per_depth"], width,
               label=f"{config} (tau {t['tau']:.2f})")
    ax.set(xlabel="depth", ylabel="steps accepting a node at this depth", title=f"acceptance per depth: {title}",
           ylim=(0, 1))
    ax.legend(fontsize=8)
    return _save(fig, out, "tau_per_depth.png")


def replay_gates(report: dict, out: Path) -> list[Path]:
    plt = _pyplot()
    rows = [r for r in report["cases"] if "speedup" in r]
    cases = sorted({(r["context"], r["batch"]) for r in rows}, key=lambda c: (-c[0], c[1]))
    configs = sorted({r["config"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        got = {(r["context"], r["batch"]): r["speedup"] for r in rows if r["config"] == config}
        ax.bar([j + i * width for j in range(len(cases))], [got.get(c, 0) for c in cases], width, label=config)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"{c // 1024}K x{b}" for c, b in cases])
    ax.set(ylabel="speed-up over target-only", xlabel="context x batch",
           title=f"REPLAY ({report['geometry']}, random weights, replayed acceptance) on {report['device']}")
    ax.legend(fontsize=8)
    return [_save(fig, out, "replay_gates.png")]


PLOTTERS = {"speed_report": speed_report, "replay_gates": replay_gates}


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a benchmark's output (speed_report.py or replay_gates.py)")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: beside the JSON)")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.json).read_text())
    kind = report.get("kind")
    if kind not in PLOTTERS:
        raise SystemExit(f"error: {args.json}: no plots for kind {kind!r} (known: {', '.join(PLOTTERS)})")
    out = Path(args.out_dir or Path(args.json).parent)
    out.mkdir(parents=True, exist_ok=True)
    files = PLOTTERS[kind](report, out)
    for f in files:
        print(f)
    return files


if __name__ == "__main__":
    main()
