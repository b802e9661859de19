#!/usr/bin/env python3
"""Plots of the side-by-side benchmark: time and size against report count, per target.

Reads the JSON files `bench/side-by-side.sh` writes (one per target and size, kept in the
repository as the raw data) and writes one PNG per figure next to them.

    python3 -m venv ~/.cache/reports-server/plot-venv
    ~/.cache/reports-server/plot-venv/bin/pip install matplotlib
    ~/.cache/reports-server/plot-venv/bin/python bench/plot.py docs/bench/side-by-side
"""

import json
import pathlib
import sys
from collections import defaultdict

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("matplotlib is missing: pip install matplotlib (see this file's docstring)")

# (figure key, title, y label, log scale). The serving process is picked per target as in the
# summary; `raw_list_over_floor` is derived from each run's list and floor.
FIGURES = [
    ("create_per_s", "Creates through the API", "reports/s", False),
    ("update_per_s", "Updates through the API", "reports/s", False),
    ("list_seconds", "Full paged list, typed client (limit=500)", "s", True),
    ("raw_list_seconds", "Full paged list read as bytes (limit=500)", "s", True),
    ("metadata_list_seconds", "Metadata-only paged list (limit=500)", "s", True),
    ("database_read_seconds", "The database's floor: one SELECT of every body", "s", True),
    ("raw_list_over_floor", "Paged list read as bytes / the database's floor", "×", False),
    ("kubectl_get_seconds", "kubectl get polr -A", "s", True),
    ("watch_p99_ms.100", "Watch p99, 100 watchers, 200 creates/s", "ms", False),
    ("serving_peak_rss_mib", "Peak RSS of the serving process", "MiB", True),
    ("disk_mib", "Bytes on disk", "MiB", True),
]

SERVING = {"crds": "kube-apiserver", "peer": "peer"}

# One colour per target in every figure.
COLOURS = {
    "crds": "tab:blue",
    "peer": "tab:orange",
    "postgres": "tab:green",
    "sqlite": "tab:red",
    "postgres-direct": "tab:olive",
    "sqlite-direct": "tab:purple",
}

# Figures with a target line: (value, label).
TARGET_LINES = {"raw_list_over_floor": (2.0, "target: 2× the floor")}


def serving(target):
    if target in SERVING:
        return SERVING[target]
    return "bench" if target.endswith("-direct") else "reports-server"


def load(directory):
    # series[key][target] = [(reports, median, min, max)]
    series = defaultdict(lambda: defaultdict(list))
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        doc = json.loads(path.read_text())
        target, reports = doc.get("target"), doc.get("reports")
        if target is None or reports is None:
            continue
        medians = {}
        for f in doc.get("figures", []):
            key = f["key"]
            if key == f"peak_rss_mib.{serving(target)}":
                key = "serving_peak_rss_mib"
            series[key][target].append((reports, f["median"], f["min"], f["max"]))
            medians[key] = f["median"]
        floor = medians.get("database_read_seconds")
        if floor and "raw_list_seconds" in medians:
            ratio = medians["raw_list_seconds"] / floor
            series["raw_list_over_floor"][target].append((reports, ratio, ratio, ratio))
    return series


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "docs/bench/side-by-side"
    series = load(directory)
    if not series:
        sys.exit(f"no benchmark JSON in {directory}: run bench/side-by-side.sh first")
    for key, title, unit, log in FIGURES:
        targets = series.get(key)
        if not targets:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for target, points in sorted(targets.items()):
            points.sort()
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            lows = [p[1] - p[2] for p in points]
            highs = [p[3] - p[1] for p in points]
            ax.errorbar(
                xs,
                ys,
                yerr=[lows, highs],
                marker="o",
                capsize=3,
                label=target,
                color=COLOURS.get(target),
            )
        if key in TARGET_LINES:
            value, label = TARGET_LINES[key]
            ax.axhline(value, color="grey", linestyle="--", label=label)
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("reports stored")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out = pathlib.Path(directory) / f"{key.replace('.', '-')}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        print(out)


if __name__ == "__main__":
    main()
