"""What every scripts/study_*.py shares: run the arms of a study, each for a few seeds, as separate
training commands; gather their summaries; write results/study_<name>.{json,md,png}.

An arm is a name and the config overrides that make it (dotted field names, as on the command
line). Every run is its own `python -m decoupled_diloco.main` process, so no run inherits another's
threads, caches or memory. A run's workdir is named by a hash of its overrides
($STUDY_ROOT/<hash>, /tmp/studies by default), and a workdir that already holds the summary of the
same command is read back, not run again (`--fresh` runs all): a study that was stopped starts
again where it stopped, and two studies that share an arm (study_merge_rule's RDA arm is
study_learners' M = 8) run it once.
Seeds go round the arms (seed 0 of every arm, then seed 1 of every arm, ...), so a change in the
machine's load during a study falls on every arm alike.

STUDY_READ_ONLY=1 makes the tables and figures again from the runs made, and fails rather than
train. `--previous=results/study_<name>.json` reads the runs an earlier results file recorded
(arm and seed alike) back from it instead of running them, for a study whose workdirs are gone:
adding a seed or an arm runs only those. The report lists what was read back and when it was made.
The figures of a study come from the runs' `summary.json`s and `metrics.jsonl`s; each study script
says which and prints its table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "experiments" / "tiny_cpu.py"
# Every study run: no checkpoints (their writes would cost the arms time unevenly), one shared
# compilation cache (the arms' programs are compiled once per shape, not once per run).
QUIET = {"checkpoint.every_steps": 0, "checkpoint.syncer_every_s": 0.0, "restore": "none",
         "tape": False, "compilation_cache_dir": "/tmp/study_jax_cache"}
# The training settings every study was made with: tiny_cpu's defaults until the quality study
# (study_quality) moved tiny_cpu's inner learning rate and outer momentum to what it found. Set
# on every run (an arm's own value wins), so the studies' commands make the published figures
# whatever tiny_cpu's defaults are now.
STUDY_SETTINGS = {"inner.learning_rate": 3e-3, "outer.momentum": 0.6}


# The runs an earlier results file recorded (--previous): {arm: {seed: (figures, date made)}},
# and the (arm, seed, date) of each one a study read back from it, for its report.
_PREVIOUS_RUNS: dict[str, dict[int, tuple[dict[str, Any], str]]] = {}
_READ_BACK: list[dict[str, Any]] = []
_LOADED: dict[str, dict[str, Any]] = {}


def read_previous(path: str) -> dict[str, Any]:
  """Loads an earlier results file for run_study to read its runs back from (its `runs`,
  `calibration` and `confirm_runs`); returns the whole report."""
  report = json.loads(pathlib.Path(path).read_text())
  dates = {(r["arm"], r["seed"]): r["date"] for r in report.get("read_back", [])}
  for key in ("runs", "calibration", "confirm_runs"):
    for arm, by_seed in report.get(key, {}).items():
      for seed, figures in by_seed.items():
        made = dates.get((arm, int(seed)), report.get("date"))
        _PREVIOUS_RUNS.setdefault(arm, {})[int(seed)] = (figures, made)
  return report


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  overrides: Mapping[str, Any]


def _flag_value(value: Any) -> str:
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def command(overrides: Mapping[str, Any], config: pathlib.Path = DEFAULT_CONFIG) -> list[str]:
  """The training command of one run."""
  return [sys.executable, "-m", "decoupled_diloco.main", f"--config={config}"] + [
      f"--config.{field}={_flag_value(value)}" for field, value in sorted(overrides.items())]


def run_one(workdir: pathlib.Path, overrides: Mapping[str, Any], *, fresh: bool,
            config: pathlib.Path = DEFAULT_CONFIG) -> dict[str, Any]:
  """Runs one training command in `workdir` (or reads back its summary): the summary, with the
  command and the merge records of metrics.jsonl (`merges`)."""
  overrides = {**QUIET, **STUDY_SETTINGS, **overrides, "workdir": str(workdir)}
  cmd = command(overrides, config)
  if not (workdir / "summary.json").exists():
    _adopt(workdir, cmd)
  done = workdir / "summary.json"
  stamp = workdir / "command.json"
  if (not fresh and done.exists() and stamp.exists()
      and _same_run(json.loads(stamp.read_text()), cmd)):
    summary = json.loads(done.read_text())
  elif os.environ.get("STUDY_READ_ONLY"):  # tables and figures again from the runs made
    raise RuntimeError(f"STUDY_READ_ONLY: no finished run of {' '.join(cmd)}")
  else:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    with open(workdir / "log.txt", "w", encoding="utf-8") as log:
      proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not done.exists():
      tail = (workdir / "log.txt").read_text().splitlines()[-15:]
      raise RuntimeError(f"run failed (exit {proc.returncode}): {' '.join(cmd)}\n" +
                         "\n".join(tail))
    stamp.write_text(json.dumps(cmd))
    summary = json.loads(done.read_text())
  summary["command"] = cmd
  return summary


def _adopt(workdir: pathlib.Path, cmd: list[str]) -> None:
  """Moves a finished run of the same command made under another name (another checkout's
  workdir naming) to `workdir`."""
  for other in workdir.parent.glob("*/command.json"):
    if other.parent != workdir and (other.parent / "summary.json").exists() and _same_run(
        json.loads(other.read_text()), cmd):
      shutil.rmtree(workdir, ignore_errors=True)  # a run stopped before its summary
      other.parent.rename(workdir)
      return


def _same_run(recorded: list[str], cmd: list[str]) -> bool:
  """The same command but for where the repo is (the python and config paths)."""
  def key(c):
    return [a.split("/experiments/")[-1] if a.startswith("--config=") else a for a in c[1:]
            if not a.startswith("--config.workdir=")]
  return key(recorded) == key(cmd)


def metrics(workdir: pathlib.Path, kind: str) -> list[dict[str, Any]]:
  """The records of one kind in a run's metrics.jsonl."""
  out = []
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if record.get("kind") == kind:
        out.append(record)
  return out


