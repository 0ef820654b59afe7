"""The persistent compilation cache (config.compilation_cache_dir): where it goes, and that a run
points JAX's process-global cache at it before compiling."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from conftest import tiny_settings
from decoupled_diloco.runtime import assembly
from decoupled_diloco.runtime import train


@pytest.fixture
def session_cache():
  """Gives the test session's cache (conftest.pytest_configure) back afterwards."""
  before = jax.config.jax_compilation_cache_dir
  yield before
  compilation_cache.set_cache_dir(before)
  compilation_cache.reset_cache()


def test_the_cache_defaults_to_the_workdir_and_none_turns_it_off(tmp_path):
  assert tiny_settings(tmp_path, compilation_cache_dir="").compilation_cache_dir == os.path.join(
      str(tmp_path), "jax_cache")
  assert tiny_settings(tmp_path, compilation_cache_dir="none").compilation_cache_dir is None
  assert tiny_settings(tmp_path, compilation_cache_dir=str(tmp_path / "c")).compilation_cache_dir \
      == str(tmp_path / "c")


def test_a_cache_dir_that_cannot_be_created_is_refused_naming_the_field(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match=r"config\.compilation_cache_dir=.*is a file"):
    tiny_settings(tmp_path, compilation_cache_dir=str(tmp_path / "file" / "cache"))


def test_programs_compiled_after_the_run_sets_its_cache_are_written_there(tmp_path, session_cache):
  # Another directory was in use in this process (the session's): JAX opened its cache there at
  # the first compile, and the run's must replace it, not be ignored.
  assert session_cache
  jax.jit(lambda x: x + 2).lower(jnp.arange(5.0)).compile()  # JAX opens the session's cache
  assembly.use_compilation_cache(str(tmp_path / "cache"))
  jax.jit(lambda x: x * 3 + 1).lower(jnp.arange(7.0)).compile()
  assert os.listdir(tmp_path / "cache")


def test_none_leaves_the_process_cache_alone(session_cache):
  assembly.use_compilation_cache(None)
  assert jax.config.jax_compilation_cache_dir == session_cache


# Slow, so that the default suite stays under 10 min (9 s; a performance property, not a result).
@pytest.mark.slow
def test_a_run_built_again_in_the_same_process_reuses_its_compiled_steps(tmp_path):
  """assembly.learner_parts keeps the jitted steps it made: the same model, optimizer and meshes
  take the same compiled program and compile nothing, whatever their number of steps and
  learning-rate schedule (an argument of the program, each run's own); another model gets its
  own."""
  shapes = dict(num_learners=2, learner_mesh_shapes=((2, 1), (2, 1)))
  first = train.build(tiny_settings(tmp_path / "a", **shapes))
  steps = [l._train_step for l in first.learners]  # pylint: disable=protected-access
  sizes = [s._cache_size() for s in steps]  # pylint: disable=protected-access
  again = train.build(tiny_settings(tmp_path / "b", num_steps=25, inner__learning_rate=1e-2,
                                    **shapes))
  for step, later in zip(steps, [l._train_step for l in again.learners]):  # pylint: disable=protected-access
    assert later.jitted is step.jitted
    assert later.schedule_values.tolist() != step.schedule_values.tolist()
    assert later.schedule_values[2] == 25 and later.schedule_values[0] == np.float32(1e-2)
  assert [s._cache_size() for s in steps] == sizes  # pylint: disable=protected-access
  other = train.build(tiny_settings(tmp_path / "c", model__mlp_dim=96, **shapes))
  others = [l._train_step for l in other.learners]  # pylint: disable=protected-access
  assert all(o.jitted is not s.jitted for o, s in zip(others, steps))
  for run in (first, again, other):
    train.execute(run, progress=False)  # closes its files


@pytest.mark.slow  # 9 s; the cache's reuse test stays in the default suite
def test_learners_compile_side_by_side_only_with_cores_to_spare(tmp_path, monkeypatch):
  """Each compile in flight holds XLA's working memory (4 at once on 2 cores: +0.7 GB of peak RSS
  for no faster a build): one learner's step compiles per two host cores."""
  assert [assembly.compile_workers(4, cores) for cores in (1, 2, 3, 8, 64)] == [1, 1, 1, 4, 4]
  real, running, most = assembly.learner_parts, [0], [0]

  def counted(*args, **kwargs):
    running[0] += 1
    most[0] = max(most[0], running[0])
    try:
      return real(*args, **kwargs)
    finally:
      running[0] -= 1

  monkeypatch.setattr(assembly, "learner_parts", counted)
  monkeypatch.setattr(os, "cpu_count", lambda: 2)
  # Another model than the other tests' (mlp_dim): its steps compile here, not from the memo.
  run = train.build(tiny_settings(tmp_path, model__mlp_dim=80))
  assert most[0] == 1 and len(run.learners) == 4
  train.execute(run, progress=False)
