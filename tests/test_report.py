"""``scale.report``: PNGs and summary table from hand-written metrics.jsonl files with known values."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from scale import report as R

# run_a logs every key the loop will log on a GPU (memory, data vs compute); run_b is an older run
# without them, evaluated twice, with a check/* line at the end as the loop writes it.
RUN_A = [
    {"step": 0, "eval/loss": 7.1, "eval/target_nll": 6.98, "eval/accuracy": 0.72, "eval/examples": 400},
    {"step": 2, "train/loss": 2.5, "train/lr": 1e-4, "train/grad_norm": 1.0, "train/tokens_per_s": 1000.0,
     "train/tail_tokens_per_s": 100.0, "train/samples_per_s": 50.0, "train/steps_per_s": 2.5,
     "train/peak_mem_gib": 3.0, "train/data_s": 0.1, "train/compute_s": 0.9},
    {"step": 4, "train/loss": 1.2, "train/lr": 2e-4, "train/grad_norm": 0.8, "train/tokens_per_s": 2000.0,
     "train/tail_tokens_per_s": 200.0, "train/samples_per_s": 100.0, "train/steps_per_s": 5.0,
     "train/peak_mem_gib": 3.25, "train/data_s": 0.2, "train/compute_s": 0.8},
    {"step": 6, "train/loss": 0.41, "train/lr": 1e-4, "train/grad_norm": 0.5, "train/tokens_per_s": 1500.0,
     "train/tail_tokens_per_s": 150.0, "train/samples_per_s": 75.0, "train/steps_per_s": 3.75,
     "train/peak_mem_gib": 3.1, "train/data_s": 0.15, "train/compute_s": 0.85},
    {"step": 6, "eval/loss": 0.4, "eval/target_nll": 0.376, "eval/accuracy": 0.8425, "eval/examples": 400},
]
RUN_B = [
    {"step": 0, "eval/loss": 7.1, "eval/target_nll": 6.98, "eval/accuracy": 0.72, "eval/examples": 400},
    {"step": 2, "train/loss": 3.0, "train/lr": 1e-3, "train/grad_norm": 2.0, "train/tokens_per_s": 3000.0,
     "train/tail_tokens_per_s": 300.0, "train/samples_per_s": 150.0, "train/steps_per_s": 7.5},
    {"step": 2, "eval/loss": 2.0, "eval/target_nll": 1.5, "eval/accuracy": 0.75, "eval/examples": 400},
    {"step": 4, "train/loss": 0.9, "train/lr": 5e-4, "train/grad_norm": 1.0, "train/tokens_per_s": 5000.0,
     "train/tail_tokens_per_s": 500.0, "train/samples_per_s": 250.0, "train/steps_per_s": 12.5},
    {"step": 4, "eval/loss": 0.95, "eval/target_nll": 0.9, "eval/accuracy": 0.79, "eval/examples": 400},
    {"step": 4, "check/base_unchanged": True, "check/lora_b_moved": True},
]
ROW_A = "| run_a | 6 | 0.4100 | 7.1000 → 0.4000 | 0.7200 → 0.8425 | 6.9800 → 0.3760 | 1500 | 3.25 |"
ROW_B = "| run_b | 4 | 0.9000 | 7.1000 → 0.9500 | 0.7200 → 0.7900 | 6.9800 → 0.9000 | 4000 | n/a |"
CORE_PNGS = {"loss.png", "target_nll.png", "accuracy.png", "lr.png", "grad_norm.png", "throughput.png"}


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def runs(tmp_path):
    return write_run(tmp_path / "run_a", RUN_A), write_run(tmp_path / "run_b", RUN_B)


def run_pixels(image, run_index: int) -> int:
    """Pixels in the colour of the ``run_index``-th run (matplotlib's C0, C1, ...)."""
    import numpy as np
    from matplotlib.colors import to_rgb

    return int((np.abs(image[..., :3] - np.array(to_rgb(f"C{run_index}"))).max(axis=-1) < 0.1).sum())


def test_two_runs_write_valid_pngs_and_exact_summary(runs, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "cmp"
    pngs, summary = R.report(list(runs), out)
    assert {p.name for p in pngs} == CORE_PNGS | {"memory.png", "data_vs_compute.png"}  # no mfu, no loss_scale
    assert sorted(p.name for p in out.glob("*.png")) == sorted(p.name for p in pngs)
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        image = imread(png)
        assert image.ndim == 3 and image.shape[0] >= 400 and image.shape[1] >= 700, (png, image.shape)
        assert image[..., :3].std() > 0, png
        # Not just axes: an empty axes with ticks already has pixel std 0.09, so count each run's line
        # colour (about 1,000 pixels per run measured; a legend entry alone is well under 300). A figure of eval
        # points only has no line: 166 pixels measured for run_a's 2 labelled points, a legend entry alone 77.
        least = 120 if png.name in ("target_nll.png", "accuracy.png") else 300
        assert run_pixels(image, 0) > least, png
        if png.name in CORE_PNGS:  # run_b has no memory or data/compute keys
            assert run_pixels(image, 1) > least, png
        else:
            assert run_pixels(image, 1) == 0, png
    lines = (out / "summary.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == ("| run | steps | final train/loss | eval/loss | eval/accuracy | eval/target_nll (nats) "
                        "| median tokens/s | peak memory (GiB) |")
    assert lines[2:] == [ROW_A, ROW_B]
    assert summary == (out / "summary.md").read_text(encoding="utf-8")


def test_eval_figures_are_points_labelled_with_their_steps(runs):
    """An evaluation is a measurement at a step: drawn as points without a line joining them (two evaluations
    used to look like a straight dashed trend), each labelled with its step; train keys stay lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    R.draw_panel(ax, R.FIGURES[0][2][0], {"run_b": R.load_run(runs[1])}, {})
    lines = {line.get_label(): line for line in ax.lines}
    evaluated, trained = lines["run_b eval"], lines["run_b train"]
    assert evaluated.get_linestyle() == "None" and evaluated.get_marker() == "o"
    assert list(evaluated.get_xdata()) == [0, 2, 4] and list(evaluated.get_ydata()) == [7.1, 2.0, 0.95]
    assert trained.get_linestyle() == "-" and list(trained.get_xdata()) == [2, 4]
    assert [(t.get_text(), t.xy) for t in ax.texts] == [("step 0", (0, 7.1)), ("step 2", (2, 2.0)),
                                                        ("step 4", (4, 0.95))]


def test_run_without_optional_keys_skips_their_plots_and_column(runs, tmp_path):
    pngs, summary = R.report([runs[1]], tmp_path / "b")
    assert {p.name for p in pngs} == CORE_PNGS
    assert "peak memory" not in summary
    assert summary.splitlines()[2] == ROW_B.removesuffix(" n/a |")


def test_chat_run_plots_exact_match_and_padding_and_shows_only_its_eval_columns(tmp_path):
    """A prompt/completion or chat run logs exact match (no accuracy or target NLL) and the padding share."""
    rows = [{"step": 0, "eval/loss": 2.7623, "eval/exact_match": 0.0, "eval/examples": 98},
            *({"step": s, "train/loss": 3.0 / s, "train/lr": 5e-4, "train/grad_norm": 1.0,
               "train/tokens_per_s": 110.0, "train/pad_fraction": 0.05 * s} for s in (1, 2, 3)),
            {"step": 3, "eval/loss": 1.9103, "eval/exact_match": 0.0408, "eval/examples": 98}]
    run = write_run(tmp_path / "sft", rows)
    # An epoch-based run (max_steps null): the lr panel's schedule line takes its length from the last step.
    (run / "config.yaml").write_text("optim:\n  lr: 5.0e-4\n  warmup_steps: 1\ntrain:\n  max_steps: null\n"
                                     "  num_epochs: 1\n", encoding="utf-8")
    from scale.config.load import load_config
    from scale.training.schedule import lr_factor

    optim = load_config(run / "config.yaml").optim
    assert R.schedule_line(run, 3) == ([1, 2, 3], [5.0e-4 * lr_factor(s, optim, 3) for s in range(3)])
    pngs, summary = R.report([run], tmp_path / "out")
    assert {p.name for p in pngs} == {"loss.png", "exact_match.png", "pad_fraction.png", "lr.png",
                                      "grad_norm.png", "throughput.png"}
    assert summary.splitlines()[0] == ("| run | steps | final train/loss | eval/loss | eval/exact_match "
                                       "| median tokens/s |")
    assert summary.splitlines()[2] == "| sft | 3 | 1.0000 | 2.7623 → 1.9103 | 0.0000 → 0.0408 | 110 |"


def test_grpo_run_plots_its_rewards_kl_clipping_and_completions(tmp_path):
    """An online-RL run (loss.objective: grpo): every reward function's mean gets a line beside the total, train and
    eval; the KL, entropy, clip, completion and rollout figures are drawn; the summary's eval column is the
    held-out mean reward."""
    rows = [{"step": 0, "eval/reward/total/mean": 0.3, "eval/reward/exact_match/mean": 0.25,
             "eval/completions/mean_length": 4.0},
            *({"step": s, "train/loss": 0.01 * s, "train/lr": 1e-4, "train/grad_norm": 0.5,
               "train/tokens_per_s": 100.0, "train/kl": 0.01 * s, "train/entropy": 2.0,
               "train/clip_ratio/low_mean": 0.0, "train/clip_ratio/high_mean": 0.01,
               "train/clip_ratio/region_mean": 0.01, "train/logprob_mismatch": 1e-6,
               "train/reward/total/mean": 0.3 + 0.1 * s, "train/reward/exact_match/mean": 0.2 + 0.1 * s,
               "train/reward/regex/mean": 0.5, "train/completions/mean_length": 3.5,
               "train/completions/truncated_fraction": 0.1, "train/frac_reward_zero_std": 0.25,
               "train/rollout_tokens_per_s": 50.0, "train/rollout_fraction": 0.4} for s in (1, 2, 3)),
            {"step": 3, "eval/reward/total/mean": 0.7, "eval/reward/exact_match/mean": 0.65,
             "eval/completions/mean_length": 3.0}]
    run = write_run(tmp_path / "grpo", rows)
    pngs, summary = R.report([run], tmp_path / "out")
    assert {"rl_rewards.png", "rl_kl_entropy.png", "rl_clip.png", "rl_completions.png",
            "rl_rollout_time.png"} <= {p.name for p in pngs}
    (figure,) = R.reward_figure({"grpo": rows})
    assert [k for k, _ in figure[2][0].keys] == ["eval/reward/exact_match/mean", "eval/reward/total/mean",
                                                 "train/reward/exact_match/mean", "train/reward/regex/mean",
                                                 "train/reward/total/mean"]
    assert "eval/reward/total/mean" in summary.splitlines()[0] and "0.3000 → 0.7000" in summary.splitlines()[2]


def test_cli_default_out_dir_and_stdout(runs, capsys):
    assert R.main([str(runs[0]), str(runs[1])]) == 0
    out = runs[0] / "report"
    assert (out / "summary.md").is_file() and (out / "loss.png").is_file()
    printed = capsys.readouterr().out
    assert ROW_A in printed and ROW_B in printed and str(out) in printed


def test_same_dir_names_get_full_paths_as_labels(tmp_path):
    a, b = write_run(tmp_path / "x" / "run", RUN_A), write_run(tmp_path / "y" / "run", RUN_B)
    assert R.run_names([a, b]) == [str(a), str(b)]
    assert R.run_names([a]) == ["run"]


def test_missing_run_dir_names_the_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"run directory not found: {missing}"):
        R.report([missing])
    with pytest.raises(SystemExit) as exc:
        R.main([str(missing)])
    assert exc.value.code == 2
    assert f"error: run directory not found: {missing}" in capsys.readouterr().err


def test_dir_without_metrics_names_the_file(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no metrics file at {tmp_path / 'empty_dir' / 'metrics.jsonl'}"):
        R.report([tmp_path / "empty_dir"])


def test_empty_or_broken_metrics_names_the_file(tmp_path):
    empty = write_run(tmp_path / "empty", [])
    with pytest.raises(ValueError, match=f"{empty / 'metrics.jsonl'} is empty"):
        R.report([empty])
    broken = write_run(tmp_path / "broken", RUN_A)
    with open(broken / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"step": 8, "train/lo')  # a run killed mid-write
    with pytest.raises(ValueError, match=f"{broken / 'metrics.jsonl'} has a line that is not JSON"):
        R.report([broken])


def test_imports_without_matplotlib_and_plotting_names_the_extra(runs, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    monkeypatch.delitem(sys.modules, "scale.report")
    fresh = importlib.import_module("scale.report")
    with pytest.raises(ImportError, match=r"pip install 'scale\[report\]'"):
        fresh.report([runs[0]], tmp_path / "out")


def test_memory_from_zero_with_headroom_and_lr_schedule_at_every_step(runs, tmp_path):
    """Memory starts at 0 and ends above its peak; the lr panel draws the schedule of config.yaml at every
    step (a 2-step warm-up is invisible in points logged every 2 steps), on a linear axis."""
    from matplotlib.figure import Figure

    from scale.config.load import dump_config, load_config
    from scale.training.schedule import lr_factor
    from tests.conftest import TINY_YAML

    cfg = load_config(TINY_YAML, ["train.max_steps=6", "optim.warmup_steps=2", "optim.lr=2e-4"])
    dump_config(cfg, runs[0] / "config.yaml")
    rows = {"run_a": R.load_run(runs[0])}
    memory = next(p for f, _, ps in R.FIGURES if f == "memory.png" for p in ps)
    ax = Figure().subplots()
    R.draw_panel(ax, memory, rows, {"run_a": runs[0]})
    assert ax.get_ylim() == pytest.approx((0.0, 3.25 * R.HEADROOM))
    steps, lrs = R.schedule_line(runs[0], 6)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert lrs == [2e-4 * lr_factor(s, cfg.optim, 6) for s in range(6)] and lrs[0] == pytest.approx(1e-4)
    lr_panel = next(p for f, _, ps in R.FIGURES if f == "lr.png" for p in ps)
    ax = Figure().subplots()
    R.draw_panel(ax, lr_panel, rows, {"run_a": runs[0]})
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    schedule, logged = ax.get_lines()
    assert list(schedule.get_xdata()) == steps and list(logged.get_xdata()) == [2, 4, 6]
    assert R.clip_threshold(runs[0]) == cfg.optim.max_grad_norm


def test_every_figure_title_fits_within_its_figure(tmp_path, monkeypatch):
    """Each figure's title, as saved, lies inside the figure (the loss title, centred and too long for the 7-inch
    figure, ran off both edges; now it wraps at the width the renderer measures)."""
    from matplotlib.figure import Figure

    keys = [k for _, _, panels in R.FIGURES for p in panels for k, _ in p.keys]
    rows = [{"step": s, **{k: 1.0 + s for k in keys}} for s in range(4)]
    seen = {}
    save = Figure.savefig

    def check(fig, path, *args, **kwargs):
        save(fig, path, *args, **kwargs)
        box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
        seen[Path(path).name] = (box.x0, box.x1, fig.bbox.width)

    monkeypatch.setattr(Figure, "savefig", check)
    written = R.plot({"run": rows}, tmp_path)
    assert sorted(seen) == sorted(p.name for p in written) and "loss.png" in seen
    for name, (left, right, width) in seen.items():
        assert 0 <= left and right <= width, (name, left, right, width)
