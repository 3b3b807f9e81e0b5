"""Checkpoints and resume in one process: bit-exact continuation mid-epoch, atomic saves, config checks.

The 2-process versions (resume, SIGTERM, SIGKILL) are in tests/test_faults.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from scale.config.validation import ConfigError
from scale.train import run
from scale.training.checkpoint import CheckpointError, compare_configs, list_checkpoints, record_files, resolve_resume
from scale.training.metrics import read_jsonl
from scale.training.state import STATE_FILE
from scale.utils.fileio import sha256_file
from tests.conftest import tiny_cfg

# 20 rows, micro-batch 2, GA 2: 5 windows per epoch. K = 7 is the 2nd window of the 2nd epoch.
# Dropout on, so a resume that failed to restore the RNG would not be bit-exact (checked below).
JOB = ["data.max_train_examples=20", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
       "train.max_steps=14", "train.log_every=1", "train.eval_every=7", "lora.dropout=0.1",
       "model.gradient_checkpointing=false"]
K = 7


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def _record(ckpt):
    """Record a hand-edited checkpoint's files as if it had been written so (the edit is not damage)."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["files"] = record_files(ckpt)
    (ckpt / STATE_FILE).write_text(json.dumps(state))


def _losses(out):
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2K steps without interruption, checkpointing every K steps (K and 2K)."""
    out = tmp_path_factory.mktemp("ref")
    run(tiny_cfg(out, *JOB, f"train.save_every={K}"))
    _reset()
    return out


def test_checkpoint_layout_is_safetensors_and_state(reference):
    ckpts = list_checkpoints(reference)
    assert [p.name for p in ckpts] == ["step_000007", "step_000014"]
    files = sorted(p.name for p in ckpts[0].iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "custom_checkpoint_0.pkl", "optimizer.bin",
                     "optimizer_state.safetensors", "random_states_0.pkl", STATE_FILE]
    state = json.loads((ckpts[0] / STATE_FILE).read_text())
    assert (state["step"], state["epoch"], state["windows_in_epoch"], state["world_size"]) == (7, 1, 2, 1)
    # where it can be resumed: the mode, the data-parallel ranks and G = 2 x 2 x 1; every other file's size and hash
    assert (state["mode"], state["data_parallel_size"], state["global_batch_size"]) == ("single", 1, 4)
    assert sorted(state["files"]) == [f for f in files if f != STATE_FILE]
    for name, (size, digest) in state["files"].items():
        assert (ckpts[0] / name).stat().st_size == size and sha256_file(ckpts[0] / name) == digest
    # the portable optimizer state: AdamW's two moments and step count of every trainable tensor, whole
    moments = load_file(ckpts[0] / "optimizer_state.safetensors")
    assert len(moments) == 3 * 28 and all(moments[k].item() == 7.0 for k in moments if k.endswith("::step"))
    # Only the trainable tensors: LoRA A/B of 7 linear layers x 2 decoder layers.
    tensors = load_file(ckpts[0] / "adapter_model.safetensors")
    assert len(tensors) == 28 and all("lora_" in k for k in tensors)


@pytest.mark.parametrize("how", ["peft", "transformers"])
def test_a_checkpoint_directory_is_a_peft_adapter(reference, how):
    """The last checkpoint (the final step) loads with plain peft and with transformers' load_adapter and gives the
    run's final evaluation (two float32 paths: TINY_JOB_REL); its tensors are the final adapter's, bit for bit."""
    from tests.bounds import TINY_JOB_REL
    from tests.reload import reload_eval

    final = [r for r in read_jsonl(reference / "metrics.jsonl") if "eval/loss" in r][-1]
    again = reload_eval(reference, reference / "checkpoints" / f"step_{2 * K:06d}", how)
    assert abs(again["eval/loss"] / final["eval/loss"] - 1) <= TINY_JOB_REL and final["step"] == 2 * K
    assert again["eval/accuracy"] == final["eval/accuracy"]
    saved = load_file(reference / "checkpoints" / f"step_{2 * K:06d}" / "adapter_model.safetensors")
    assert saved.keys() == _adapter(reference).keys()
    assert all(torch.equal(saved[k], _adapter(reference)[k]) for k in saved)


def test_parameter_names_read_both_checkpoint_namings():
    """A checkpoint names its tensors as peft saves them; one written before (the model's parameter names, with the
    adapter name ``.default.``) reads the same."""
    from scale.modeling.build import add_lora, load_base
    from scale.training.checkpoint.portable import parameter_names

    cfg = tiny_cfg("unused")
    model = add_lora(load_base(cfg.model, 128, 0), cfg.model, cfg.lora)
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    peft_named = {n.replace(".default.", "."): t for n, t in trainable.items()}
    assert parameter_names(model, trainable) == trainable
    assert parameter_names(model, peft_named) == trainable


def test_resume_mid_epoch_is_bit_exact(reference, tmp_path):
    run(tiny_cfg(tmp_path, *JOB, f"train.resume_from={reference}/checkpoints/step_{K:06d}"))
    ref, got = _adapter(reference), _adapter(tmp_path)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_losses, got_losses = _losses(reference), _losses(tmp_path)
    assert sorted(got_losses) == list(range(K + 1, 2 * K + 1))
    assert all(got_losses[s] == ref_losses[s] for s in got_losses)  # identical, not close


def test_resume_needs_the_rng_state(reference, tmp_path):
    """The test above can fail: the same checkpoint with another RNG state diverges (dropout)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / f"step_{K:06d}", ckpt)
    shutil.copy(reference / "checkpoints" / f"step_{2 * K:06d}" / "random_states_0.pkl", ckpt)
    _record(ckpt)  # a checkpoint written with that state, not a damaged one
    run(tiny_cfg(tmp_path / "out", *JOB, f"train.resume_from={ckpt}"))
    ref, got = _adapter(reference), _adapter(tmp_path / "out")
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) > 1e-4


