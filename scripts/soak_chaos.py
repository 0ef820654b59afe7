"""Soak: hundreds of injected faults in one run, and the invariants the recovery promises.

  .venv/bin/python scripts/soak_chaos.py [--num_steps=1500] [--mtbf_s=1.5] [--repair_s=0.3]
      [--syncer_crash_every_s=30] [--min_faults=200]

Runs the default experiment (experiments/tiny_cpu.py, 4 learners, decoupled) in this process with
random learner crashes (exponential, mean `mtbf_s` per learner; Weibull repairs of mean
`repair_s`), a syncer crash every `syncer_crash_every_s` seconds and whole-job checkpoints on, and
checks while it runs and at the end:

- no global stall: between two steps of any learner never more than `--max_gap_s` seconds pass
  while at least one learner is up;
- the Theta_p versions a learner incarnation has applied only increase;
- every step made is merged, discarded by an overwrite, lost with a failed learner or unmerged at
  the end (fragment_token_accounting), no offer is merged twice, nothing is left unmerged, every
  learner reaches num_steps.

Prints the counts and writes `results/soak_chaos.json`; exits 1 on a violation or with fewer than
`--min_faults` faults.

`--runtime=ray` runs the same on a Ray cluster of several nodes on this machine
(`ray.cluster_utils.Cluster`, loopback only): one host per learner plus `--spare_hosts` spares,
two syncer hosts, learners and syncer placed by their resources (config.ray.learner_resource,
syncer_resource). `--node_loss_fraction` of the random faults are node losses (the learner's host
taken down with every process on it) and every other syncer fault is its host's loss; a thread
adds a fresh host in place of each lost one, as a cluster's node provisioner would.

  .venv/bin/python scripts/soak_chaos.py --runtime=ray --num_steps=150 --mtbf_s=4 \
      --syncer_crash_every_s=20 --horizon_s=3000 --node_loss_fraction=0.3 \
      --out=results/soak_chaos_ray.json --config.model.num_layers=2 --config.model.embed_dim=64 \
      --config.model.mlp_dim=256 --config.model.num_heads=2 --config.model.head_dim=32 \
      --config.sync.num_fragments=4

(a smaller model than the default's, so that a restarted process is back in seconds; the fault rate
is per second, so the run's length sets the number of faults.)
"""

import json
import os
import pathlib
import sys
import tempfile
import threading
import time

from absl import flags
from ml_collections import config_flags

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from decoupled_diloco import errors
from decoupled_diloco import settings as settings_lib  # pylint: disable=wrong-import-position
from decoupled_diloco.runtime import train  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", str(_ROOT / "experiments/tiny_cpu.py"),
                                          "Experiment config file.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 1500, "Steps per learner.")
_MTBF_S = flags.DEFINE_float("mtbf_s", 1.5, "Mean seconds between crashes, per learner.")
_REPAIR_S = flags.DEFINE_float("repair_s", 0.3, "Mean repair seconds (Weibull).")
_SYNCER_EVERY_S = flags.DEFINE_float("syncer_crash_every_s", 30.0,
                                     "A syncer crash every this many seconds (0: none).")
_SYNCER_DOWN_S = flags.DEFINE_float("syncer_down_s", 1.0, "Seconds each syncer crash lasts.")
_HORIZON_S = flags.DEFINE_float("horizon_s", 600.0, "Syncer crashes are scheduled up to here.")
_MAX_GAP_S = flags.DEFINE_float("max_gap_s", 20.0,
                                "Longest pause of every learner allowed while one is up.")
_MIN_FAULTS = flags.DEFINE_integer("min_faults", 200, "Fewer faults than this is a failure.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random crashes.")
_OUT = flags.DEFINE_string("out", "results/soak_chaos.json", "Where the figures go.")
_RUNTIME = flags.DEFINE_enum("runtime", "threads", ["threads", "ray"],
                             "threads: this process; ray: a Ray cluster of several nodes here.")
_NODE_LOSS = flags.DEFINE_float("node_loss_fraction", 0.3,
                                "runtime=ray: the share of random faults that are node losses.")
_SPARE_HOSTS = flags.DEFINE_integer("spare_hosts", 1, "runtime=ray: spare learner hosts.")

_LEARNER_HOST, _SYNCER_HOST = "learner_host", "syncer_host"


