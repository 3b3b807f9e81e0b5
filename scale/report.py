"""Run report: PNG plots and a markdown summary table from ``metrics.jsonl``, for people without W&B.

    python -m scale.report runs/default                        # writes runs/default/report/
    python -m scale.report runs/lr1e-3 runs/lr3e-4 --out cmp/  # one line per run, legend = run dir name

Every plot is against optimizer steps (the ``step`` of each ``metrics.jsonl`` line). A figure whose keys no
run logged (``train/peak_mem_gib`` on an old run, ``train/mfu`` on CPU) is skipped, not drawn empty.
matplotlib is imported only when plotting, so this module imports without it (``pip install 'scale[report]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.validation import ConfigError
from scale.training.metrics import read_jsonl
from scale.training.schedule import lr_factor

Rows = list[dict[str, Any]]


class Panel(NamedTuple):
    """One axes: a y label with its unit, the ``(key, line label)`` pairs drawn on it, and its y scale.

    ``from_zero`` starts the y axis at 0 for rates and sizes, so that interval-to-interval noise is not
    magnified into a trend; ``log`` suits keys that span decades (the learning rates of an LR sweep).
    """

    ylabel: str
    keys: list[tuple[str, str]]
    log: bool = False
    from_zero: bool = False


# Preference runs (loss.objective: dpo | simpo | orpo) log TRL's per-pair means (scale/objectives/preference.py):
# implicit rewards (DPO: beta x (policy - reference) summed tail logps; SimPO/ORPO: beta x per-token logps), their
# margin and how often chosen wins, and the policy's logps. Train keys are lines, held-out ones points.
PREFERENCE_FIGURES: list[tuple[str, str, list[Panel]]] = [
    ("rewards.png", "Preference rewards of chosen and rejected (left) and their margin (right)",
     [Panel("reward (beta x nats)", [("train/rewards/chosen", "train chosen"),
                                     ("train/rewards/rejected", "train rejected"),
                                     ("eval/rewards/chosen", "eval chosen"),
                                     ("eval/rewards/rejected", "eval rejected")]),
      Panel("margin (beta x nats)", [("train/rewards/margins", "train"), ("eval/rewards/margins", "eval")])]),
    ("reward_accuracy.png", "Preference accuracy (fraction of pairs whose chosen reward beats the rejected one)",
     [Panel("accuracy (fraction)", [("train/rewards/accuracies", "train"), ("eval/rewards/accuracies", "eval")],
            from_zero=True)]),
    ("logps.png", "Policy log-probabilities of chosen and rejected (DPO: summed over each side's tail; SimPO, "
     "ORPO: per token)",
     [Panel("log-probability (nats)", [("train/logps/chosen", "train chosen"),
                                       ("train/logps/rejected", "train rejected"),
                                       ("eval/logps/chosen", "eval chosen"),
                                       ("eval/logps/rejected", "eval rejected")])]),
]

# Online RL runs (loss.objective: grpo) log each round's rewards and completions and the trained tokens' KL,
# entropy and clip fractions (docs/rl.md); each reward function's mean gets its own line (reward_figure).
RL_FIGURES: list[tuple[str, str, list[Panel]]] = [
    ("rl_kl_entropy.png", "KL to the reference (left) and the policy's entropy (right), per trained token",
     [Panel("KL (nats/token)", [("train/kl", "")], from_zero=True),
      Panel("entropy (nats/token)", [("train/entropy", "")], from_zero=True)]),
    ("rl_clip.png", ("Clipped importance ratios (fraction of trained tokens) and the sampler-trainer log-prob "
                     "gap"),
     [Panel("fraction", [("train/clip_ratio/low_mean", "low"), ("train/clip_ratio/high_mean", "high"),
                         ("train/clip_ratio/region_mean", "either")], from_zero=True),
      Panel("|sampler - trainer| (nats/token)", [("train/logprob_mismatch", "")], from_zero=True)]),
    ("rl_completions.png", ("Completions: length (left) and the share cut at rl.max_completion_length or with "
                            "equal rewards in their group (right)"),
     [Panel("tokens", [("train/completions/mean_length", "train"), ("eval/completions/mean_length", "eval")],
            from_zero=True),
      Panel("fraction", [("train/completions/truncated_fraction", "truncated"),
                         ("train/frac_reward_zero_std", "groups without spread")], from_zero=True)]),
    ("rl_rollout_time.png", "Rollouts: sampling throughput (left) and its share of wall time (right)",
     [Panel("tokens/s", [("train/rollout_tokens_per_s", "")], from_zero=True),
      Panel("fraction of wall time", [("train/rollout_fraction", "")], from_zero=True)]),
]


def reward_figure(runs: dict[str, Rows]) -> list[tuple[str, str, list[Panel]]]:
    """The rewards of an online-RL run: the total and every function's mean, train (per round) and eval (greedy
    held-out completions); ``[]`` when no run logged one."""
    keys = sorted({k for rows in runs.values() for r in rows for k in r
                   if k.startswith(("train/reward/", "eval/reward/")) and k.endswith("/mean")})
    if not keys:
        return []
    label = {k: k.removeprefix("train/reward/").removeprefix("eval/reward/").removesuffix("/mean") for k in keys}
    return [("rl_rewards.png", ("Rewards: the weighted total and each function's mean (train: each round's sampled "
                                "completions; eval: greedy completions of the held-out prompts)"),
             [Panel("reward", [(k, f"{k.split('/')[0]} {label[k]}") for k in keys])])]


# (file name, title, panels). Keys sharing a panel share a unit; different units get their own panel.
FIGURES: list[tuple[str, str, list[Panel]]] = [
    ("loss.png", "Loss (SFT: weighted cross-entropy over each row's tail tokens; preference: mean pair loss)",
     [Panel("loss (nats/token; pairs: per pair)", [("train/loss", "train"), ("eval/loss", "eval")])]),
    ("target_nll.png", "Eval target NLL (-log p of the label token)",
     [Panel("NLL (nats/example)", [("eval/target_nll", "")])]),
    ("accuracy.png", "Eval accuracy (argmax over the label tokens)",
     [Panel("accuracy (fraction)", [("eval/accuracy", "")])]),
    ("exact_match.png", "Eval exact match (teacher forced: every completion token is the argmax)",
     [Panel("exact match (fraction)", [("eval/exact_match", "")], from_zero=True)]),
    ("lr.png", "Learning rate (line: the schedule at every step; dots: logged)",
     [Panel("learning rate", [("train/lr", "")], from_zero=True)]),
    ("grad_norm.png", "Gradient norm before clipping (dashed: optim.max_grad_norm)",
     [Panel("L2 norm", [("train/grad_norm", "")], from_zero=True)]),
    ("throughput.png", "Training throughput (mean over each log interval)",
     [Panel("tokens/s", [("train/tokens_per_s", "")], from_zero=True)]),
    ("pad_fraction.png", "Padding (padded / computed positions of each log interval's micro-batches)",
     [Panel("pad fraction", [("train/pad_fraction", "")], from_zero=True)]),
    ("memory.png", "Peak memory", [Panel("peak memory (GiB)", [("train/peak_mem_gib", "")], from_zero=True)]),
    ("data_vs_compute.png", "Time per log interval: waiting on data vs computing",
     [Panel("time (s)", [("train/data_s", "data"), ("train/compute_s", "compute")], from_zero=True)]),
    ("mfu.png", "Model FLOPs utilisation",
     [Panel("MFU (fraction of peak FLOP/s)", [("train/mfu", "")], from_zero=True)]),
    ("loss_scale.png", "Mixed-precision loss scale", [Panel("loss scale", [("train/loss_scale", "")], log=True)]),
    *PREFERENCE_FIGURES,
    *RL_FIGURES,
]
MAX_STEP_LABELS = 12  # eval points labelled with their step when a run has at most this many evaluations
HEADROOM = 1.15  # from_zero panels end 15% above their largest value, so no line runs along the top frame


def schedule_line(run_dir: Path, last_step: int) -> tuple[list[int], list[float]] | None:
    """The learning rate at every optimizer step, from the run's ``config.yaml`` and :mod:`scale.training.schedule`
    (the logged ``train/lr`` has one point per log interval, which hides a warm-up shorter than it).

    ``last_step`` (the run's last logged step) stands for the schedule's length when the run was set by
    ``train.num_epochs``: its step count came from the data, and a finished run logs its final evaluation there.
    """
    try:
        cfg = load_config(run_dir / "config.yaml")
    except (OSError, ConfigError):
        return None
    total = cfg.train.max_steps or last_step
    steps = list(range(total))
    # train/lr at logged step s is the rate optimizer step s used, i.e. lr_factor(s - 1).
    return [s + 1 for s in steps], [cfg.optim.lr * lr_factor(s, cfg.optim, total) for s in steps]


def clip_threshold(run_dir: Path) -> float | None:
    """``optim.max_grad_norm`` from the run's ``config.yaml``, or None."""
    try:
        return load_config(run_dir / "config.yaml").optim.max_grad_norm
    except (OSError, ConfigError):
        return None


def load_run(run_dir: str | Path) -> Rows:
    """Read ``<run_dir>/metrics.jsonl``.

    Raises:
        FileNotFoundError: ``run_dir`` or its ``metrics.jsonl`` does not exist (the message names the path).
        ValueError: ``metrics.jsonl`` is empty or has a line that is not JSON.
    """
    run, path = Path(run_dir), Path(run_dir) / "metrics.jsonl"
    if not run.is_dir():
        raise FileNotFoundError(f"run directory not found: {run}")
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}: is {run} a scale run directory (output_dir)?")
    try:
        rows = read_jsonl(path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} has a line that is not JSON ({exc})") from exc
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged anything yet")
    return rows


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of every line that logged ``key``, in file order."""
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def summarize(runs: dict[str, Rows]) -> str:
    """A markdown table, one row per run: last step, final train loss, eval first → last, throughput, memory.

    The eval columns are those some run logged (classification: accuracy and target NLL; prompt/completion
    and chat: exact match; preference pairs: reward accuracy and margin; online RL: the held-out mean reward);
    a run without one shows ``n/a``.
    """
    with_mem = any(series(rows, "train/peak_mem_gib")[1] for rows in runs.values())
    evals = [(key, title) for key, title in (("eval/accuracy", "eval/accuracy"),
                                             ("eval/target_nll", "eval/target_nll (nats)"),
                                             ("eval/exact_match", "eval/exact_match"),
                                             ("eval/rewards/accuracies", "eval/rewards/accuracies"),
                                             ("eval/rewards/margins", "eval/rewards/margins"),
                                             ("eval/reward/total/mean", "eval/reward/total/mean"))
             if any(series(rows, key)[1] for rows in runs.values())]

    def span(rows: Rows, key: str) -> str:
        values = series(rows, key)[1]
        return f"{values[0]:.4f} → {values[-1]:.4f}" if values else "n/a"

    def last(values: list[float], fmt: str) -> str:
        return format(values[-1], fmt) if values else "n/a"

    head = ["run", "steps", "final train/loss", "eval/loss", *(title for _, title in evals),
            "median tokens/s"] + (["peak memory (GiB)"] if with_mem else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in runs.items():
        tokens = series(rows, "train/tokens_per_s")[1]
        cells = [name, str(max(int(r["step"]) for r in rows)), last(series(rows, "train/loss")[1], ".4f"),
                 span(rows, "eval/loss"), *(span(rows, key) for key, _ in evals),
                 f"{statistics.median(tokens):.0f}" if tokens else "n/a"]
        if with_mem:
            mem = series(rows, "train/peak_mem_gib")[1]
            cells.append(f"{max(mem):.2f}" if mem else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, Rows], out: Path, run_dirs: dict[str, Path] | None = None) -> list[Path]:
    """Write one PNG per figure in :data:`FIGURES` that has data; return their paths.

    Colour identifies the run; within a panel, line style identifies the key. Eval keys are round points, not
    joined (a run evaluates only a few times), each labelled with its step; train keys are lines, with dots when
    they have few points. With ``run_dirs``, the
    learning-rate panel draws each run's schedule at every step and the gradient-norm panel its clipping
    threshold, both read from the run's ``config.yaml``.

    Raises:
        ImportError: matplotlib is not installed (the message gives the pip command).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: files only, no display needed
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("scale.report draws its plots with matplotlib: pip install 'scale[report]'") from exc
    written = []
    for filename, title, panels in [*FIGURES, *reward_figure(runs)]:
        panels = [p for p in panels if any(series(rows, k)[0] for rows in runs.values() for k, _ in p.keys)]
        if not panels:
            continue
        fig = Figure(figsize=(max(7.0, 4.5 * len(panels)), 4.2), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
            draw_panel(ax, panel, runs, run_dirs or {})
        fit_title(fig, title)
        fig.savefig(out / filename)
        written.append(out / filename)
    return written


def fit_title(fig: Any, title: str, margin: float = 0.96) -> Any:
    """Set ``title`` as ``fig``'s suptitle, wrapped at word boundaries into as many lines as it takes for each to
    fit ``margin`` of the figure's width, as the renderer measures the text (a fixed character count clipped the
    loss figure's title at both edges: centred, it ran off the 7-inch figure on either side). Returns the text."""
    text = fig.suptitle(title)
    renderer = fig.canvas.get_renderer()
    width = text.get_window_extent(renderer).width
    room = margin * fig.bbox.width
    if width > room:
        chars = max(20, int(len(title) * room / width))
        while True:
            text.set_text(textwrap.fill(title, chars))
            if text.get_window_extent(renderer).width <= room or chars <= 20:
                break
            chars -= 4
    return text


def draw_panel(ax: Any, panel: Panel, runs: dict[str, Rows], run_dirs: dict[str, Path]) -> None:
    """Draw ``panel``'s keys for every run on the matplotlib axes ``ax`` (see :func:`plot`)."""
    from matplotlib.ticker import MaxNLocator

    top = 0.0
    for i, (name, rows) in enumerate(runs.items()):
        run_dir = run_dirs.get(name)
        for j, (key, label) in enumerate(panel.keys):
            steps, values = series(rows, key)
            if not steps:
                continue
            top = max(top, *values)
            evaluated = key.startswith("eval/")
            # Held-out keys sharing a panel (chosen, rejected) tell themselves apart by their marker.
            nth_eval = sum(k.startswith("eval/") for k, _ in panel.keys[:j])
            marker = ("o", "s", "^", "v")[nth_eval % 4] if evaluated else ("." if len(steps) <= 50 else None)
            # An evaluation is a measurement at its step, not a curve: points, no line joining them.
            style = "none" if evaluated else ("-", "--", ":")[j % 3]
            line = (schedule_line(run_dir, max(int(r["step"]) for r in rows))
                    if key == "train/lr" and run_dir is not None else None)
            if line is not None:  # the schedule as a line, the logged rates as dots on it
                ax.plot(*line, color=f"C{i % 10}", linestyle=style, label=f"{name} schedule".strip())
                top = max(top, *line[1])
                style, label, marker = "none", "logged", marker or "."
            ax.plot(steps, values, color=f"C{i % 10}", linestyle=style, marker=marker, label=f"{name} {label}".strip())
            if evaluated and len(steps) <= MAX_STEP_LABELS:  # each point says its step
                for step, value in zip(steps, values):
                    ax.annotate(f"step {step}", (step, value), textcoords="offset points", xytext=(4, 4),
                                fontsize="x-small", color=f"C{i % 10}")
            clip = clip_threshold(run_dir) if key == "train/grad_norm" and run_dir is not None else None
            if clip is not None and clip <= 2 * max(values):  # far above the curve it would flatten it
                ax.axhline(clip, color=f"C{i % 10}", linestyle="--", linewidth=0.8)
                top = max(top, clip)
    ax.set(xlabel="optimizer step", ylabel=panel.ylabel, yscale="log" if panel.log else "linear")
    if panel.from_zero:
        ax.set_ylim(bottom=0, top=top * HEADROOM if top > 0 else None)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def run_names(run_dirs: list[Path]) -> list[str]:
    """Legend labels: each run directory's name, or its full path where two names collide."""
    names = [d.resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def report(run_dirs: list[str | Path], out: str | Path | None = None) -> tuple[list[Path], str]:
    """Write the PNGs and ``summary.md`` for ``run_dirs`` into ``out`` (default ``<first run>/report``).

    Returns:
        The PNG paths written and the summary table (markdown).
    """
    dirs = [Path(d) for d in run_dirs]
    names = run_names(dirs)
    runs = {name: load_run(d) for name, d in zip(names, dirs)}
    out = Path(out) if out is not None else dirs[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(runs, out, dict(zip(names, dirs)))
    summary = summarize(runs)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    return pngs, summary


def main(argv: list[str] | None = None) -> int:
    """``python -m scale.report RUN_DIR [RUN_DIR ...] [--out DIR]``; print the summary; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m scale.report", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (output_dir) to report on")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <first run>/report)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.run_dirs[0] / "report"
    try:
        pngs, summary = report(args.run_dirs, out)
    except (OSError, ValueError, ImportError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    sys.stdout.write(summary)
    sys.stdout.write(f"\nwrote {len(pngs)} plots and summary.md to {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
