"""The speed benchmarks' cores at micro size (CPU, seconds): each contestant does the same work as the others.

Timings are not asserted (they are the benchmarks' job); what is asserted is what makes a comparison honest.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys

import pytest
import torch

from benchmarks.common import Job, timed_span, window_batches
from scale.utils.compat import peft_adapts_parameters
from tests.bounds import fp32_paths_rel
from tests.conftest import ROOT

MICRO = dict(shape="tiny", seq=16, micro_batch_size=2, gradient_accumulation_steps=2, steps=3, warmup=1)


def test_window_batches_and_timed_span():
    job = Job(**MICRO)
    windows = window_batches(job.examples()[:6], 2, 2, 5)       # 6 rows = 3 batches: windows of 2, 1, then again
    assert [len(w) for w in windows] == [2, 1, 2, 1, 2]
    assert timed_span([1.0, 3.0, 6.0], [10, 20, 30], warmup=1) == (5.0, 50)
    with pytest.raises(ValueError):
        timed_span([1.0, 2.0], [1, 1], warmup=0)


def test_bare_loop_and_harness_agree():
    from benchmarks.bare_loop import compare, logged_losses

    assert logged_losses([[1.0, 1.0], [3.0, 1.0], [5.0, 2.0]], log_every=2) == [2.0, 2.5]  # ratios of sums

    res = compare(Job(**MICRO), repeats=1)
    assert res["loss_max_rel_diff"] < 1e-5
    assert len(res["losses"]["harness"]) == len(res["losses"]["bare"]) == 3
    assert all(t > 0 for ts in res["tokens_per_s"].values() for t in ts) and math.isfinite(res["ratio"][0])


def test_bare_loop_command_on_cpu():
    """``python benchmarks/bare_loop.py --device cpu`` at a micro shape, as a user runs it: both contestants train
    and the table reports their loss trajectories within fp32 round-off of each other (same model, rows, loss)."""
    cmd = [sys.executable, "benchmarks/bare_loop.py", "--device", "cpu", "--shape", "tiny", "--seq", "16", "--batch",
           "2", "--ga", "2", "--steps", "3", "--warmup", "1", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| **ratio harness/bare** (per pair) |" in done.stdout
    diff = float(done.stdout.split("max relative difference harness vs bare over all runs: ")[1].split()[0])
    assert diff < 1e-5   # as test_bare_loop_and_harness_agree


def test_parity_mode_selection_and_unlaunchable_rows(monkeypatch, capsys):
    """benchmarks/parity.py: ``--modes`` splits at commas outside parentheses and matches whole names (``2x(4,2)``
    holds a comma; a fragment such as ``2)`` used to select every ``(2,2)`` row); a row starting more processes than
    the machine takes is found before launch by the launcher's own check."""
    import scale.distributed.launch
    from benchmarks import parity
    from tests.launching import modes

    table = modes()
    four = "ulysses sp2 zero2 4x(2,2) dp2"
    assert parity.split_modes(f"ulysses sp2 zero1 2x(4,2),{four}") == ["ulysses sp2 zero1 2x(4,2)", four]
    assert parity.split_modes("single, ddp") == ["single", "ddp"]
    assert list(parity.select(table, parity.split_modes(f"ulysses sp2 zero1 2x(4,2),{four}"))) == [
        "single 1x(8,1)", "ulysses sp2 zero1 2x(4,2)", four]
    assert list(parity.select(table, ["zero3 2x(2,2)"])) == ["single 1x(8,1)", "zero3 2x(2,2)"]   # a whole name only
    assert [k for k in parity.select(table, ["ulysses"])][1:] == [k for k in table if k.startswith("ulysses")]
    assert parity.select(table, []) == table
    with pytest.raises(SystemExit) as e:
        parity.select(table, ["zero4"])
    assert e.value.code == 2 and "--modes item 'zero4' selects no mode" in capsys.readouterr().err
    counts = {name: parity.local_processes(cmds) for name, (cmds, _) in table.items()}
    assert counts["single 1x(8,1)"] == 1 and counts["2 nodes x 1 proc (2,2)"] == 2
    assert counts["deepspeed launcher 2x(2,2)"] == counts["fsdp2 2x(2,2)"] == counts["ddp 2x(2,2)"] == 2
    assert counts[four] == counts["ulysses sp2 zero3 4x(2,2) dp2"] == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(scale.distributed.launch, "usable_cores", lambda: 2)
    assert parity.launch_problem(table[four][0]) == ("4 processes on this machine without a GPU and 2 CPU cores: "
                                                     "at most 2")
    assert parity.launch_problem(table["zero3 2x(2,2)"][0]) is None
    monkeypatch.setattr(scale.distributed.launch, "usable_cores", lambda: 4)
    assert parity.launch_problem(table[four][0]) is None