class _Cluster:
  """runtime=ray: Ray nodes on this machine, on loopback, and a thread that adds a host in place
  of each one lost (a dead node is forgotten, a new one of its kind started)."""

  def __init__(self, learner_hosts: int, syncer_hosts: int = 2):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray  # pylint: disable=g-import-not-at-top
    from ray import cluster_utils  # pylint: disable=g-import-not-at-top
    from decoupled_diloco.runtime.transport import ray_runtime  # pylint: disable=g-import-not-at-top
    self._ray, self._env = ray, dict(ray_runtime.LOCAL_ENV)
    self.wanted = {_LEARNER_HOST: learner_hosts, _SYNCER_HOST: syncer_hosts}
    # Ray's node start sets a SIGTERM handler, which only the main thread may: the top-up thread
    # starts nodes without it (the cluster is shut down from the main thread at the end).
    utils = ray._private.utils  # pylint: disable=protected-access
    main_only = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: (
        main_only(handler) if threading.current_thread() is threading.main_thread() else None)
    self.cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(
        self._args(None), _system_config={"health_check_period_ms": 500,
                                          "health_check_failure_threshold": 3}))
    self.hosts_added = 0
    self._top_up()
    self.cluster.wait_for_nodes()
    ray.init(address=self.cluster.address)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._keep_up, daemon=True)
    self._thread.start()

  def _args(self, resource: str | None) -> dict:
    return dict(num_cpus=1 if resource else 0, node_ip_address="127.0.0.1",
                resources={resource: 1} if resource else {}, env_vars=self._env)

  def _top_up(self) -> None:
    alive = [n for n in self._ray.nodes() if n["Alive"]] if self._ray.is_initialized() else []
    alive_ids = {n["NodeID"] for n in alive}
    for node in [n for n in self.cluster.worker_nodes if n.node_id not in alive_ids and alive]:
      self.cluster.remove_node(node, allow_graceful=False)
    for resource, count in self.wanted.items():
      have = sum(1 for n in alive if resource in n["Resources"]) if alive else 0
      for _ in range(count - have):
        self.cluster.add_node(wait=False, **self._args(resource))
        self.hosts_added += 1

  def _keep_up(self) -> None:
    while not self._stop.wait(1.0):
      try:
        self._top_up()
      except Exception as err:  # pylint: disable=broad-except
        print(f"soak: could not add a host ({err!r}); trying again", flush=True)

  def close(self) -> None:
    self._stop.set()
    self._thread.join(30)
    self._ray.shutdown()
    self.cluster.shutdown()


class _Watch:
  """Step hook: records every step's time and checks that applied versions only increase."""

  def __init__(self):
    self.run = None
    self.step_times: list[float] = []
    self.versions: dict[tuple[int, int], list[int]] = {}
    self.violations: list[str] = []
    self._lock = threading.Lock()

  def __call__(self, learner: int, step: int) -> None:
    if self.run is None:
      return
    current = self.run.learners[learner]
    versions = [int(v) for v in current.published.anchor_versions]
    if min(versions, default=0) < 0:
      return  # runtime=ray: a process down or restarting answers with a stand-in, no versions
    with self._lock:
      self.step_times.append(time.monotonic())
      key = (learner, current.incarnation)
      before = self.versions.get(key)
      if before is not None and any(v < b for v, b in zip(versions, before)):
        self.violations.append(f"learner {learner} incarnation {current.incarnation}: versions "
                               f"went back from {before} to {versions} before step {step}")
      self.versions[key] = versions


def _down_intervals(summary: dict) -> list[tuple[float, float, int]]:
  """(from, to, learner) in seconds since training started: each failed learner's time down
  until its first step again."""
  intervals = []
  for failure in summary["failures"]:
    to_first_step = failure.get("repair_to_first_step_s") or 0.0  # None: rejoined at its end
    end = failure.get("repaired_at_s", float("inf")) + to_first_step
    intervals.append((failure["failed_at_s"], end, failure["learner"]))
  return intervals


def _longest_gap_with_one_up(step_times: list[float], started: float, intervals,
                             num_learners: int) -> float:
  """Longest time between two steps (of any learner) during which some learner was not down."""
  times = sorted(t - started for t in step_times)
  longest = 0.0
  for a, b in zip(times, times[1:]):
    mid = (a + b) / 2
    down = {m for lo, hi, m in intervals if lo <= mid <= hi}
    if len(down) < num_learners:
      longest = max(longest, b - a)
  return longest