def test_interrupted_save_leaves_previous_checkpoint(reference, tmp_path, monkeypatch):
    """A crash inside save_state (after some files are written) leaves step_X.tmp; `latest` skips it."""
    from accelerate import Accelerator

    out = tmp_path / "run"
    real_save = Accelerator.save_state
    calls = []

    def crashing_save(self, output_dir, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:  # the second checkpoint (step 2K): write part of it, then die
            real_save(self, output_dir, **kwargs)
            (__import__("pathlib").Path(output_dir) / "optimizer.bin").write_bytes(b"truncated")
            raise KeyboardInterrupt("killed during save_state")
        return real_save(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_cfg(out, *JOB, f"train.save_every={K}"))
    _reset()
    monkeypatch.setattr(Accelerator, "save_state", real_save)
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000007", "step_000014.tmp"]
    assert resolve_resume("latest", out) == root / "step_000007"
    run(tiny_cfg(out, *JOB, f"train.save_every={K}", "train.resume_from=latest"))
    ref, got = _adapter(reference), _adapter(out)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert [p.name for p in list_checkpoints(out)] == ["step_000007", "step_000014"]
    assert not (root / "step_000014.tmp").exists()
    # metrics.jsonl: the crashed attempt's lines after step 7 were dropped, then re-logged once.
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(1, 2 * K + 1))


def test_save_total_limit_keeps_newest(tmp_path):
    run(tiny_cfg(tmp_path, *JOB, "train.max_steps=6", "train.save_every=1", "train.save_total_limit=2",
                 "train.save_adapter=false"))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005", "step_000006"]


def test_latest_without_checkpoint_starts_fresh(tmp_path):
    assert resolve_resume("latest", tmp_path) is None
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    assert str(e.value) == (f"train.resume_from={str(tmp_path / 'nowhere')!r} is not a complete checkpoint "
                            f"(no trainer_state.json); complete ones: none")


