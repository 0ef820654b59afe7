"""Metrics a user and a script can read: JSON lines plus TensorBoard event files under the workdir.

Every record is one JSON object per line of `metrics.jsonl` with a `kind` ("learner", "merge",
"eval", "bytes") and the wall time since the run started; numeric fields of learner and eval records
also go to TensorBoard (tensorboardX: clu's writers would need TensorFlow). Learner threads, the
syncer and the controller all write, so every method takes a lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter


def _plain(value: Any) -> Any:
  """numpy / jax scalars and arrays to JSON-friendly Python values."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if hasattr(value, "tolist"):
    return np.asarray(value).tolist()
  return value


def _last_time_s(path: str, tail_bytes: int = 65536) -> float:
  """The newest `time_s` among the last records of a metrics.jsonl (0 if none): reads its tail
  only, so resuming a long run does not read its whole history."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(f.tell() - tail_bytes, 0))
      lines = f.read().decode("utf-8", errors="replace").splitlines()
  except FileNotFoundError:
    return 0.0
  times = []
  for line in lines[1:] if len(lines) > 1 else lines:  # the first may be cut in the middle
    try:
      times.append(float(json.loads(line)["time_s"]))
    except (ValueError, KeyError, TypeError):
      continue
  return max(times, default=0.0)


# Records of these kinds go to the event tape too (runtime/records/event_tape.py): what happened to the
# job, beside the merges and the learners' takes and applies.
TAPE_KINDS = frozenset({"fault", "rejoin", "syncer_restart", "job_restart", "checkpoint", "absent",
                        "back"})


# Records a reader watching a run waits for (progress, evaluations: a benchmark that stops a run
# at its time limit reports from them), written through at once; a few per log_every steps.
_FLUSHED_KINDS = frozenset({"learner", "eval"})


class MetricsWriter:
  """Appends records to workdir/metrics.jsonl and scalars to TensorBoard under workdir/tb; with
  `tape`, the event tape to workdir/tape.jsonl."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, resume_at_s: float | None = None,
               tape: bool = False):
    """`resume_at_s`: a resumed run appends to the earlier records, its times going on from
    there (TensorBoard reads the new event file after the earlier ones); None starts afresh."""
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self._lock = threading.Lock()
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_at_s is not None:
      # The interrupted run wrote records after its checkpoint's cut (the checkpoint's own, the
      # stop's): times go on from the latest of them, so they never run backwards in the file.
      resume_at_s = max(resume_at_s, _last_time_s(path))
    self._start = time.monotonic() - (resume_at_s or 0.0)
    mode = "w" if resume_at_s is None else "a"
    self._jsonl = open(path, mode, encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tb")) if tensorboard else None
    self._tape = open(os.path.join(workdir, "tape.jsonl"), mode, encoding="utf-8") if tape \
        else None

  @property
  def taping(self) -> bool:
    """Whether `tape_event` records anything (config.tape)."""
    return self._tape is not None

  def write(self, kind: str, record: dict[str, Any], *, step: int | None = None,
            scalars: dict[str, float] | None = None) -> None:
    """Writes one record; `scalars` (tag -> value) also go to TensorBoard at `step`."""
    line = {"kind": kind, "time_s": round(time.monotonic() - self._start, 4), **_plain(record)}
    text = json.dumps(line) + "\n"
    with self._lock:
      self._jsonl.write(text)
      if kind in _FLUSHED_KINDS:
        self._jsonl.flush()
      if self._tape is not None and kind in TAPE_KINDS:
        self._tape.write(text)
      if self._tb is not None and scalars and step is not None:
        for tag, value in scalars.items():
          self._tb.add_scalar(tag, float(value), step)

  def tape_event(self, kind: str, record: dict[str, Any]) -> None:
    """Appends one event to the tape only (no-op without one)."""
    if self._tape is None:
      return
    line = json.dumps({"kind": kind, "time_s": round(time.monotonic() - self._start, 4),
                       **_plain(record)}) + "\n"
    with self._lock:
      self._tape.write(line)

  def flush(self) -> None:
    with self._lock:
      self._jsonl.flush()
      if self._tape is not None:
        self._tape.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self) -> None:
    with self._lock:
      self._jsonl.close()
      if self._tape is not None:
        self._tape.close()
      if self._tb is not None:
        self._tb.close()


def read_records(workdir: str, kind: str | None = None) -> list[dict[str, Any]]:
  """The records of workdir/metrics.jsonl, optionally of one kind."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if kind is None or r["kind"] == kind]
