"""What the accelerator benchmarks share: the device probe and the framework run as a subprocess.

scripts/bench_accelerator.py (one learner at real size) and scripts/bench_one_device.py (M
learners sharing one device) each run the framework's training command once per mode, in a process
of its own, so that host peak RSS and device peak memory are per mode. `framework_run` starts it,
watches its metrics.jsonl while it runs (when the first learner step lands: the first-step time),
stops it at its timeout (SIGTERM to the process group it started, SIGKILL 15 s later) and returns
its summary.json, or for a run that did not finish what its metrics.jsonl says so far.

This module never imports JAX: in the benchmark's own process JAX would take a GPU's memory from
the runs. It reaches nothing over the network.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Neither imports JAX.
from decoupled_diloco.runtime.core import throughput as throughput_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

_POLL_S = 0.25
_KILL_AFTER_S = 15.0
# "device memory: gpu 0 holds 10.61 GB of its 59.21 GB (...)", runtime/hardware/device_memory.py's log line.
_PLANNED = re.compile(r"device memory: .* holds ([\d.]+) (GB|MB) of its ([\d.]+) (GB|MB)")


def peak_flops(device_kind: str) -> float | None:
  """Dense bf16 peak of the chip, from the runtime's table (runtime/core/throughput.py)."""
  return throughput_lib.peak_flops_per_s(device_kind)


def probe(platform: str | None = None) -> dict[str, Any]:
  """The first device a fresh JAX process sees: platform, kind, count (JAX_PLATFORMS=`platform`
  when given)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if platform:
    env["JAX_PLATFORMS"] = platform
  out = subprocess.run(
      [sys.executable, "-c", "import jax, json; d = jax.devices()[0]; "
       "print(json.dumps({'platform': d.platform, 'kind': d.device_kind, "
       "'count': len(jax.devices())}))"],
      capture_output=True, text=True, check=True, cwd=ROOT, env=env, timeout=300)
  return json.loads(out.stdout.strip().splitlines()[-1])


def framework_run(name: str, overrides: dict[str, Any], workdir: str, timeout_s: float, *,
                  config: str = "experiments/tiny_cpu.py", env: dict[str, str] | None = None
                  ) -> dict[str, Any]:
  """Runs `python -m decoupled_diloco.main --config=CONFIG --config.K=V ...` in `workdir`.

  Returns its summary.json plus `status` ("done", "timeout" or "failed"), `process_seconds`,
  `process_to_first_step_s` / `process_to_last_first_step_s` (from the process's start, Python
  and JAX imports included, to the first step of the first / the last learner to make one, as
  seen by polling its metrics.jsonl every 0.25 s; the summary's own first_step_s counts from
  the start of the build),
  `planned_device_bytes` / `device_limit_bytes` (the memory check's figures, when it ran) and,
  when it did not finish, `partial`: its learner and eval records so far. Its log is
  workdir/log.txt (the last 6000 characters are in `log_tail` when it failed).
  """
  os.makedirs(workdir, exist_ok=True)
  for stale in ("summary.json", "metrics.jsonl"):
    if os.path.exists(os.path.join(workdir, stale)):
      os.remove(os.path.join(workdir, stale))
  args = [sys.executable, "-m", "decoupled_diloco.main", f"--config={config}"]
  args += [f"--config.{key}={value}" for key, value in overrides.items()]
  args.append(f"--config.workdir={workdir}")
  run_env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1",
                 **(env or {}))
  log_path = os.path.join(workdir, "log.txt")
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  started = time.perf_counter()
  first_steps: dict[int, float] = {}
  status = "done"
  tail = _Tail(metrics_path)
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(args, cwd=ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    while proc.poll() is None:
      time.sleep(_POLL_S)
      now = time.perf_counter() - started
      for record in tail.new_records():
        if record.get("kind") == "learner":
          first_steps.setdefault(int(record["learner"]), now)
      if now > timeout_s:
        status = "timeout"
        _stop(proc)
        break
  summary: dict[str, Any] = {}
  if status == "done":
    if proc.returncode == 0 and os.path.exists(os.path.join(workdir, "summary.json")):
      with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    else:
      status = "failed"
  for record in _records(metrics_path, "learner"):  # a step that landed after the last poll
    first_steps.setdefault(int(record["learner"]), time.perf_counter() - started)
  summary.update(name=name, status=status, returncode=proc.returncode,
                 process_seconds=time.perf_counter() - started,
                 process_to_first_step_s=min(first_steps.values(), default=None),
                 process_to_last_first_step_s=max(first_steps.values(), default=None),
                 **_planned_memory(log_path))
  if status != "done":
    summary["partial"] = {"learner": _records(metrics_path, "learner"),
                          "eval": _records(metrics_path, "eval")}
  if status == "failed":
    with open(log_path, encoding="utf-8", errors="replace") as f:
      summary["log_tail"] = f.read()[-6000:]
  return summary


def _stop(proc: subprocess.Popen) -> None:
  """SIGTERM to the run's process group (the run ends its threads), SIGKILL if it lingers."""
  try:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(_KILL_AFTER_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  except ProcessLookupError:
    pass


class _Tail:
  """The records appended to a metrics.jsonl since the last call (complete lines only)."""

  def __init__(self, path: str):
    self._path, self._offset = path, 0

  def new_records(self) -> list[dict[str, Any]]:
    if not os.path.exists(self._path):
      return []
    with open(self._path, "rb") as f:
      f.seek(self._offset)
      chunk = f.read()
    complete = chunk[:chunk.rfind(b"\n") + 1]
    self._offset += len(complete)
    records = []
    for line in complete.decode("utf-8", errors="replace").splitlines():
      try:
        records.append(json.loads(line))
      except ValueError:
        continue
    return records


def step_losses(workdir: str, learner: int | None = None) -> dict[int, float]:
  """{step: training loss} from a run's metrics.jsonl (the steps its config.log_every wrote: every
  one at 1), of `learner` or of every learner record (a one-learner run)."""
  return {int(r["step"]): float(r["loss"])
          for r in _records(os.path.join(workdir, "metrics.jsonl"), "learner")
          if learner is None or r.get("learner") == learner}


def first_step_differing(losses: dict[int, float], reference: dict[int, float]) -> int | None:
  """The first step both logged whose training losses differ; None when none does."""
  return next((t for t in sorted(set(losses) & set(reference)) if losses[t] != reference[t]),
              None)


def _records(path: str, kind: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue  # the line being written
      if record.get("kind") == kind:
        records.append(record)
  return records


def _planned_memory(log_path: str) -> dict[str, float | None]:
  planned = limit = None
  with open(log_path, encoding="utf-8", errors="replace") as f:
    for line in f:
      match = _PLANNED.search(line)
      if match:
        unit = {"GB": 1e9, "MB": 1e6}
        planned = float(match.group(1)) * unit[match.group(2)]
        limit = float(match.group(3)) * unit[match.group(4)]
  return {"planned_device_bytes": planned, "device_limit_bytes": limit}