def test_config_change_that_alters_the_maths_is_an_error(reference, tmp_path):
    ckpt = reference / "checkpoints" / f"step_{K:06d}"
    with pytest.raises(ConfigError) as e:
        run(tiny_cfg(tmp_path, *JOB, "optim.lr=0.01", f"train.resume_from={ckpt}"))
    assert str(e.value) == (f"the config differs from checkpoint {ckpt} in keys that change the maths: "
                            f"optim.lr: checkpoint 0.001 -> now 0.01. Resume with the checkpoint's config "
                            f"({ckpt}/trainer_state.json) or start a new run in another output_dir.")


def test_harmless_config_changes_are_warnings():
    saved = {"output_dir": "a", "train": {"log_every": 1, "max_steps": 10, "micro_batch_size": 2},
             "log": {"trackers": ["wandb"]}, "optim": {"lr": 1e-3, "schedule": "constant"}}
    now = {"output_dir": "b", "train": {"log_every": 5, "max_steps": 20, "micro_batch_size": 4},
           "log": {"trackers": []}, "optim": {"lr": 1e-3, "schedule": "constant"}}
    errors, warnings = compare_configs(saved, now)
    assert errors == ["train.micro_batch_size: checkpoint 2 -> now 4"]
    assert warnings == ["log.trackers: checkpoint ['wandb'] -> now []", "output_dir: checkpoint 'a' -> now 'b'",
                        "train.log_every: checkpoint 1 -> now 5", "train.max_steps: checkpoint 10 -> now 20"]


def test_longer_max_steps_under_a_decaying_schedule_is_an_error(reference, tmp_path):
    """The cosine curve depends on max_steps: resuming with another one would change the remaining LRs."""
    ckpt = reference / "checkpoints" / f"step_{K:06d}"
    with pytest.raises(ConfigError) as e:
        run(tiny_cfg(tmp_path, *JOB, "train.max_steps=20", f"train.resume_from={ckpt}"))
    assert "train.max_steps: checkpoint 14 -> now 20 (the cosine LR schedule is a function of max_steps" in str(e.value)
    assert not (tmp_path / "config.yaml").exists()  # rejected before anything was written


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(reference):
    before = sorted(p.name for p in (reference / "checkpoints").iterdir())
    with pytest.raises(CheckpointError) as e:
        run(tiny_cfg(reference, *JOB))
    assert str(e.value) == (f"output_dir={reference} already holds checkpoints of a run (newest step_000014); a "
                            f"fresh run there would mix its checkpoints and metrics with them. Resume it with "
                            f"train.resume_from=latest, use another output_dir, or set "
                            f"train.overwrite_output_dir=true to replace it.")
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == before
    assert len(_losses(reference)) == 2 * K  # its metrics.jsonl untouched


def test_edited_data_file_is_detected_on_resume(reference, tmp_path):
    from tests.conftest import TINY_DATA

    data = tmp_path / "data.jsonl"
    data.write_text(TINY_DATA.read_text() + '{"text": "One more row.", "label": "positive"}\n')
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / f"step_{K:06d}", ckpt)
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["config"]["data"]["path"] = str(data)  # same path in both configs, different bytes than when saved
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"the data file changed since checkpoint .* \(sha256 [0-9a-f]{12}\.\.\. "
                                          r"-> [0-9a-f]{12}\.\.\.\): the split and the sample order would differ"):
        run(tiny_cfg(tmp_path / "out", *JOB, f"data.path={data}", f"train.resume_from={ckpt}"))


def test_epoch_extension_is_handled_like_a_step_extension():
    """C47: num_epochs 1 -> 2 under a constant schedule is a warning, as max_steps 8 -> 16 is; under cosine an
    error that names both ways to extend."""
    saved = {"train": {"max_steps": None, "num_epochs": 1}, "optim": {"schedule": "constant"}}
    now = {"train": {"max_steps": None, "num_epochs": 2}, "optim": {"schedule": "constant"}}
    assert compare_configs(saved, now) == ([], ["train.num_epochs: checkpoint 1 -> now 2"])
    cosine = {"train": {"max_steps": None, "num_epochs": 2}, "optim": {"schedule": "cosine"}}
    errors, _ = compare_configs({**saved, "optim": {"schedule": "cosine"}}, cosine)
    assert errors == ["train.num_epochs: checkpoint 1 -> now 2 (the cosine LR schedule is a function of num_epochs: "
                      "the remaining steps would follow another curve; a run trained with optim.schedule=constant "
                      "can be extended by train.max_steps or train.num_epochs)"]


