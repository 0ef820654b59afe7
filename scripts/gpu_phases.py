"""What scripts/gpu_triage.py and scripts/gpu_quality.py share: one time budget cut into framework
runs, and a report rewritten after each run, so that a GPU lent for minutes leaves its figures.

A run is the framework's training command in a process of its own (scripts/framework_runs.py),
stopped when its share of the budget is spent and then reported from its metrics so far
(scripts/bench_one_device.py's `figures`). A share is what is left of the budget, less a reserve
for writing, split over the runs still to come by their weights (a weight is a run's expected
cost, 1 for a typical one). `--dry_run` of either script runs the same runs at toy size on fake
CPU devices; DRY_RUN holds the toy shape.

Nothing here imports JAX (it would take the GPU's memory from the runs) or reaches the network.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
# None imports JAX.
import bench_gpu  # pylint: disable=g-import-not-at-top,wrong-import-position
import bench_one_device  # pylint: disable=g-import-not-at-top,wrong-import-position
import framework_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIG = "experiments/one_gpu.py"
# A dry run's model and schedule: experiments/one_gpu.py:cpu (four learners and the syncer on
# fake CPU devices) shrunk to a few seconds a run. P = H = 4: the toy model has 2 x 9 + 2 tensors.
DRY_RUN = {"model.embed_dim": 16, "model.num_layers": 2, "model.num_heads": 2,
           "model.head_dim": 8, "model.mlp_dim": 32, "model.max_seq_len": 32, "data.seq_len": 32,
           "data.batch_size": 2, "sync.num_fragments": 4, "sync.period": 4, "sync.overlap": 1,
           "eval_batches": 1, "log_every": 2, "inner.warmup_steps": 1}
# XLA's CPU compiler without its LLVM optimisations: a dry run's compiles take half the time.
_DRY_RUN_XLA_FLAGS = "--xla_backend_optimization_level=0"
_MIN_RUN_S = 5.0  # a run given less is skipped, not started


class Budget:
  """Seconds left of a whole script's budget, shared out over the runs still to come."""

  def __init__(self, total_s: float, reserve_s: float = 10.0):
    self.total_s, self._reserve_s = total_s, reserve_s
    self._started = time.perf_counter()

  def elapsed(self) -> float:
    return time.perf_counter() - self._started

  def share(self, weight: float, weight_after: float) -> float:
    """The next run's time: what is left, less the reserve, in proportion to its weight."""
    left = self.total_s - self.elapsed() - self._reserve_s
    return max(left, 0.0) * weight / (weight + weight_after)


class Device:
  """Where the runs go: the GPU here (experiments/one_gpu.py:gpu) or, for a dry run, fake CPU
  devices (one_gpu.py:cpu at DRY_RUN's size); its card names the report."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run
    if dry_run:
      self.probe = {"platform": "cpu", "kind": "cpu", "count": 0}
      self.card = "cpu"
    else:
      self.probe = framework_runs.probe()
      if self.probe["platform"] != "gpu":
        raise SystemExit(f"this host's first device is {self.probe['kind']} "
                         f"({self.probe['platform']}), not a GPU: use --dry_run")
      self.card = bench_gpu.card_name(self.probe["kind"])
    self.config = f"{CONFIG}:{'cpu' if dry_run else 'gpu'}"

  def overrides(self, **fields: Any) -> dict[str, Any]:
    """The fields every run of a script shares, then `fields` ('__' for '.')."""
    base = dict(DRY_RUN) if self.dry_run else {}
    base.update({"checkpoint.every_steps": 0, "restore": "none"})
    base.update({k.replace("__", "."): v for k, v in fields.items()})
    return base

  def env(self, xla_flags: str = "", **extra: str) -> dict[str, str]:
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags,
                                 _DRY_RUN_XLA_FLAGS if self.dry_run else "") if f)
    env = {"XLA_FLAGS": flags, **extra}
    if self.dry_run:
      env["JAX_PLATFORMS"] = "cpu"
    return env


def run(device: Device, budget: Budget, name: str, overrides: dict[str, Any], *, workdir: str,
        weight: float = 1.0, weight_after: float = 0.0, env: dict[str, str] | None = None
        ) -> dict[str, Any]:
  """One framework run in its share of the budget: bench_one_device's figures of it (of a run
  stopped or failed: its records so far and its log's tail), with `name` and its time limit."""
  timeout = budget.share(weight, weight_after)
  if timeout < _MIN_RUN_S:
    return {"name": name, "status": "skipped", "why": f"{timeout:.0f} s left of the budget"}
  path = os.path.join(workdir, name)
  shutil.rmtree(path, ignore_errors=True)  # afresh: a run resumes a checkpoint it finds
  print(f"{name}: running (at most {timeout:.0f} s)", flush=True)
  # One compilation cache for every run of the script: a repeated run compiles nothing again.
  overrides = {"compilation_cache_dir": os.path.join(workdir, "jax_cache"), **overrides}
  summary = framework_runs.framework_run(name, overrides, path, timeout, config=device.config,
                                         env=env if env is not None else device.env())
  figures = {"name": name, "timeout_s": round(timeout, 1), **bench_one_device.figures(summary)}
  print(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in figures.items()
                                if not isinstance(v, (list, dict)) and k != "log_tail"),
        flush=True)
  return figures


def relative_gap(value: float | None, reference: float | None) -> float | None:
  """value / reference - 1, or None when either is missing."""
  if value is None or reference is None or not reference:
    return None
  return value / reference - 1.0


class Report:
  """results/<kind>_<card>_<date>.{json,md}, rewritten by `write` after every phase."""

  def __init__(self, kind: str, device: Device, out_dir: str, command: str,
               render: Callable[[dict[str, Any]], list[str]]):
    date = datetime.date.today().isoformat()
    self.prefix = os.path.join(out_dir, f"{kind}_{device.card}_{date}")
    self.data: dict[str, Any] = {"device": device.probe, "card": device.card, "date": date,
                                 "dry_run": device.dry_run, "command": command, "phases": {}}
    self._render = render

  def write(self, budget: Budget) -> None:
    self.data["seconds"] = round(budget.elapsed(), 1)
    os.makedirs(os.path.dirname(self.prefix) or ".", exist_ok=True)
    with open(self.prefix + ".json", "w", encoding="utf-8") as f:
      json.dump(self.data, f, indent=2)
    with open(self.prefix + ".md", "w", encoding="utf-8") as f:
      f.write("\n".join(self._render(self.data)) + "\n")


def fmt(value: Any, spec: str = ".4f") -> str:
  """A figure for a markdown table: '-' when missing."""
  return "-" if value is None else format(value, spec)


def percent(value: float | None) -> str:
  return "-" if value is None else f"{100 * value:+.2f}%"
