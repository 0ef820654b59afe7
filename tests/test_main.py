"""The entry point on bad input: one line that names the field, before anything compiles.

Each case runs `python -m decoupled_diloco.main` in a new process, as a user does, so that flag
parsing, validation and the exit are what a user sees.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from decoupled_diloco import settings

_ROOT = pathlib.Path(__file__).resolve().parents[1]
def _main(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
  # As in a user's shell: the run asks for its fake devices itself. Compiled with XLA's full
  # optimisations: the default experiment's steps ran slower under the tests' flag than it saved.
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "decoupled_diloco.main", "--config=experiments/tiny_cpu.py", *args],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  return out


def _one_line(out: subprocess.CompletedProcess) -> str:
  lines = out.stderr.strip().splitlines()
  assert out.returncode != 0, out.stderr
  assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
  assert lines[0].startswith("Invalid config: config."), lines[0]
  return lines[0]


@pytest.mark.parametrize("field, closest", [
    ("nonexistent", None),
    ("sync.qorum", "config.sync.quorum"),
    ("model.num_head", "config.model.num_heads"),
])
def test_unknown_override_names_it_and_the_closest_known_fields(field, closest, tmp_path):
  out = _main(f"--config.{field}=1", f"--config.workdir={tmp_path / 'run'}")
  line = _one_line(out)
  assert f"config.{field} " in line, line
  suggested = re.findall(r"config\.([\w.]+)", line.split("closest known:")[1])
  assert suggested and set(suggested) <= set(settings.config_fields()), line
  if closest is not None:
    assert closest in line, line
  assert not (tmp_path / "run").exists()


def test_workdir_that_cannot_be_created_is_named_before_compiling(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory", encoding="utf-8")
  out = _main(f"--config.workdir={blocker / 'run'}")
  line = _one_line(out)
  assert f"config.workdir='{blocker / 'run'}'" in line and "is a file" in line, line
  # The build logs "built N learner(s) ... in S s" once it has compiled: it never got there.
  assert "built" not in out.stdout + out.stderr


def test_bad_value_is_one_line_naming_the_field_and_what_is_allowed(tmp_path):
  out = _main("--config.sync.quorum=9", f"--config.workdir={tmp_path / 'run'}")
  line = _one_line(out)
  assert "config.sync.quorum=9" in line and "config.num_learners=4" in line, line


@pytest.mark.slow  # 13 s, two processes; tests/test_checkpoints.py resumes runs in the default suite
def test_a_run_resumes_from_its_checkpoint_in_a_new_process(tmp_path):
  """As a user resumes: a second process, which reads the checkpoint before JAX has started (the
  fake CPU device count must still be set then)."""
  args = (f"--config.workdir={tmp_path}", "--config.mode=dp", "--config.num_steps=2",
          "--config.checkpoint.every_steps=1", "--config.eval_batches=1", "--config.log_every=1",
          "--config.inner.warmup_steps=1")
  first = _main(*args)
  assert first.returncode == 0, first.stderr[-2000:]
  second = _main(*args, "--config.restore=latest")
  assert second.returncode == 0, second.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert [r["clock"] for r in summary["resumes"]] == [2]
  assert summary["tokens_trained"] == 2 * 4 * 16 * 128  # steps x (learners x batch) x seq_len


@pytest.mark.slow
def test_a_replay_needs_only_the_recording(tmp_path):
  """`--config.replay=WORKDIR` alone: the recording's overrides come from its tape, the replay
  writes beside it, and Theta ends bit for bit equal (replay_config.py)."""
  recording = tmp_path / "recorded"
  tiny = ("--config.num_steps=8", "--config.inner.warmup_steps=2", "--config.model.num_layers=1",
          "--config.model.embed_dim=32", "--config.model.num_heads=2", "--config.model.head_dim=16",
          "--config.model.mlp_dim=64", "--config.model.max_seq_len=32", "--config.data.seq_len=32",
          "--config.data.batch_size=4", "--config.eval_batches=1", "--config.sync.num_fragments=2",
          "--config.sync.period=2", "--config.sync.overlap=1")
  first = _main(f"--config.workdir={recording}", *tiny)
  assert first.returncode == 0, first.stderr[-2000:]
  replayed = _main(f"--config.replay={recording}")
  assert replayed.returncode == 0, replayed.stderr[-2000:]
  summary = json.loads((tmp_path / "recorded_replay" / "summary.json").read_text())
  assert summary["replay_exact"] and summary["params_equal_to_recording"]
