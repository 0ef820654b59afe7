"""Tools that read a finished run: scripts/sample.py (the checkpoint's global model, the generation
loop) and scripts/plot_run.py. One tiny run with a learner crash serves them all."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TEST_XLA_FLAGS, tiny_settings
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.lm import sampling
from decoupled_diloco.lm import tokenizers
from decoupled_diloco.runtime.records import checkpoints
from decoupled_diloco.runtime import train

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny decoupled run of 16 steps, learner 1 crashing at step 5, that writes a checkpoint at
  its end; its global model."""
  workdir = tmp_path_factory.mktemp("run")
  run = train.build(tiny_settings(workdir, num_steps=16, checkpoint__every_steps=8,
                                  chaos__schedule="crash@learner=1,step=5,down_s=0.2"))
  train.execute(run, progress=False)
  return workdir, run.settings, train.global_params(run)


def test_the_checkpoint_gives_the_run_s_final_global_model_and_its_shape(trained):
  workdir, settings, final = trained
  saved = checkpoints.read_model(str(workdir / "checkpoints"))
  assert saved.source == "syncer" and saved.clock == 16
  assert saved.model_cfg == settings.model
  assert saved.config_value("data.tokenizer") == "byte"
  assert sorted(saved.params) == sorted(final)
  for name, value in final.items():
    np.testing.assert_array_equal(saved.params[name], np.asarray(value), err_msg=name)


def test_greedy_sampling_is_the_argmax_of_the_model_also_past_its_longest_sequence(trained):
  """The model is causal: one forward pass over the first max_seq_len=32 tokens checks every token
  drawn inside that window, and a pass over the 32 before each later one checks the slide. The
  padded, jitted loop must pick the tokens those unpadded passes give."""
  _, settings, params = trained
  cfg = settings.model
  prompt = [int(t) for t in tokenizers.load("byte").encode("ROMEO:\n")]
  tokens = prompt + sampling.generate(cfg, params, prompt, num_tokens=40, temperature=0.0)
  window = cfg.max_seq_len
  forward = jax.jit(lambda context_L: jnp.argmax(
      model_lib.apply(model_lib.graph(cfg), params, context_L[None])[0], axis=-1))
  first = forward(jnp.asarray(tokens[:window], jnp.int32))
  assert tokens[len(prompt):window] == [int(t) for t in first[len(prompt) - 1:window - 1]]
  for j in range(window, len(tokens)):
    assert tokens[j] == int(forward(jnp.asarray(tokens[j - window:j], jnp.int32))[-1]), j


def test_top_k_one_is_greedy_and_a_seed_repeats_its_draws(trained):
  _, settings, params = trained
  prompt = [10, 65, 66]
  greedy = sampling.generate(settings.model, params, prompt, num_tokens=12, temperature=0.0)
  assert sampling.generate(settings.model, params, prompt, num_tokens=12, temperature=1.5,
                           top_k=1, seed=3) == greedy
  draws = [sampling.generate(settings.model, params, prompt, num_tokens=12, temperature=1.5,
                             seed=s) for s in (0, 0, 1)]
  assert draws[0] == draws[1] and draws[0] != draws[2]
  assert all(0 <= t < settings.model.vocab_size for t in draws[2])


@pytest.mark.parametrize("option, value, message", [
    ("temperature", -0.5, r"temperature=-0.5 must be a finite number >= 0"),
    ("top_k", 300, r"top_k=300 must be an integer in \[0, 256\]"),
    ("num_tokens", 0, r"num_tokens=0 must be a positive integer"),
])
def test_bad_options_are_refused_naming_them(trained, option, value, message):
  _, settings, params = trained
  options = {"num_tokens": 4, "temperature": 1.0, "top_k": 0, option: value}
  with pytest.raises(ValueError, match=message):
    sampling.generate(settings.model, params, [65], **options)


def test_the_script_prints_the_prompt_and_the_model_s_greedy_continuation(trained, tmp_path):
  workdir, settings, params = trained
  out = _script("sample.py", f"--workdir={workdir}", "--prompt=ROMEO:", "--num_tokens=20", "--temperature=0")
  assert out.returncode == 0, out.stderr
  byte = tokenizers.load("byte")
  expected = byte.decode(sampling.generate(settings.model, params, list(byte.encode("ROMEO:")),
                                           num_tokens=20, temperature=0.0))
  assert out.stdout == "ROMEO:" + expected + "\n"
  assert "model at step 16" in out.stderr
  # A workdir without checkpoints: one line that says why, no traceback.
  out = _script("sample.py", f"--workdir={tmp_path}", "--prompt=x")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "holds no job checkpoint" in out.stderr and "checkpoint.every_steps" in out.stderr


def test_a_checkpoint_number_that_is_not_there_is_refused_naming_those_that_are(trained):
  workdir, _, _ = trained
  probe = checkpoints.Checkpoints(str(workdir / "checkpoints"), keep=None, fingerprint_={})
  numbers = probe.steps()
  probe.close()
  with pytest.raises(checkpoints.CheckpointError, match="no job checkpoint 99; it holds " +
                     ", ".join(map(str, numbers))):
    checkpoints.read_model(str(workdir / "checkpoints"), 99)
  out = _script("sample.py", f"--workdir={workdir}", "--checkpoint=99")
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert lines[-1].startswith("--checkpoint=99: ") and str(numbers[-1]) in lines[-1], lines


def _script(name, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
  env["XLA_FLAGS"] = TEST_XLA_FLAGS  # the script asks for its fake devices itself
  return subprocess.run([sys.executable, str(_ROOT / "scripts" / name), *args], cwd=_ROOT,
                        env=env, capture_output=True, text=True, timeout=120, check=False)


def test_plot_run_draws_the_run_with_its_fault_into_run_png(trained, tmp_path):
  workdir, _, _ = trained
  out = _script("plot_run.py", str(workdir))
  assert out.returncode == 0, out.stderr
  png = workdir / "run.png"
  assert out.stdout.strip() == str(png)
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert png.stat().st_size > 20_000  # two panels of lines, not an empty canvas
  out = _script("plot_run.py", str(tmp_path))
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "metrics.jsonl does not exist" in out.stderr


def test_tokens_trained_by_a_time_add_every_learner_s_latest_step():
  plot_run = _load_script("plot_run.py")
  records = [{"time_s": 1.0, "learner": 0, "step": 8}, {"time_s": 2.0, "learner": 1, "step": 8},
             {"time_s": 3.0, "learner": 0, "step": 16}, {"time_s": 2.5, "learner": 1, "step": 3}]
  # Learner 1 restarted from an earlier step: its latest step counts, not its highest.
  assert plot_run.tokens_at(records, 10.0) == ([1.0, 2.0, 2.5, 3.0], [80.0, 160.0, 110.0, 190.0])


def _load_script(name):
  spec = importlib.util.spec_from_file_location(name[:-3], _ROOT / "scripts" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
