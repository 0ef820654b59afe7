"""Stop a run with SIGTERM, resume it, and compare it with the same run uninterrupted.

  .venv/bin/python scripts/bench_resume.py [--config=experiments/tiny_cpu.py] [--stop_step=200]
  # An elastic restore: the 4-learner run's checkpoint resumed as 2 learners.
  .venv/bin/python scripts/bench_resume.py --resume_flag=--config.num_learners=2 \
      --out=results/resume_elastic_2.json

Runs three processes as a user would (`python -m decoupled_diloco.main`): the whole run; the same
run stopped by SIGTERM once a learner has logged `--stop_step`; and that run started again with
`--config.restore=latest` (and every `--resume_flag`: another number of learners or mesh shape is
an elastic restore, runtime/records/elastic_restore.py; `--flag` goes to all three runs). Prints and writes `results/resume.json`: final eval loss of both, their
ratio, tokens trained, double merges, the step the checkpoint was cut at.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

from decoupled_diloco import errors

_CONFIG = flags.DEFINE_string("config", "experiments/tiny_cpu.py", "Experiment config file.")
_STOP_STEP = flags.DEFINE_integer("stop_step", 200, "SIGTERM once a learner logged this step.")
_OUT = flags.DEFINE_string("out", "results/resume.json", "Where the figures go.")
_FLAGS = flags.DEFINE_multi_string("flag", [], "A --config.a.b=v override for all three runs.")
_RESUME_FLAGS = flags.DEFINE_multi_string(
    "resume_flag", [], "A --config.a.b=v override for the resumed run only (e.g. "
    "--config.num_learners=2: an elastic restore).")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_KEYS = ("final_eval_loss", "tokens_trained", "learner_steps", "double_merged_offers",
         "unmerged_steps_at_end", "merges", "wall_seconds")


def _command(workdir: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "decoupled_diloco.main", f"--config={_CONFIG.value}",
          f"--config.workdir={workdir}", *_FLAGS.value, *extra]


def _logged_step(workdir: str) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      steps = [json.loads(line).get("step", 0) for line in f if '"kind": "learner"' in line]
  except (FileNotFoundError, json.JSONDecodeError):
    return 0
  return max(steps, default=0)


def _summary(workdir: str) -> dict:
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def main(argv):
  del argv
  base = tempfile.mkdtemp(prefix="bench_resume_")
  whole, stopped = os.path.join(base, "whole"), os.path.join(base, "stopped")
  subprocess.run(_command(whole), cwd=_ROOT, check=True)
  process = subprocess.Popen(_command(stopped), cwd=_ROOT)
  while process.poll() is None and _logged_step(stopped) < _STOP_STEP.value:
    time.sleep(0.5)
  process.send_signal(signal.SIGTERM)
  code = process.wait()
  if code != 128 + signal.SIGTERM:
    raise SystemExit(f"the stopped run exited with {code}, not {128 + signal.SIGTERM}")
  subprocess.run(_command(stopped, "--config.restore=latest", *_RESUME_FLAGS.value), cwd=_ROOT,
                 check=True)
  a, b = _summary(whole), _summary(stopped)
  result = {
      "config": _CONFIG.value, "stop_step": _STOP_STEP.value, "flags": _FLAGS.value,
      "resume_flags": _RESUME_FLAGS.value, "elastic": b["resumes"][0].get("elastic"),
      "resumed_from_clock": b["resumes"][0]["clock"],
      "uninterrupted": {k: a[k] for k in _KEYS},
      "stopped_and_resumed": {k: b[k] for k in _KEYS},
      "final_loss_ratio": b["final_eval_loss"] / a["final_eval_loss"],
      "token_accounting_resumed": b.get("fragment_token_accounting"),
  }
  os.makedirs(os.path.dirname(_ROOT / _OUT.value), exist_ok=True)
  with open(_ROOT / _OUT.value, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"uninterrupted {a['final_eval_loss']:.4f}, stopped at step ~{_STOP_STEP.value} "
        f"(checkpoint cut at {result['resumed_from_clock']}) and resumed "
        f"{b['final_eval_loss']:.4f}: ratio {result['final_loss_ratio']:.4f}; tokens "
        f"{a['tokens_trained']} vs {b['tokens_trained']}; double merges "
        f"{b['double_merged_offers']}")


if __name__ == "__main__":
  errors.run_main(main)
