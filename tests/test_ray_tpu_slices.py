"""A learner process's environment holds no MEGASCALE_* setting (runtime/transport/
ray_tpu_slices.py)."""

from decoupled_diloco.runtime.transport import ray_tpu_slices


def test_megascale_settings_are_cleared_and_kept_out_of_a_learner_s_runtime_env():
  environ = {"MEGASCALE_NUM_SLICES": "3", "MEGASCALE_SLICE_ID": "0", "TPU_NAME": "slice-a"}
  assert ray_tpu_slices.without_megascale(environ) == {"TPU_NAME": "slice-a"}
  assert ray_tpu_slices.clear_megascale(environ) == ["MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"]
  assert environ == {"TPU_NAME": "slice-a"}
