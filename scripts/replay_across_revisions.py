r"""A run recorded at one git revision, replayed at this tree's: is the behaviour unchanged?

A refactoring that keeps the behaviour keeps every merge's arithmetic and order. The event tape
(docs/checkpoints_and_replay.md) records what an asynchronous run decided; replaying it at another
revision redoes every step, take, merge and apply in the recorded order, and `params_sha256` (the
global model) and `learner_params_sha256` (each learner) are equal to the recording's only if every
bit of that work is. This script:

1. records a run at `--base` (checked out into a temporary git worktree; nothing here changes), or
   takes an existing recording (`--recording=WORKDIR --recorded_at=REV`);
2. replays it with this tree's code and reads the replay's verdict and hashes;
3. with `--fresh_run` (the default), runs the same experiment with this tree's code and compares
   the `summary.json` keys both revisions write (users' scripts parse them).

  python scripts/replay_across_revisions.py --base=HEAD~5 --out=results/redesign_replay
  python scripts/replay_across_revisions.py --recording=/tmp/rec --recorded_at=2a30976 -- \
      --config.num_steps=100

Exit status 1 if the replay is not exact or a key went missing. Runs share the machine: the
seconds it prints are for orientation only.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _main_command(config_args: list[str], workdir: str) -> list[str]:
  args = list(config_args)
  if not any(a.startswith("--config=") for a in args):
    args.insert(0, "--config=experiments/tiny_cpu.py")
  return [sys.executable, "-m", "decoupled_diloco.main", *args, f"--config.workdir={workdir}"]


def _run(tree: pathlib.Path, command: list[str], workdir: str, label: str) -> dict:
  began = time.monotonic()
  env = dict(os.environ, PYTHONPATH=str(tree))
  log = pathlib.Path(workdir + ".log")
  with open(log, "w", encoding="utf-8") as out:
    done = subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
  if done.returncode:
    sys.exit(f"{label} failed (exit {done.returncode}); its log: {log}")
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  print(f"{label}: {time.monotonic() - began:.0f} s, final eval {summary['final_eval_loss']:.4f}",
        flush=True)
  return summary


def _short(revision: str, cwd: pathlib.Path = ROOT) -> str:
  return subprocess.run(["git", "rev-parse", "--short", revision], cwd=cwd, check=True,
                        capture_output=True, text=True).stdout.strip()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base", help="git revision to record at")
  parser.add_argument("--recording", help="an existing recorded workdir (instead of --base)")
  parser.add_argument("--recorded_at", help="the revision --recording was made at")
  parser.add_argument("--fresh_run", action=argparse.BooleanOptionalAction, default=True,
                      help="also run the experiment at this tree and compare summary keys")
  parser.add_argument("--out", default=None, help="writes OUT.json")
  parser.add_argument("config_args", nargs="*", help="after --: arguments for the entry point")
  args = parser.parse_args()
  if bool(args.base) == bool(args.recording):
    parser.error("give --base=REV or --recording=WORKDIR (with --recorded_at=REV), not both")
  if args.recording and not args.recorded_at:
    parser.error("--recording needs --recorded_at=REV, the revision it was recorded at")
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="replay_across_revisions_"))
  head = _short("HEAD")
  dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout.strip())
  if args.recording:
    recording, recorded_at = os.path.abspath(args.recording), args.recorded_at
    with open(os.path.join(recording, "summary.json"), encoding="utf-8") as f:
      recorded = json.load(f)
  else:
    recorded_at = _short(args.base)
    base_tree = scratch / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=ROOT,
                   check=True, capture_output=True)
    recording = str(scratch / "recording")
    try:
      recorded = _run(base_tree, _main_command(args.config_args, recording), recording,
                      f"recording at {recorded_at}")
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT,
                     capture_output=True)
  replay_dir = str(scratch / "replay")
  replayed = _run(ROOT, _main_command([*args.config_args, f"--config.replay={recording}"],
                                      replay_dir), replay_dir, f"replay at {head}")
  report = {
      "recorded_at": recorded_at, "replayed_at": head + ("+uncommitted" if dirty else ""),
      "config_args": args.config_args,
      "replay_exact": replayed.get("replay_exact"),
      "params_sha256": {"recorded": recorded.get("params_sha256"),
                        "replayed": replayed.get("params_sha256")},
      "learner_params_sha256_equal": (recorded.get("learner_params_sha256") ==
                                      replayed.get("learner_params_sha256")),
      "final_eval_loss": {"recorded": recorded["final_eval_loss"],
                          "replayed": replayed["final_eval_loss"]},
  }
  exact = (report["replay_exact"] is True and report["learner_params_sha256_equal"] and
           report["params_sha256"]["recorded"] == report["params_sha256"]["replayed"])
  print(f"replay of a {recorded_at} recording at {report['replayed_at']}: "
        f"{'exact' if exact else 'NOT exact'}; params_sha256 recorded "
        f"{report['params_sha256']['recorded']}, replayed {report['params_sha256']['replayed']}; "
        f"every learner's hash equal: {report['learner_params_sha256_equal']}")
  missing = []
  if args.fresh_run:
    fresh_dir = str(scratch / "fresh")
    fresh = _run(ROOT, _main_command(args.config_args, fresh_dir), fresh_dir, f"a run at {head}")
    missing, added = sorted(set(recorded) - set(fresh)), sorted(set(fresh) - set(recorded))
    report["summary_keys"] = {"recorded": len(recorded), "fresh": len(fresh),
                              "missing_at_head": missing, "new_at_head": added}
    print(f"summary.json keys: {len(recorded)} at {recorded_at}, {len(fresh)} at {head}; missing "
          f"at {head}: {missing or 'none'}; new: {added or 'none'}")
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2)
      f.write("\n")
  sys.exit(0 if exact and not missing else 1)


if __name__ == "__main__":
  main()
