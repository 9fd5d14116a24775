"""`make bench`: run every benchmark, collect their tables into `bench/results.md`, draw PNGs.

    .venv/bin/python bench/run_all.py [--only 1 3] [--quick]

Each benchmark is its own script (run it alone for details; its docstring says what it measures
and against what) and prints a Markdown table whose rows carry our figure, the peer's or the
limit's figure from the same run, and the ratio. This script runs them one after the other, each
in a fresh process with a time limit, keeps each one's table verbatim with its command, wall time
and exit status, and draws one PNG per benchmark under `bench/plots/`. A benchmark that fails or
runs out of time is reported as such in the results, never dropped. `--quick` runs smaller sizes
(a smoke run, not the numbers to quote). `--only` reruns some rows and keeps the others' sections
of the existing results.md as they were (their status says when they ran).
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass
class Bench:
    row: int
    title: str
    args: list[str]
    quick: list[str]
    limit_s: int
    # kind: bar|line, x: label column(s), y: value columns, ylabel
    plot: dict = field(default_factory=dict)


BENCHES = [
    Bench(
        1,
        "Rollout tokens/s: our vLLM rollout path vs Hugging Face generate (TRL without vLLM)",
        ["bench/rollout_throughput.py", "--repeats", "2"],
        ["--sizes", "tiny", "--repeats", "1"],
        3600,
        dict(
            kind="bar",
            x=["model"],
            y=["ours tok/s", "HF generate tok/s"],
            ylabel="generated tokens / s",
        ),
    ),
    Bench(
        2,
        "Wall time to a held-out success target on a multi-step tool task (tools/calculator-v0, the real policy): "
        "our loop vs TRL GRPOTrainer's tool loop",
        ["bench/calculator_vs_trl.py", "--plot", "bench/plots/row2-curves.png"],
        ["--max-steps", "1", "--eval-every", "1", "--episodes", "16"],
        7200,
    ),  # its own plot: the curves
    Bench(
        3,
        "Weight sync to N rollout workers vs a plain memory copy of the same bytes",
        ["bench/weight_sync.py"],
        ["--hidden", "128", "--layers", "2", "--repeats", "2"],
        1200,
        dict(
            kind="bar",
            x=["model", "transport", "publish"],
            y=["memcpy s", "publish s", "slowest load s", "end to end s"],
            ylabel="seconds",
        ),
    ),
    Bench(
        4,
        "Learner step time and peak memory vs trajectory length: policy/ (KDA + MLA) vs a softmax stack",
        ["bench/policy_long_context.py"],
        ["--lengths", "1024", "2048", "--k3-lengths", "1024"],
        5400,
        dict(
            kind="line",
            x=["tokens"],
            y=["hybrid MiB", "softmax MiB"],
            ylabel="peak MiB",
            y2=["hybrid s", "softmax s"],
            y2label="seconds",
        ),
    ),
    Bench(
        5,
        "Sandboxed tool-call latency per backend vs a bare subprocess",
        ["bench/sandbox_latency.py"],
        ["--calls", "5"],
        900,
        dict(kind="bar", x=["command", "runner"], y=["median ms"], ylabel="median ms per call"),
    ),
    Bench(
        6,
        "Async vs sync iterations per minute with slow environments",
        ["bench/async_vs_sync.py"],
        ["--iterations", "3", "--repeats", "1"],
        1800,
        dict(
            kind="bar",
            x=["schedule", "max_staleness", "learner threads"],
            y=["iterations / min"],
            ylabel="iterations / min",
        ),
    ),
    Bench(
        7,
        "policy/ model decode tokens/s (native engine, vLLM plugin) vs full recompute, and cache bytes per token",
        ["bench/native_decode.py"],
        ["--contexts", "1024", "4096", "--decode", "9"],
        1800,
        dict(
            kind="line",
            x=["context"],
            y=["native decode tok/s", "vLLM plugin decode tok/s", "full recompute tok/s"],
            ylabel="tokens / s",
        ),
    ),
    Bench(
        8,
        "Learner step time and peak memory on long trajectories: bounded settings vs plain",
        ["bench/learner_long_trajectory.py"],
        ["--lengths", "2048", "8192"],
        3600,
        dict(
            kind="line",
            x=["tokens per episode"],
            y=["bounded peak MiB", "plain peak MiB"],
            ylabel="peak MiB",
            y2=["bounded s", "plain s"],
            y2label="seconds",
        ),
    ),
    Bench(
        9,
        "LoRA RL vs full fine-tuning on the real policy: sync bytes, learner memory, step time",
        ["bench/lora_vs_full.py"],
        ["--iterations", "1"],
        1800,
        dict(kind="bar", x=["run"], y=["MiB per sync"], ylabel="MiB per weight sync"),
    ),
    Bench(
        10,
        "Learner tokens/s per step on the real policy: fp32 vs bf16 mixed precision, against this machine's matmul throughput",
        ["bench/learner_throughput.py"],
        ["--episodes", "8"],
        1800,
        dict(kind="bar", x=["precision"], y=["tokens / s"], ylabel="learner tokens / s"),
    ),
    Bench(
        11,
        "Wall time to a target reward on a one-turn toy task (text/digits-v0, a tiny model): our loop vs TRL GRPOTrainer",
        ["bench/time_to_reward.py", "--plot", "bench/plots/row11-curves.png"],
        ["--target", "0.6", "--max-steps", "40"],
        3600,
        dict(kind="bar", x=["loop"], y=["seconds to target"], ylabel="seconds to target reward"),
    ),
    Bench(
        12,
        "Row 2 in bf16 over three training seeds: both learners under bf16 autocast, our engines in bf16; our loop vs TRL GRPOTrainer's tool loop",
        [
            "bench/calculator_vs_trl.py",
            "--precision",
            "bf16",
            "--seeds",
            "0",
            "1",
            "2",
            "--plot",
            "bench/plots/row12-curves.png",
        ],
        # three training seeds (~27 min each here): one seed's crossing step is too noisy to quote alone
        ["--max-steps", "1", "--eval-every", "1", "--episodes", "16", "--seeds", "0"],
        10800,
    ),  # its own plot: the curves
    Bench(
        13,
        "Learner seconds and tokens per episode as the horizon grows (long/oncall-v0, the real policy): compacted "
        "context segments vs step-wise samples (every turn re-prompted) vs one full context where it fits",
        ["bench/long_horizon_learner.py"],
        ["--horizons", "8", "--episodes", "2"],
        3600,
        dict(
            kind="line",
            x=["horizon"],
            y=["compact s", "step-wise s"],
            ylabel="learner seconds per episode",
        ),
    ),
]

GPU_HEADING = "## GPU checks (run by hand on a lent GPU machine)"


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The Markdown tables in `text`: (header, rows) each."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-", lines[i + 1]):
            cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
            header, rows = cells(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def number(cell: str) -> float | None:
    m = re.match(r"^-?[\d,]*\.?\d+", cell.replace("`", "").strip())
    return float(m.group(0).replace(",", "")) if m else None


def draw(bench: Bench, text: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [t for t in tables(text) if all(c in t[0] for c in bench.plot["x"] + bench.plot["y"])]
    if not found:
        return False
    header, rows = found[0]
    col = {c: header.index(c) for c in header}
    labels = [" / ".join(r[col[c]].strip("`") for c in bench.plot["x"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    if bench.plot["kind"] == "bar":
        ys = bench.plot["y"]
        width = 0.8 / len(ys)
        for k, y in enumerate(ys):
            vals = [number(r[col[y]]) or 0.0 for r in rows]
            ax.bar([i + k * width for i in range(len(rows))], vals, width, label=y)
        ax.set_xticks(
            [i + width * (len(ys) - 1) / 2 for i in range(len(rows))],
            labels,
            rotation=20,
            ha="right",
            fontsize=8,
        )
    else:
        xs = [number(r[col[bench.plot["x"][0]]]) for r in rows]
        for y in bench.plot["y"]:
            ax.plot(xs, [number(r[col[y]]) for r in rows], marker="o", label=y)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(bench.plot["x"][0])
        if bench.plot.get("y2"):
            ax2 = ax.twinx()
            for y in bench.plot["y2"]:
                ax2.plot(xs, [number(r[col[y]]) for r in rows], marker="s", linestyle="--", label=y)
            ax2.set_ylabel(bench.plot["y2label"])
            ax2.legend(loc="upper center", fontsize=8)
    ax.set_ylabel(bench.plot["ylabel"])
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"row {bench.row}: {bench.title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def previous(text: str) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
    """An existing results.md's sections and summary (status, wall) by row, for `--only` runs."""
    body = text.partition(GPU_HEADING)[0]
    sections = {
        int(m.group(1)): m.group(0).rstrip() + "\n"
        for m in re.finditer(r"^## (\d+)\. .*?(?=^## |\Z)", body, flags=re.M | re.S)
    }
    summary = {
        int(m.group(1)): (m.group(2).strip(), m.group(3).strip())
        for m in re.finditer(r"^\| (\d+) \| [^|]+ \| ([^|]+) \| ([^|]+) \|$", body, flags=re.M)
    }
    return sections, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", type=int, nargs="+", help="row numbers to run")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--out", default=str(REPO / "bench" / "results.md"))
    args = ap.parse_args()
    out = Path(args.out)
    plots = out.parent / "plots"
    plots.mkdir(parents=True, exist_ok=True)

    import torch

    sections, summary = [], []
    old_sections, old_summary = (
        previous(out.read_text()) if args.only and out.exists() else ({}, {})
    )
    for b in BENCHES:
        if args.only and b.row not in args.only:
            if b.row in old_sections:  # kept from the last run of that row
                sections.append(old_sections[b.row])
                summary.append((b, *old_summary.get(b.row, ("kept", "–"))))
            continue
        cmd = [PY, *b.args, *(b.quick if args.quick else [])]
        shown = " ".join(["python", *cmd[1:]])
        print(f"[bench] row {b.row}: {shown}", flush=True)
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=b.limit_s)
            text, status = (
                r.stdout,
                ("ok" if r.returncode == 0 else f"failed (exit {r.returncode})"),
            )
            err = r.stderr
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err, status = "", f"stopped at its {b.limit_s} s limit"
        wall = time.perf_counter() - t0
        print(f"[bench] row {b.row}: {status} in {wall:.0f} s", flush=True)
        body = text.strip() or "(no output)"
        if status != "ok" and err:
            body += "\n\n```\n" + err.strip()[-2000:] + "\n```"
        png = plots / f"row{b.row}.png"
        drawn = status == "ok" and b.plot and draw(b, text, png)
        extra = [
            q
            for q in plots.glob(f"row{b.row}-*.png")
            if q.stat().st_mtime >= time.time() - wall - 1
        ]
        pictures = ([png] if drawn else []) + sorted(extra)
        sections.append(
            f"## {b.row}. {b.title}\n\n`{shown}` — {status}, {wall:.0f} s\n\n{body}\n"
            + "".join(f"\n![row {b.row}](plots/{q.name})\n" for q in pictures)
        )
        when = f" ({time.strftime('%Y-%m-%d %H:%M')})" if args.only else ""
        summary.append((b, status + when, f"{wall:.0f} s"))

    head = [
        "# longhorizon benchmarks",
        "",
        f"Written by `make bench` ({'quick sizes: smoke run' if args.quick else 'full sizes'}) on "
        f"{time.strftime('%Y-%m-%d %H:%M')} — {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"python {platform.python_version()}, torch {torch.__version__}. Every ratio below is measured side by side "
        "in the same run; absolute figures on this noisy 2-core machine move from run to run, the ratios less.",
        "",
        "| row | benchmark | status | wall |",
        "| ---: | --- | --- | ---: |",
        *[f"| {b.row} | {b.title} | {status} | {wall} |" for b, status, wall in summary],
        "",
    ]
    # the GPU checks are run by hand on a lent GPU machine (bench/gpu_*_check.py): kept across runs here
    kept = out.read_text().partition(GPU_HEADING)[2] if out.exists() else ""
    out.write_text(
        "\n".join(head) + "\n" + "\n".join(sections) + (f"\n{GPU_HEADING}{kept}" if kept else "")
    )
    print(f"[bench] wrote {out} and {plots}/", flush=True)
    return 0 if all(s.startswith("ok") for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