def run_study(name: str, arms: Sequence[Arm], seeds: Sequence[int], *,
              base: Mapping[str, Any], fresh: bool,
              figures: Callable[[pathlib.Path, dict[str, Any]], dict[str, Any]],
              config: pathlib.Path = DEFAULT_CONFIG) -> dict[str, dict[int, dict[str, Any]]]:
  """Every arm for every seed: {arm: {seed: figures(workdir, summary)}}.

  `base`: overrides every arm shares (the study's model size and steps); an arm's own override
  of the same field wins. `figures` picks what the study reports from one run.
  """
  del name  # the workdirs are named by their overrides, whichever study asks
  previous_report()  # --previous: its runs are read back below
  root = pathlib.Path(os.environ.get("STUDY_ROOT", "/tmp/studies"))
  results: dict[str, dict[int, dict[str, Any]]] = {arm.name: {} for arm in arms}
  total = len(arms) * len(seeds)
  started = time.perf_counter()
  for i, seed in enumerate(seeds):
    for j, arm in enumerate(arms):
      overrides = {**base, "seed": seed, **arm.overrides}
      # The config by its path in the repo: a study run from another checkout finds the runs.
      where = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
      key = json.dumps([str(where), sorted((k, _flag_value(v)) for k, v in overrides.items())])
      workdir = root / hashlib.sha1(key.encode()).hexdigest()[:12]
      t0 = time.perf_counter()
      if seed in _PREVIOUS_RUNS.get(arm.name, {}) and not fresh:
        results[arm.name][seed], made = _PREVIOUS_RUNS[arm.name][seed]
        _READ_BACK.append({"arm": arm.name, "seed": seed, "date": made})
      else:
        summary = run_one(workdir, overrides, fresh=fresh, config=config)
        results[arm.name][seed] = figures(workdir, summary)
      n = i * len(arms) + j + 1
      shown = ", ".join(f"{k} {_short(v)}" for k, v in results[arm.name][seed].items()
                        if isinstance(v, (int, float)))
      print(f"[{n}/{total}] {arm.name} seed {seed}: {shown} "
            f"({time.perf_counter() - t0:.0f} s; {time.perf_counter() - started:.0f} s so far)",
            flush=True)
  return results


