"""Data-parallel baseline of tiny_cpu: same model, data and token budget, one synchronous learner.

The one learner spans all 4 x 2 learner devices and steps on num_learners x batch_size sequences, so
each of its steps consumes the tokens of one step of all four Decoupled DiLoCo learners.
"""

import pathlib
import sys

# config_flags loads this file by path: make its sibling importable wherever the run starts.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top


def get_config():
  config = tiny_cpu.get_config()
  config.mode = "dp"
  config.workdir = "workdir/dp_baseline_cpu"
  return config
