r"""The same experiment at two git revisions, run alternately on this machine: before/after figures.

The base revision is checked out into a temporary git worktree (nothing in this tree changes); each
revision runs `python -m decoupled_diloco.main` with the same config arguments, alternately, and the
summary keys both wrote are tabulated with their after/before ratio. Keys a revision did not write
show as "-". Runs share the machine, so compare within one invocation only.

  python scripts/compare_revisions.py --base=e850be8 -- --config.num_steps=400
  python scripts/compare_revisions.py --base=HEAD~3 --repeats=2 --out=/tmp/cmp -- \
      --config=experiments/dp_baseline_cpu.py
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_KEYS = ("final_eval_loss", "train_seconds", "learner_steps_per_s", "merges", "merges_due",
                "late_offers", "rounds_without_quorum", "unmerged_steps_at_end",
                "double_merged_offers", "discarded_progress", "eval_seconds",
                "bytes_learner_syncer", "host_peak_rss_bytes")


def _run(tree: pathlib.Path, config_args: list[str], workdir: str) -> dict:
  args = list(config_args)
  if not any(a.startswith("--config=") for a in args):
    args.insert(0, "--config=experiments/tiny_cpu.py")
  command = [sys.executable, "-m", "decoupled_diloco.main", *args, f"--config.workdir={workdir}"]
  env = dict(os.environ, PYTHONPATH=str(tree))
  subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def _mean(value):
  return sum(value) / len(value) if isinstance(value, list) and value and all(
      isinstance(v, (int, float)) for v in value) else value


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base", required=True, help="git revision to compare against")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--keys", default=",".join(DEFAULT_KEYS))
  parser.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
  parser.add_argument("config_args", nargs="*", help="after --: arguments for the entry point")
  args = parser.parse_args()
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="compare_revisions_"))
  base_tree = scratch / "base"
  subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=ROOT,
                 check=True, capture_output=True)
  base_sha = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
  head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
  runs = {"before": [], "after": []}
  try:
    for repeat in range(args.repeats):
      for label, tree in (("before", base_tree), ("after", ROOT)):
        summary = _run(tree, args.config_args, str(scratch / f"{label}_{repeat}"))
        runs[label].append(summary)
        print(f"{label} ({base_sha if label == 'before' else head_sha}) run {repeat}: final eval "
              f"{summary['final_eval_loss']:.4f}, {summary['train_seconds']:.0f} s training",
              flush=True)
  finally:
    subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT,
                   capture_output=True)
  keys = args.keys.split(",")
  table = {}
  for key in keys:
    values = {label: [_mean(s[key]) for s in runs[label] if key in s] for label in runs}
    table[key] = {label: (sum(v) / len(v) if v and all(isinstance(x, (int, float)) for x in v)
                          else (v[0] if v else None)) for label, v in values.items()}
  lines = [f"`python scripts/compare_revisions.py --base={args.base} -- "
           f"{' '.join(args.config_args)}` ({args.repeats} run(s) each, alternating)", "",
           f"| key | before ({base_sha}) | after ({head_sha}) | after / before |", "|---|---|---|---|"]
  for key, row in table.items():
    before, after = row["before"], row["after"]
    ratio = (f"{after / before:.3f}" if isinstance(before, (int, float)) and
             isinstance(after, (int, float)) and before else "")
    show = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    lines.append(f"| {key} | {show(before)} | {show(after)} | {ratio} |")
  print("\n".join(lines))
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump({"base": base_sha, "head": head_sha, "config_args": args.config_args,
                 "repeats": args.repeats, "table": table}, f, indent=2)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