def main(argv):
  del argv
  config = _CONFIG.value
  config.workdir = tempfile.mkdtemp(prefix="soak_chaos_")
  config.num_steps = _NUM_STEPS.value
  config.eval_every = 0
  config.max_restarts = 100_000
  config.chaos.mtbf_s = _MTBF_S.value
  config.chaos.repair_s = _REPAIR_S.value
  config.chaos.seed = _SEED.value
  ray_mode = _RUNTIME.value == "ray"
  if _SYNCER_EVERY_S.value > 0:
    times = range(int(_SYNCER_EVERY_S.value), int(_HORIZON_S.value), int(_SYNCER_EVERY_S.value))
    config.chaos.schedule = ";".join(
        f"node_loss@syncer,second={t:g}" if ray_mode and i % 2 else
        f"syncer_crash@second={t:g},down_s={_SYNCER_DOWN_S.value:g}"
        for i, t in enumerate(times))
  cluster = None
  if ray_mode:
    cluster = _Cluster(learner_hosts=config.num_learners + _SPARE_HOSTS.value)
    config.runtime = "ray"
    config.ray.address = cluster.cluster.address
    config.ray.learner_resource, config.ray.syncer_resource = _LEARNER_HOST, _SYNCER_HOST
    config.chaos.node_loss_fraction = _NODE_LOSS.value
  try:
    settings = settings_lib.validate(config)
    watch = _Watch()
    run = train.build(settings, step_hook=watch)
    watch.run = run
    started = time.monotonic()
    summary = train.execute(run, progress=True)
  finally:
    if cluster is not None:
      cluster.close()
  # Training started a moment after `started`: the gap test is conservative by that much.
  intervals = _down_intervals(summary)
  gap = _longest_gap_with_one_up(watch.step_times, started, intervals, settings.num_learners)
  tokens = summary["fragment_token_accounting"]
  kinds = {}
  for fault in summary["faults"]:
    kinds[fault["fault"]] = kinds.get(fault["fault"], 0) + 1
  checks = {
      "tokens_add_up": tokens["made"] == (tokens["merged"] + tokens["discarded"]
                                          + tokens["lost_at_failures"] + tokens["unmerged_at_end"]),
      "no_double_merge": summary["double_merged_offers"] == 0,
      "nothing_unmerged_at_end": summary["unmerged_steps_at_end"] == [0] * settings.num_learners,
      "every_learner_finished": summary["learner_steps"] == [settings.num_steps] * len(
          summary["learner_steps"]),
      "versions_only_increase": not watch.violations,
      "no_global_stall": gap <= _MAX_GAP_S.value,
      "enough_faults": len(summary["faults"]) >= _MIN_FAULTS.value,
  }
  result = {
      "command": "scripts/soak_chaos.py " + " ".join(
          f"--{f.name}={f.value}" for f in (_NUM_STEPS, _MTBF_S, _REPAIR_S, _SYNCER_EVERY_S,
                                            _SYNCER_DOWN_S, _SEED) + (
                                                (_RUNTIME, _NODE_LOSS, _SPARE_HOSTS)
                                                if ray_mode else ())) + "".join(
          f" {arg}" for arg in sys.argv[1:] if arg.startswith("--config")),
      "faults": len(summary["faults"]), "faults_by_kind": kinds,
      "rejoins": summary["rejoins"], "syncer_restarts": summary["syncer_restarts"],
      "checkpoints_written": len(summary["checkpoints_written"]),
      **({"hosts_added": cluster.hosts_added} if cluster is not None else {}),
      "longest_pause_with_a_learner_up_s": round(gap, 3),
      "versions_violations": watch.violations[:10],
      "fragment_token_accounting": tokens,
      "rejected_offers": summary["rejected_offers"],
      "posts_lost_while_syncer_down": summary["posts_lost_while_syncer_down"],
      "final_eval_loss": summary["final_eval_loss"],
      "train_seconds": round(summary["train_seconds"], 1),
      "checks": checks,
  }
  out = _ROOT / _OUT.value
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
  print(json.dumps({k: result[k] for k in ("faults", "faults_by_kind", "rejoins",
                                          "syncer_restarts", "longest_pause_with_a_learner_up_s",
                                          "checks")}, indent=2))
  if not all(checks.values()):
    print("SOAK FAILED:", [k for k, ok in checks.items() if not ok])
    sys.exit(1)


if __name__ == "__main__":
  errors.run_main(main)
