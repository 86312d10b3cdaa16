"""The plots of scaling.py's JSON lines: one PNG per sweep, a panel per figure, a line per
server (matplotlib, Agg backend: no display needed). Apart from the runner so a saved run
can be redrawn (``scaling.py --plot-from``) and tested without servers.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# sweep -> (x axis label, log base of x, [(figure, y axis label)])
PANELS = {
    "concurrency": ("concurrent requests", 2, [("req_per_s", "requests / s"), ("ttft_p50_s", "TTFT p50 (s)"),
                                               ("itl_p50_s", "time per output token p50 (s)")]),
    "image": ("image size (w x h; log of pixels)", 10, [("prompt_tokens", "prompt tokens"),
                                                        ("ttft_p50_s", "TTFT p50 (s)"),
                                                        ("itl_p50_s", "time per output token p50 (s)")]),
    "context": ("prompt tokens (chat template included)", 2, [("ttft_p50_s", "TTFT p50 (s)"),
                                                              ("itl_p50_s", "time per output token p50 (s)")]),
}


# A server keeps its colour in every plot, whichever servers a run has.
SERVER_COLOURS = {"vlmd": "C2", "vllm": "C1", "llama.cpp": "C0"}


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of a run; a line without sweep, server or x is not this script's."""
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        line = json.loads(text)
        if not isinstance(line, dict) or not {"sweep", "server", "x"} <= line.keys() or line["sweep"] not in PANELS:
            raise ValueError(f"{path}:{number} is not a scaling point (sweep, server, x)")
        lines.append(line)
    return lines


def plot(lines: list[dict], plot_dir: Path) -> list[Path]:
    """One PNG per sweep in ``lines``: a panel per figure, a line per server; the median
    where a server has several lines at one x (e.g. two runs in one file)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for sweep, (x_name, log_base, panels) in PANELS.items():
        points = [line for line in lines if line["sweep"] == sweep and "error" not in line]
        if not points:
            continue
        labels = {line["x"]: line.get("x_label", str(line["x"])) for line in points}
        figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for axis, (key, y_name) in zip(axes[0], panels):
            for server in sorted({line["server"] for line in points}):
                by_x: dict = {}
                for line in points:
                    if line["server"] == server and line.get(key) is not None:
                        by_x.setdefault(line["x"], []).append(line[key])
                xs = sorted(by_x)
                axis.plot(xs, [statistics.median(by_x[x]) for x in xs], marker="o", label=server,
                          color=SERVER_COLOURS.get(server))
            axis.set_xscale("log", base=log_base)
            axis.set_xticks(sorted(labels), [labels[x] for x in sorted(labels)], rotation=40 if sweep == "image" else 0,
                            ha="right" if sweep == "image" else "center")
            axis.minorticks_off()
            axis.set_xlabel(x_name)
            axis.set_ylabel(y_name)
            axis.set_ylim(bottom=0)
            axis.grid(True, alpha=0.3)
            axis.legend()
        loads = [line["loadavg"][0] for line in points if line.get("loadavg")]
        model = Path(points[0].get("model", "?")).name
        load_text = f", load avg {min(loads):.1f}-{max(loads):.1f}" if loads else ""
        figure.suptitle(f"{sweep} sweep: {model}, {points[0].get('output_tokens', '?')} output tokens{load_text}")
        figure.tight_layout()
        path = plot_dir / f"scaling_{sweep}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written

