"""Every command in the README's fenced ``bash`` blocks runs as written: each is dry-run here.

A dry run checks what can be checked without training: a ``scale-train`` command's config and overrides
load and validate; a launcher command's config file exists and its ``scale-train`` part validates; a
``make`` target exists (``make -n``); a script or benchmark exists and accepts the flags the README gives it
(``--help`` lists them); ``scale-plan`` really runs (it reads configs only). A command no rule knows fails the
test, so a new kind of command in the README needs a rule here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def readme_commands(text: str) -> list[str]:
    """Command lines of the fenced bash blocks: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _words(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # leading VAR=value assignments
        words.pop(0)
    return words


def _check_train_args(args: list[str]) -> None:
    from scale.cli import parse_args
    from scale.config.load import load_config

    parsed = parse_args(args)
    load_config(parsed.config, parsed.overrides)


def _check_script_flags(cmd: list[str], flags: list[str]) -> None:
    proc = subprocess.run(cmd + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in flags:
        assert flag in proc.stdout, f"{flag} is not an option of {' '.join(cmd)}"


def dry_run(command: str) -> None:
    words = _words(command)
    head, rest = words[0], words[1:]
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    if head == "make":
        if shutil.which("make") is None:
            pytest.skip("make is not installed")
        targets = [w for w in rest if "=" not in w]
        proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    elif head in ("scale-train", "scale-prepare"):  # scale-prepare takes scale-train's --config and overrides
        _check_train_args(rest)
    elif head in ("accelerate", "torchrun", "deepspeed"):
        if "--config_file" in rest:
            assert (ROOT / rest[rest.index("--config_file") + 1]).is_file(), command
        assert "scale.train" in rest, command
        _check_train_args(rest[rest.index("scale.train") + 1:])
    elif head == "scale-plan":
        proc = subprocess.run([sys.executable, "-m", "scale.plan", *rest], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    elif head in ("scale-report", "scale-generate", "scale-export", "scale-lm-eval"):
        module = {"scale-report": "scale.report", "scale-generate": "scale.generate", "scale-export": "scale.export",
                  "scale-lm-eval": "scale.lmeval"}[head]
        _check_script_flags([sys.executable, "-m", module], flags)
    elif head == "transformers" and rest[:1] in (["serve"], ["chat"]):  # the serve extra's CLI
        _check_script_flags([str(Path(sys.executable).parent / "transformers"), rest[0]], flags)
    elif head == "python" and rest[:1] == ["-m"]:
        _check_script_flags([sys.executable, "-m", rest[1]], flags)
    elif head == "python" and rest[0].endswith(".py"):
        assert (ROOT / rest[0]).is_file(), command
        _check_script_flags([sys.executable, rest[0]], flags)
    elif head in ("sbatch", "bash") or head.startswith("launch/"):
        script = rest[0] if head in ("sbatch", "bash") else head
        assert (ROOT / script).is_file() and os.access(ROOT / script, os.X_OK), script
    else:
        raise AssertionError(f"no dry-run rule for the README command {command!r}: add one to tests/test_readme.py")


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_commands():
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_dry_runs(command):
    dry_run(command)


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_make_train_example_has_its_own_output_dir():
    """The README's `make train ARGS=...` example runs after `make train`: with the default job's output_dir it was
    refused as another run's directory."""
    from scale.config.load import load_config

    example = re.search(r'make train ARGS="([^"]+)"', (ROOT / "README.md").read_text(encoding="utf-8")).group(1)
    assert load_config(None, example.split()).output_dir != load_config(None).output_dir


def test_every_run_the_readme_loads_is_one_its_commands_make():
    """scale-generate, scale-export, scale-lm-eval and transformers serve/chat name a run directory: each is the
    output_dir of the main job (make train) or of a config the README trains (`scale-train --config ...`); the
    generate example named only runs/sft, which the two commands never make."""
    from scale.config.load import load_config

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    made = {Path(load_config(None).output_dir)} | {
        Path(load_config(ROOT / c).output_dir) for c in re.findall(r"scale-train --config (configs/train/\w+\.yaml)", text)}
    loads = [w for c in COMMANDS for w in _words(c)[1:] if w.startswith("runs/")
             and _words(c)[0] in ("scale-generate", "scale-export", "scale-lm-eval", "transformers")]
    assert loads and all(Path(w.removesuffix("/merged")) in made for w in loads), (loads, made)
    assert Path(load_config(None).output_dir) in {Path(w) for c in COMMANDS if _words(c)[0] == "scale-generate"
                                                  for w in _words(c)[1:]}