def _short(v: float) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def spread(values: Sequence[float]) -> dict[str, float]:
  """Mean, min, max and max - min of one figure over seeds."""
  values = [float(v) for v in values]
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
          "spread": max(values) - min(values), "n": len(values)}


def summarize(results: dict[str, dict[int, dict[str, Any]]], keys: Sequence[str]
              ) -> dict[str, dict[str, dict[str, float]]]:
  """{arm: {key: spread over seeds}} for the numeric figures `keys`."""
  return {arm: {k: spread([r[k] for r in by_seed.values()]) for k in keys}
          for arm, by_seed in results.items()}


def paired(results: dict[str, dict[int, dict[str, Any]]], arm: str, reference: str,
           key: str = "final_eval_loss") -> str:
  """`arm` minus `reference`, seed by seed ('+0.0198 / +0.0328'): where the seed spread is larger
  than the gap between arms, whether the gap keeps its sign on every seed tells more."""
  seeds = sorted(set(results[arm]) & set(results[reference]))
  return " / ".join(f"{results[arm][s][key] - results[reference][s][key]:+.4f}" for s in seeds)


def fmt(stat: Mapping[str, float], digits: int = 4) -> str:
  """'mean (min-max)' of a `spread`, or the one value of a single seed."""
  if stat["n"] == 1:
    return f"{stat['mean']:.{digits}f}"
  return f"{stat['mean']:.{digits}f} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def write(name: str, report: dict[str, Any], markdown: str, out_dir: pathlib.Path | None = None
          ) -> pathlib.Path:
  """results/study_<name>.json and .md; returns the path stem (for the figure)."""
  out_dir = out_dir or ROOT / "results"
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = out_dir / f"study_{name}"
  report = {**report, "machine": f"{os.cpu_count()} CPU cores",
            "date": time.strftime("%Y-%m-%d")}
  if _READ_BACK:
    report["read_back"] = list(_READ_BACK)
    markdown = markdown.rstrip() + "\n\nRead back from an earlier results file (`--previous`), " \
        "not run again: " + "; ".join(f"{r['arm']} seed {r['seed']} ({r['date']})"
                                      for r in _READ_BACK) + ".\n"
  stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
  stem.with_suffix(".md").write_text(markdown.rstrip() + "\n")
  print(f"wrote {stem}.json, {stem}.md", flush=True)
  return stem


def study_flags(num_steps: int = 200, seeds_help: str = "Seeds of every arm."):
  """The flags every study takes: --num_steps (None: the study has none), --seeds, --fresh."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  steps = None if num_steps is None else flags.DEFINE_integer(
      "num_steps", num_steps, "Inner steps of every learner, every arm.")
  seeds = flags.DEFINE_list("seeds", ["0", "1"], seeds_help)
  fresh = flags.DEFINE_bool("fresh", False, "Run every arm again, even if its summary exists.")
  flags.DEFINE_string("previous", "", "An earlier results/study_<name>.json whose runs are read "
                      "back from it, not run again.")
  return steps, seeds, fresh


def previous_report() -> dict[str, Any] | None:
  """The report of --previous, loaded once for run_study to read its runs back from (None
  without the flag, or before the flags are parsed)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if "previous" not in flags.FLAGS or not flags.FLAGS.is_parsed() or not flags.FLAGS.previous:
    return None
  path = flags.FLAGS.previous
  if path not in _LOADED:
    _LOADED[path] = read_previous(path)
  return _LOADED[path]


def pyplot():
  """matplotlib.pyplot, drawing to files only."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, stem: pathlib.Path) -> None:
  fig.tight_layout()
  fig.savefig(f"{stem}.png", dpi=100)
  print(f"wrote {stem}.png")


def yerr(stats: Sequence[Mapping[str, float]]) -> list[list[float]]:
  """Error bars from the mean down to the min and up to the max of `spread`s (matplotlib's
  `yerr`)."""
  return [[s["mean"] - s["min"] for s in stats], [s["max"] - s["mean"] for s in stats]]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def eval_curve(summary: Mapping[str, Any]) -> list[tuple[float, float, int]]:
  """(seconds since training started, eval loss, step) of every evaluation of a run."""
  return [(e.get("at_s", float("nan")), e["eval_loss"], e["step"])
          for e in summary["eval_history"]]