def test_portable_state_alone_resumes_bit_exact(reference, tmp_path, monkeypatch):
    """The mode-independent files (adapter_model + optimizer_state.safetensors, the scheduler, the RNG states) hold
    everything: read instead of accelerate's optimizer.bin, the resume is still bit-exact."""
    import scale.training.checkpoint.rules
    import scale.training.checkpoint.saving

    # where check_resume and load_checkpoint read it
    for room in (scale.training.checkpoint.rules, scale.training.checkpoint.saving):
        monkeypatch.setattr(room, "native", lambda *a: False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / f"step_{K:06d}", ckpt)
    (ckpt / "optimizer.bin").unlink()  # not read on this path
    _record(ckpt)
    run(tiny_cfg(tmp_path / "out", *JOB, f"train.resume_from={ckpt}"))
    ref, got = _adapter(reference), _adapter(tmp_path / "out")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_losses, got_losses = _losses(reference), _losses(tmp_path / "out")
    assert sorted(got_losses) == list(range(K + 1, 2 * K + 1))
    assert all(got_losses[s] == ref_losses[s] for s in got_losses)


class World:
    """``size`` data-parallel ranks as threads of this process, each running the real
    :func:`scale.training.windows.windows`: ``acc.gather`` joins every rank's vote in rank order, as the all-gather of a
    process group does, and ``acc.skip_first_batches`` is accelerate's."""

    def __init__(self, size: int) -> None:
        import threading

        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def acc(self, rank: int):
        from types import SimpleNamespace

        from accelerate.data_loader import skip_first_batches

        return SimpleNamespace(device=torch.device("cpu"), skip_first_batches=skip_first_batches,
                               gather=lambda t: self.gather(rank, t))

    def gather(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = t
        self.barrier.wait()
        out = torch.cat(self.slots)
        self.barrier.wait()  # every rank has read the slots before any writes the next vote
        return out

    def run(self, fn) -> list:
        """``[fn(rank) for every rank]``, the ranks running together; a rank's error is raised (the others' waits
        are broken, as a crashed process breaks the group's collectives)."""
        import threading

        results, errors = [None] * self.size, [None] * self.size

        def work(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors[rank] = e
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is not None or any(errors):
            raise first or next(e for e in errors if e is not None)
        return results


def _epoch_windows(world: World, loaders: list, ga: int, objective, trained_windows: int) -> list:
    """Every rank's windows of epoch 1 after ``trained_windows`` windows were trained (0: the whole epoch), as the
    loop takes them (:func:`scale.train.epoch_loader`'s :func:`scale.training.windows.skip_trained`, then ``windows``):
    per window ``(den, [(input_ids, weights, real) per micro-batch])``."""
    from scale.training.windows import skip_trained, windows

    def rank_windows(rank):
        acc = world.acc(rank)
        batches, last = skip_trained(acc, loaders[rank], 1, trained_windows * ga)
        return [(w.den, [(mb.batch["input_ids"].tolist(), mb.weights.tolist(), mb.real) for mb in w.micro])
                for w in windows(acc, batches, ga, objective, last=last)]

    return world.run(rank_windows)


def _sharded(make_loader, world: int) -> list:
    """The loader ``make_loader()`` builds as each of ``world`` ranks gets it from ``Accelerator.prepare``
    (scale.distributed.launch's settings). One loader per rank, as each process builds its own: the ranks' threads must
    not share a sampler's generator."""
    from accelerate.data_loader import prepare_data_loader

    return [prepare_data_loader(make_loader(), num_processes=world, process_index=r, even_batches=False,
                                put_on_device=False, use_seedable_sampler=True) for r in range(world)]


def _assert_resumes_as_uninterrupted(world: World, loaders: list, ga: int, objective) -> tuple[int, int]:
    """Resumed after every window of an epoch, each rank's windows (micro-batches, stand-ins, weights, denominators)
    are the uninterrupted epoch's from there. Returns the uninterrupted epoch's ``(stand-ins, windows of a rank
    holding stand-ins only)``, over all ranks."""
    whole = _epoch_windows(world, loaders, ga, objective, 0)
    for k in range(1, len(whole[0]) + 1):
        resumed = _epoch_windows(world, loaders, ga, objective, k)
        assert resumed == [w[k:] for w in whole], k
    reals = [[real for *_, real in micro] for w in whole for _, micro in w]
    return sum(r.count(False) for r in reals), sum(not any(r) for r in reals)


@pytest.mark.parametrize("pairs", [False, True], ids=["rows", "pairs"])
@pytest.mark.parametrize("last_window", [0, 1, 2, 3])
def test_resume_after_any_window_gives_each_rank_the_uninterrupted_windows(tmp_path, tokenizer, pairs, last_window):
    """2 ranks x micro-batch 1 x GA 2 on the tiny job's real loaders (rows, or preference pairs): 12 + ``last_window``
    items make an epoch whose last window holds ``last_window`` micro-batches (0: none, every window full). With 1,
    rank 1's shard holds nothing for it and the uninterrupted run repeats rank 1's previous batch: a resume right
    before that window must still have it (it raised "a rank got no batch in an epoch")."""
    from accelerate import Accelerator

    from scale.data import build_splits
    from scale.objectives import build_objective
    from scale.training.parts.loaders import make_loaders
    from tests.launching import PAIRS

    Accelerator(cpu=True)  # accelerate's sharding reads its state
    cfg = tiny_cfg(tmp_path, *(PAIRS if pairs else []), f"data.max_train_examples={12 + last_window}",
                   "train.micro_batch_size=1", "train.gradient_accumulation_steps=2", "data.eval_size=8",
                   f"data.cache_dir={tmp_path / 'cache'}")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    loaders = _sharded(lambda: make_loaders(cfg, splits, tokenizer.pad_token_id, 2)[0], 2)
    assert len(loaders[0].dataset) == 12 + last_window
    # rank 1's shard is one short with 1 or 3: one stand-in, its previous batch (1) or its own in the window (3)
    assert _assert_resumes_as_uninterrupted(World(2), loaders, 2, build_objective(cfg)) == {
        0: (0, 0), 1: (1, 1), 2: (0, 0), 3: (1, 0)}[last_window]


def _numbered_rows(n: int) -> list:
    from scale.data import Example

    return [Example([3 + i, 4 + i, 5 + i, 6 + i], 2, 0, 6 + i, 0, row=i) for i in range(n)]


@pytest.mark.parametrize("world, ga", [(2, 1), (2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_resume_after_any_window_for_every_size_of_the_last_window(world, ga, micro_batch_size):
    """Every size of an epoch's last window (every remainder of the rows over the global batch, a short last
    micro-batch included), on 2 to 4 ranks, resumed after each window: each rank's windows equal the uninterrupted
    epoch's."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from scale.data import Collator
    from scale.objectives.tail import LossSpec

    Accelerator(cpu=True)
    G = world * ga * micro_batch_size
    spec = LossSpec(padding_side="left", type_weights=None, criterion=None)
    emptied = 0  # windows where a rank holds stand-ins only
    for n in range(G + 1, 2 * G + 1):  # every size of the second window, the last one full
        loaders = _sharded(lambda n=n: DataLoader(_numbered_rows(n), batch_size=micro_batch_size, shuffle=True,
                                                  collate_fn=Collator(0, "left"),
                                                  generator=torch.Generator().manual_seed(0)), world)
        emptied += _assert_resumes_as_uninterrupted(World(world), loaders, ga, spec)[1]
    assert emptied > 0