@pytest.mark.slow
def test_parity_skips_a_row_and_still_prints_its_summary(monkeypatch, capsys, tmp_path):
    import scale.distributed.launch
    from benchmarks import parity

    monkeypatch.setattr(scale.distributed.launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parity.main(["--modes", "ulysses sp2 zero2 4x(2,2) dp2", "--jobs", "reviews", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"| {'ulysses sp2 zero2 4x(2,2) dp2':<34} | skipped: 4 processes on this machine without a GPU" in out
    assert "skipped on this machine (1): ulysses sp2 zero2 4x(2,2) dp2" in out
    assert "max relative deviation: 0.000e+00" in out     # the reference row against itself


def test_gpu_tests_collect_without_error():
    """``pytest -m gpu --collect-only`` (what a GPU machine runs first) imports tests/test_gpu.py and selects every
    GPU test: an import or fixture error there shows on CPU."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "tests/test_gpu.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    names = {line.split("::")[1] for line in done.stdout.splitlines() if "::" in line}
    assert names == {"test_bf16_qlora_trains_and_beats_fp32_lora_per_step", "test_fsdp2_qlora_matches_single_gpu",
                     "test_liger_fused_loss_matches_the_chunked_loss", "test_sequence_parallel_matches_single_gpu"}


def test_trainer_and_ours_same_first_steps():
    from benchmarks.vs_trainer import compare

    res = compare(Job(**MICRO, log_every=1), repeats=1)
    ours = res["losses"]["ours"]
    for name in ("trainer", "trainer+keep"):
        theirs = res["losses"][name]
        assert len(theirs) == len(ours) == 3
        assert abs(theirs[0] - ours[0]) / ours[0] < 1e-4      # same model, batch and loss maths before any update
        assert max(abs(a - b) / a for a, b in zip(ours, theirs)) < 1e-4  # and the same updates after it
        assert res["ratio"][name][0] > 0


def test_trainer_and_ours_in_bf16_track_each_other():
    """Each contestant at a dtype of its own (``@bf16``): ours with scale.modeling's CPU bf16 paths, the Trainer
    with transformers' stock bf16 autocast, on the same model and rows: the losses agree within bf16 round-off."""
    from benchmarks.vs_trainer import compare

    res = compare(Job(**MICRO, log_every=1), repeats=1, contestants=("ours@bf16", "trainer+keep@bf16",
                                                                     "trainer+keep@fp32"))
    ours = res["losses"]["ours@bf16"]
    for name in ("trainer+keep@bf16", "trainer+keep@fp32"):
        assert len(res["losses"][name]) == len(ours) == 3
        assert max(abs(a - b) / a for a, b in zip(ours, res["losses"][name])) < 2e-2, (name, ours, res["losses"][name])
    assert set(res["ratio"]) == {"trainer+keep@bf16", "trainer+keep@fp32"}


def test_checkpointing_worker_same_losses_less_saved():
    from benchmarks.checkpointing_speed import worker

    job = dict(MICRO, gradient_accumulation_steps=1, min_len=16)
    off = worker(Job(**job, checkpointing=False), measure_saved=True)
    on = worker(Job(**job, checkpointing=True), measure_saved=True)
    assert off["losses"] == on["losses"]                         # recomputation does not change the maths
    assert on["saved_bytes"] < off["saved_bytes"]
    assert off["rss_peak"] >= off["rss_before"] > 0 and off["step_s"] > 0
    # The peak-RSS reset, in a fresh process as the benchmark uses it (one per run): in a process that already
    # freed large blocks, the allocator can serve 64 MiB from memory the kernel still counts as resident.
    code = ("import torch; from benchmarks.checkpointing_speed import peak_rss, reset_peak_rss; b = reset_peak_rss(); "
            "x = torch.ones(64 * 2**20 // 4); print(peak_rss() - b)")
    grown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(grown.stdout) >= 60 * 2**20                       # 64 MiB, touched


def test_gpu_script_dry_run_and_no_cuda_message(capsys):
    from benchmarks import gpu

    assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| tiny | LoRA bf16 |" in out and "| tiny | QLoRA nf4/bf16 |" in out
    assert "LoRA bf16: parameter elements by dtype {'bfloat16/frozen'" in out
    qlora = out.split("QLoRA nf4/bf16: parameter elements by dtype")[1]
    assert "'uint8/frozen'" in qlora and " 0 Linear4bit" not in qlora
    assert "| tiny | LoRA bf16 | 0.0" in out and "| n/a (no CUDA) | n/a |" in out   # scale-plan's prediction row
    mfus = [float(m) for m in re.findall(r"\n\| tiny \| [^|]+ \| [^|]+ \| [^|]+ \| ([\d.]+)% \|", out)]
    assert len(mfus) == 2 and all(0 <= m <= 100 for m in mfus), mfus
    assert "the faster of this CPU's bf16 and fp32 GEMM figures (dry run)" in out
    if not torch.cuda.is_available():
        assert gpu.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_dry_run_divides_by_the_faster_gemm_and_names_the_version(tmp_path, monkeypatch, capsys):
    """On a CPU whose bf16 GEMM probe measures a tenth of fp32 (AVX2), the dry run's MFU peak is the fp32 figure
    (against the bf16 one the tiny bf16 model's MFU came out above 100%); the report's header names scale's
    version; without a GPU the refusal gives the make form of --dry-run."""
    from accelerate import Accelerator

    from benchmarks import gpu, gpu_check
    from scale.training import precision
    from scale.utils.compat import installed

    monkeypatch.setenv("SCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "_MEASURED", {})
    monkeypatch.setattr(precision, "_time_gemm", lambda device, dtype, seconds, n, reps=3:
                        10e9 if dtype == torch.bfloat16 else 100e9)
    cfg = gpu.contestants("tiny", argparse.Namespace(seq=32, batch=2, ga=1, steps=3, warmup=1, threshold=2, lora_r=16,
                                                     checkpointing=False))["LoRA bf16"].config(str(tmp_path))
    peak = gpu.dry_run_peak(cfg, Accelerator(cpu=True))
    assert peak.flops == 100e9 and peak.source.startswith("100 GFLOP/s per device (measured: float32 GEMM")
    assert "- commit: " in gpu_check.header(True) and f"; scale {installed('scale')}\n" in gpu_check.header(True)
    assert installed("scale") == "0.1.0"
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert capsys.readouterr().err == (
            'benchmarks/gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); pass --dry-run (make '
            'gpu-check ARGS="--dry-run") to run the same sections on the CPU at tiny shapes.\n')


def test_speedup_throughput_and_profile_categories():
    from types import SimpleNamespace

    from benchmarks.speedup import categorize, throughput

    def row(step, tps, data_s, compute_s, mfu, pad):
        return {"step": step, "train/tokens_per_s": tps, "train/data_s": data_s, "train/compute_s": compute_s,
                "train/mfu": mfu, "train/pad_fraction": pad}

    rows = [row(1, 50.0, 0.0, 2.0, 0.1, 0.3), row(2, 100.0, 0.5, 0.5, 0.2, 0.1), row(3, 200.0, 0.0, 3.0, 0.4, 0.3)]
    res = {"rows": rows, "stamps": [(2.0, 1.0), (3.0, 2.0), (6.0, 4.0)], "peak": 1e9}  # (wall, CPU s) after each step
    t = throughput(res, warmup=1)                                       # steps 2 and 3: 100 + 600 tokens in 1 + 3 s
    assert t["tps"] == pytest.approx(700 / 4) and t["flops"] == pytest.approx((0.2 * 1 + 0.4 * 3) * 1e9)
    assert t["pad"] == pytest.approx(0.2) and t["tpc"] == pytest.approx(700 / 3) and t["cpu"] == 3.0  # CPU: 1 + 2 s

    def ev(name, us, parent=None, shapes=()):
        return SimpleNamespace(name=name, self_cpu_time_total=us, cpu_parent=parent, input_shapes=list(shapes),
                               device_type=SimpleNamespace(name="CPU"))

    opt = ev("Optimizer.step#AdamW.step", 10)
    events = [opt, ev("aten::mul", 3000, opt), ev("bitsandbytes::dequantize_4bit", 2000),
              ev("aten::mm", 4000, shapes=[[16, 576], [576, 49152]]),
              ev("aten::mm", 1000, shapes=[[264, 16], [16, 576]]),
              ev("aten::mm", 5000, shapes=[[264, 576], [576, 576]]), ev("aten::_log_softmax", 500),
              ev("aten::_scaled_dot_product_flash_attention_for_cpu", 700), ev("aten::add", 300)]
    cats = categorize(events, wall=0.02, steps=1, vocab=49152, rank=16)
    assert cats["optimizer (AdamW on the LoRA weights)"] == pytest.approx(3.01)  # ms: its ops and its own range
    assert cats["dequantize (NF4 -> compute dtype, forward and backward)"] == pytest.approx(2.0)
    assert cats["LM head (tail logits) and loss"] == pytest.approx(4.5)
    assert cats["LoRA matmuls"] == pytest.approx(1.0)
    assert cats["base matmuls (dequantized weights)"] == pytest.approx(5.0)
    assert cats["attention (sdpa)"] == pytest.approx(0.7)
    assert cats["host (Python, autograd engine, between ops)"] == pytest.approx(20 - 16.51)


def test_gpu_check_vllm_section_is_one_line_where_it_cannot_run(tmp_path, monkeypatch):
    """Section 8 (GRPO with rl.generator=vllm) in a dry run, or on a machine without vllm: the report holds one line,
    the refusal a run gets (no CUDA, or no package), and the section passes; --dry-run and make gpu-check list it."""
    import importlib.util

    from benchmarks import gpu_check

    out = tmp_path / "report.md"
    others = [s for s in gpu_check.SECTIONS if s != "vllm"]
    assert gpu_check.main(["--dry-run", "--skip", *others, "--out", str(out)]) == 0
    section = out.read_text().split("## 8. GRPO with rl.generator=vllm: the engine against the trainer, steps through "
                                    "the loop\n\n")[1]
    assert section.startswith("skipped: rl.generator=vllm needs a CUDA device and this run has none; set "
                              "rl.generator=transformers (in-process generate, any device)\n\n("), section
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    text, info = gpu_check.run_vllm(False)
    assert (text, info) == ("skipped: rl.generator=vllm needs the vllm package: pip install 'scale[vllm]' (or set "
                            "rl.generator=transformers)", {"ok": True, "skipped": True})
    assert "8. ``vllm``" in gpu_check.__doc__ and "GRPO with the vLLM generator" in (ROOT / "Makefile").read_text()


def test_gpu_check_dry_run_report(tmp_path):
    """``benchmarks/gpu_check.py --dry-run`` (what CI runs of ``make gpu-check``): one Markdown report whose sections
    hold real values: the GPU tests' counts, the harness against the bare loop with the same losses, the fp32
    parity of one thread against all (each loss and adapter within its float32 bound), the largest micro-batch
    the plan fits, equal to ``scale.planner.autobatch.largest_micro_batch``'s, trained at both sizes, the casts of
    LoRA and QLoRA with the mixed-precision paths off and on (fewer with them, the Liger rows refused on CPU), and
    expert LoRA split against peft (a lower layer peak, the same first loss). The ``bench`` section is
    benchmarks/gpu.py's dry run, asserted by test_gpu_script_dry_run_and_no_cuda_message; skipped here for time."""
    import re

    from benchmarks import gpu_check
    from scale.config.load import load_config
    from scale.planner.autobatch import largest_micro_batch

    out = tmp_path / "report.md"
    assert gpu_check.main(["--dry-run", "--skip", "bench", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.startswith("# scale GPU check\n") and "failed sections: none" in report
    if not torch.cuda.is_available():
        # every gpu test (tests/test_gpu.py 4, mixed paths 3, kernels 2) skipped, none failed; the CPU tests deselected
        assert re.search(r"\n    9 skipped, \d+ deselected in ", report), report[:1500]
    bare = float(report.split("max relative difference harness vs bare over all runs: ")[1].split()[0])
    assert bare < 1e-5                                            # as test_bare_loop_and_harness_agree
    loss_rows = re.findall(r"\| loss, step (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| True \|",
                           report)
    assert [int(r[0]) for r in loss_rows] == [1, 2]
    for _, a, b, diff, bound in loss_rows:
        assert 9 < float(b) < 12 and abs(float(a) - float(b)) <= float(bound)   # ln(49152) = 10.8 at random init
    adapter = re.search(r"\| adapters after 2 steps, 28 tensors .* \| ([\d.e+-]+) \| ([\d.e+-]+) \| True \|", report)
    assert adapter and float(adapter.group(1)) <= float(adapter.group(2)) < 1e-4
    best = int(report.split("largest micro-batch whose plan fits 90% of 1.2 GiB: **")[1].split("**")[0])
    common = ["train.max_steps=4", "train.log_every=2", "log.trackers=[]", "train.eval_every=0", "data.eval_size=32",
              "train.save_every=0", "train.save_adapter=false", "train.resume_from=null"]
    assert best == largest_micro_batch(load_config(ROOT / "configs/train/tiny_cpu.yaml", common), 1.2, 0.9)[0] > 8
    rates = re.findall(r"\n\| (\d+) \| ([\d,]+) \| ([\d.]+) \| n/a \| ([\d.]+) \|", report)
    assert [int(r[0]) for r in rates] == [8, best] and all(float(r[1].replace(",", "")) > 0 for r in rates)
    casts = {(job, variant): (int(c), int(ops), float(loss)) for job, variant, c, ops, loss in re.findall(
        r"\n\| (LoRA bf16|QLoRA nf4/bf16) \| (paths off|paths on) \| (\d+) \| (\d+) \| [\d,]+ \| ([\d.]+) \|", report)}
    for job in ("LoRA bf16", "QLoRA nf4/bf16"):
        off, on = casts[(job, "paths off")], casts[(job, "paths on")]
        assert on[0] <= off[0] - 14 and on[1] < off[1], (job, off, on)  # >= one cast fewer per LoRA layer (2 x 7)
        assert 9 < on[2] < 12 and 9 < off[2] < 12                         # ln(49152) = 10.8 at random init
        if not torch.cuda.is_available():
            assert f"| {job} | paths on + liger | refused: model.kernels=liger needs a CUDA GPU" in report
    assert "\n## 8. GRPO with rl.generator=vllm" in report and "failed sections: none" in report  # (dry: one line)
    # 7. expert LoRA, split against peft: the layer's peak (live tensor bytes, the same count on every machine) is
    # lower on the split path and scale-plan counts it within 5%; the tiny model's first loss and gradient norm agree
    # within two float32 paths' bound (vocabulary 512, hidden 64: tests/bounds.py); the last line a script reads
    moe = report.split("## 7. Mixture-of-experts LoRA")[1]
    if not peft_adapts_parameters():  # the lowest tier's peft 0.15: no expert LoRA on either path
        assert re.search(r"skipped: peft [\d.]+ cannot adapt fused expert parameters", moe), moe[:500]
        return
    layer_peak = float(re.search(r"\nfp32: split/peft peak ([\d.]+), time [\d.]+\n", moe).group(1))
    assert 0 < layer_peak < 1
    dev = float(re.search(r"\n\| split \| [\d.e+-]+ \| [\d.e+-]+ \| \d+ \| ([\d.e+-]+) \|", moe).group(1))
    assert dev <= fp32_paths_rel(512, 64)
    assert re.search(r"\nsplit/peft: peak [\d.]+, time [\d.]+\n", moe)
    # scale-plan's count of the layer (fake tensors) against the live bytes measured, both paths: the same tensors
    planned = [float(r) for r in re.findall(r"\| [\d.e+-]+ \(([\d.]+)\) \|", moe)]
    assert len(planned) == 2 and all(abs(r - 1) <= 0.05 for r in planned), planned
