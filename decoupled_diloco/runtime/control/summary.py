"""The run's summary (`workdir/summary.json`): losses, tokens, bytes, merges, faults and where every
token went, throughput and memory, added to the history of the run it resumed from.
"""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Sequence
from typing import Any

import numpy as np

from decoupled_diloco.algorithm import shards as shards_lib
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.lm import flops as flops_lib
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.core import throughput as throughput_lib


def run_summary(run: run_lib.Run, evals, train_seconds: float, wall_seconds: float
                ) -> dict[str, Any]:
  """The whole run's summary: a resumed run adds what it did to the checkpoint's history."""
  learners, syncer, history = run.learners, run.syncer, run.history
  tokens_per_step = [run.settings.tokens_per_step(m) for m in range(len(learners))]
  stats = syncer.stats if syncer is not None else syncer_lib.SyncerStats()
  tape = syncer.tape if syncer is not None else []
  final_steps = [l.step for l in learners]
  num_fragments = max(len(run.fragments), 1)
  supervisor = run.supervisor
  retired = run_lib.retired(run)
  incarnations = learners + retired  # every learner that ever trained
  steps_made = [history["steps_made"][m] + sum(l.steps_made for l in incarnations if l.index == m)
                for m in range(len(learners))]
  summary = {
      "mode": run.settings.mode,
      "num_learners": run.settings.num_learners,
      "num_params": run.num_params,
      "num_fragments": len(run.fragments),
      # Learners an elastic restore dropped count with the steps they made before it.
      "tokens_trained": int(np.dot(steps_made, tokens_per_step))
                        + sum(d["tokens"] for d in history.get("dropped_learners", ())),
      "final_eval_loss": evals[-1]["eval_loss"],  # nats per token
      # On the validation split (config.data.validation_fraction; None without one).
      "final_validation_loss": evals[-1].get("validation_loss"),
      "final_eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
      "tokenizer": run.data_info["tokenizer"],
      # Bad records left out of the data (empty, missing text field, invalid UTF-8, bad JSON): at
      # load time for text, when scripts/prepare_data.py packed it for ArrayRecord shards.
      "data_records_skipped": sum(run.data_info["records_skipped"].values()),
      "data_records_skipped_by_reason": run.data_info["records_skipped"],
      "eval_history": evals,
      "eval_seconds": sum(e["seconds"] for e in evals),
      "bytes_learner_syncer": stats.bytes_up + stats.bytes_down,
      "bytes_learner_to_syncer": stats.bytes_up,
      # Every offer the syncer took, merged or not (late, judged stale): what crossed the
      # network learner -> syncer; bytes_learner_to_syncer counts the merged ones.
      "bytes_offers_taken": stats.bytes_offered,
      "bytes_syncer_to_learners": stats.bytes_down,
      "bytes_syncer_allreduce": stats.bytes_allreduce,
      # compression.broadcast_delta: broadcasts that went out whole (Theta_p, not a delta).
      "broadcast_keyframes": stats.keyframes,
      # Theta_p sent again after the flush's final rounds to a learner whose reports did not yet
      # say it held it (a broadcast lost on the way); the flush returns once every one does.
      "flush_resent_fragments": stats.flush_resent_fragments,
      "wall_seconds": wall_seconds,
      "train_seconds": train_seconds,
      "build_seconds": run.build_seconds,
      **{k: round(v, 3) for k, v in run.compile_seconds.items()},
      # Seconds from the start of the build to the first step of the first / the last learner
      # (learners sharing devices make their first steps one after another); None: no step.
      **_first_steps(run, incarnations),
      "learner_steps": final_steps,
      "learner_steps_per_s": [len(l.step_times) / max(sum(l.step_times), 1e-9) for l in learners],
      "learner_errors": [None if l.error is None else repr(l.error) for l in learners],
      # config.ray.processes_per_learner > 1: whether each learner's processes ended holding the
      # same copies of every parameter piece (None: a learner of one process).
      "learner_replicas_agree": [l.replicas_agree for l in learners],
      "merges": stats.merges,
      "merges_due": stats.merges_due,
      "merges_before_flush": stats.merges - stats.final_merges,
      "final_merges": stats.final_merges,
      "late_offers": stats.late_offers,
      "stale_answers": stats.stale_answers,
      "rounds_without_quorum": stats.rounds_without_quorum,
      "empty_rounds": stats.empty_rounds,
      "due_while_in_flight": stats.due_while_in_flight,
      **_shard_summary(run),
      # From the merge tape, not assumed: steps no merge took in, and steps merged twice.
      "unmerged_steps_at_end": tape_lib.unmerged_steps_at_end(
          tape, final_steps, num_fragments, [l.incarnation for l in learners],
          supervisor.start_steps if supervisor is not None else None)
                               if syncer is not None else [0] * len(learners),
      "double_merged_offers": tape_lib.double_merged_offers(tape),
      # Share of each learner's fragment-steps that the paper's overwrite on receive discarded.
      "discarded_progress": [
          (history["discarded_fragment_steps"][m] +
           sum(l.discarded_fragment_steps for l in incarnations if l.index == m))
          / max(steps_made[m] * num_fragments, 1) for m in range(len(learners))],
      # Checkpoints: the ones this run wrote, and every resume of the run with what it skipped.
      "checkpoints_written": [c for c in run.checkpoints.saved if c["kind"] == "job"]
                             if run.checkpoints is not None else [],
      "resumes": history["resumes"],
      # Per learner, seconds at lock-step barriers (waiting for merges, slower peers, and peers
      # being repaired); 0 in decoupled and dp modes, which have no barrier.
      "barrier_wait_seconds": [round(
          history.get("barrier_wait_seconds", [0.0] * len(learners))[m] +
          sum(l.barrier_wait_s for l in incarnations if l.index == m), 3)
          for m in range(len(learners))],
      "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "device_peak_bytes": _device_peak_bytes(run),
      # Throughput of this process's learner steps, every incarnation's, outside evaluations
      # (runtime/core/throughput.py says which time counts); mfu is null where the chip's peak is
      # not known (CPU).
      "device_kind": _device_kind(run),
      "model_flops_per_token": flops_lib.model_flops_per_token(run.settings.model,
                                                               run.settings.data.seq_len),
      "peak_flops_per_s_per_device": throughput_lib.peak_flops_per_s(_device_kind(run)),
      **dataclasses.asdict(throughput(run, incarnations)),
  }
  if syncer is not None:
    summary.update(_fault_summary(run, tape, incarnations, steps_made, tokens_per_step))
    summary["syncer_held_bytes"] = syncer.held_bytes()
    summary["syncer_peak_held_bytes"] = stats.peak_held_bytes
    # The freed C heap handed back to the OS after merges (config.syncer.heap_trim_every_s).
    summary["syncer_heap_trims"] = stats.heap_trims
    summary["syncer_heap_trim_seconds"] = round(stats.heap_trim_s, 4)
    summary["syncer_steady_state_bytes"] = syncer.steady_state_bytes()
  else:
    summary.update(_job_restart_summary(run, tokens_per_step[0]))
  return summary


def _shard_summary(run: run_lib.Run) -> dict[str, Any]:
  """Per shard of the syncer (config.syncer.num_shards; one entry for a syncer not sharded): the
  fragments it owns and their bytes, its merges, and the seconds its merge workers were busy
  (screening, merging, encoding). Nothing in dp mode, which has no syncer."""
  if run.syncer is None:
    return {}
  num_shards = run.settings.syncer.num_shards
  nbytes = [f.nbytes for f in run.fragments]
  owner = shards_lib.assign(nbytes, num_shards)
  stats = run.syncer.shard_stats
  return {"syncer_shard_fragments": [list(shards_lib.owned(owner, i)) for i in range(num_shards)],
          "syncer_shard_bytes": shards_lib.loads(owner, nbytes, num_shards),
          "merges_per_shard": [s.merges for s in stats],
          "syncer_busy_seconds_per_shard": [round(s.busy_s, 3) for s in stats]}


def params_hashes(run: run_lib.Run) -> dict[str, Any]:
  """`params_sha256` of the global model; with the tape on, every learner's final parameters too
  (what a replay must reproduce bit for bit)."""
  hashes: dict[str, Any] = {"params_sha256": tape_lib.params_sha256(run_lib.global_params(run))}
  if run.settings.tape and run.settings.runtime == "threads":
    hashes["learner_params_sha256"] = [tape_lib.params_sha256(l.params()) for l in run.learners]
  return hashes


def throughput(run: run_lib.Run, learners, last: int | None = None) -> throughput_lib.Throughput:
  """Of the learners' steps (each one's `last` ones; all by default), those that overlapped no
  evaluation: tokens over step seconds x devices, and MFU (runtime/core/throughput.py)."""
  settings = run.settings
  tokens = device_seconds = 0.0
  sharing = settings.devices.learners_sharing_devices
  groups: dict[int, list[Any]] = {}  # learners (every incarnation) by the devices they share
  for learner in learners:
    groups.setdefault(learner.index // sharing, []).append(learner)
  for group in groups.values():
    steps = []
    for learner in group:
      # A learner thread may append a step between the two reads: pair them from the start.
      done = min(len(learner.step_ends), len(learner.step_times))
      first = max(done - last, 0) if last is not None else 0
      steps.append((learner.step_ends[first:done], learner.step_times[first:done]))
    if sharing > 1:
      # Their steps took turns on these devices: count each second of them once.
      counts, seconds = throughput_lib.shared_steps_outside(steps, run.eval_windows)
    else:
      outside = [throughput_lib.steps_outside(ends, times, run.eval_windows)
                 for ends, times in steps]
      counts, seconds = [c for c, _ in outside], sum(s for _, s in outside)
    tokens += sum(c * settings.tokens_per_step(l.index) for c, l in zip(counts, group))
    device_seconds += seconds * len(group[0].mesh_devices)
  return throughput_lib.throughput(
      tokens, device_seconds, flops_lib.model_flops_per_token(settings.model, settings.data.seq_len),
      throughput_lib.peak_flops_per_s(_device_kind(run)))


def _device_kind(run: run_lib.Run) -> str:
  return run.learners[0].mesh_devices[0].device_kind


def _first_steps(run: run_lib.Run, incarnations) -> dict[str, float | None]:
  firsts = [l.first_step_done_at - run.build_started_at for l in incarnations
            if l.incarnation == 0 and l.first_step_done_at is not None
            and run.build_started_at is not None]
  return {"first_step_s": round(min(firsts), 3) if firsts else None,
          "last_first_step_s": round(max(firsts), 3) if firsts else None}


def _job_restart_summary(run: run_lib.Run, tokens_per_step: int) -> dict[str, Any]:
  """dp mode: every failure stopped the job, which restarted from its newest checkpoint. The
  steps made after that checkpoint are lost: trained (in `tokens_trained`) but not in the model,
  so tokens_trained = tokens in the final model + tokens_lost_at_restarts."""
  history = run.history
  failures = [dict(f) for f in history["failures"]] + (
      run.restarter.summary_records() if run.restarter is not None else [])
  faults = [dict(f) for f in history["faults"]] + (
      [dict(f) for f in run.injector.records] if run.injector is not None else [])
  for fault in faults:
    if fault["fault"] == "crash":
      stopped = [r for r in failures if r["step"] == fault["step"] and "LearnerFailure" in r["error"]]
      fault.update({k: v for k, v in (stopped[0] if stopped else {}).items()
                    if k not in ("learner", "step", "error")})
  lost = sum(r.get("steps_lost", 0) for r in failures)
  return {
      "faults": faults,
      "failures": failures,
      "job_restarts": sum(1 for r in failures if r.get("restarted")),
      "steps_lost_at_restarts": int(lost),
      "tokens_lost_at_restarts": int(lost * tokens_per_step),
  }


def _fault_summary(run: run_lib.Run, tape, incarnations, steps_made,
                   tokens_per_step: Sequence[int]) -> dict[str, Any]:
  """Faults, restarts and where every token went (docs/design.md §6)."""
  supervisor, stats = run.supervisor, run.syncer.stats
  history = run.history
  failures = [dict(f) for f in history["failures"]] + (
      supervisor.summary_records() if supervisor is not None else [])
  lost = 0
  for failure in failures:
    versions = failure.pop("anchor_versions")
    failure["lost_fragment_tokens"] = sum(failure.pop("counter_tokens")) - (
        tape_lib.merged_after_failure(tape, failure["learner"], failure["incarnation"],
                                      versions)) + (
        tape_lib.applied_then_lost(tape, failure["learner"], failure["incarnation"], versions))
    lost += failure["lost_fragment_tokens"]
  faults = [dict(f) for f in history["faults"]] + (
      [dict(f) for f in run.injector.records] if run.injector is not None else []) + (
      [dict(f) for f in run.keeper.fault_records] if run.keeper is not None else []) + (
      [dict(f) for f in run.corrupter.records] if run.corrupter is not None else [])
  for fault in faults:
    if fault["fault"] in ("crash", "node_loss") and fault["learner"] is not None:
      healed = [r for r in failures if r["learner"] == fault["learner"]
                and r["step"] == fault["step"]]
      fault.update({k: v for k, v in (healed[0] if healed else {}).items()
                    if k not in ("learner", "step", "error")})
  num_fragments = max(len(run.fragments), 1)
  # Learners an elastic restore dropped (runtime/records/elastic_restore.py): what they made before it,
  # the share the overwrite discarded, and what they held unmerged, lost with them.
  dropped = history.get("dropped_learners", ())
  # Every token a learner trained on reaches each fragment of Theta through a merge, or is
  # discarded by an overwrite on receive, lost with a failed learner, or still unmerged at the end:
  # made = merged + discarded + lost + unmerged, per fragment, summed (tests check the equality).
  accounting = {
      "made": int((np.dot(steps_made, tokens_per_step) + sum(d["tokens"] for d in dropped))
                  * num_fragments),
      "merged": int(sum(sum(r["tokens"]) for r in tape_lib.installed(tape))),
      "discarded": int(sum(history["discarded_fragment_tokens"]) +
                       sum(l.discarded_fragment_tokens for l in incarnations) +
                       sum(d["discarded_fragment_tokens"] for d in dropped)),
      "lost_at_failures": int(lost + sum(d["unmerged_fragment_tokens"] for d in dropped)),
      "unmerged_at_end": int(sum(l.counters().tokens.sum() for l in run.learners
                                 if l not in incarnations[len(run.learners):])),
  }
  return {
      "faults": faults,
      "failures": failures,
      "rejoins": sum(1 for r in failures if r.get("restarted")),
      # By cause: the learners' own failures, and slices lost (under Pathways, waited for; under
      # config.ray.tpu_slice, left for another slice). A record from before causes were kept, or
      # whose cause was still unknown when the run ended, counts as the learner's own.
      "application_failures": sum(1 for r in failures if r.get("cause") != supervisor_lib.LOST_SLICE),
      "lost_slice_failures": sum(1 for r in failures
                                 if r.get("cause") == supervisor_lib.LOST_SLICE),
      "joins": sum(1 for f in faults if f["fault"] == "join"),  # late learners admitted
      # Syncer crashes and what each restart restored (from its checkpoint, from the learners).
      "syncer_restarts": len(run.keeper.records) if run.keeper is not None else 0,
      "posts_lost_while_syncer_down": (sum(r["posts_lost"] for r in run.keeper.records)
                                       if run.keeper is not None else 0),
      "rejected_offers": dict(stats.rejected_offers),
      "fragment_token_accounting": accounting,
      # Heartbeats: learners found silent past config.sync.heartbeat_timeout_s, and taken back.
      "heartbeat_absences": stats.absences,
      "heartbeat_returns": stats.returns,
      # Posts of and broadcasts to a learner cut off by a partition fault (lost, not delayed).
      "partition_messages_lost": sum(f.get("messages_lost", 0) for f in faults
                                     if f["fault"] == "partition"),
  }


def _device_peak_bytes(run: run_lib.Run) -> int | None:
  """Largest peak of bytes in use over the learners' devices (None where the platform does not
  report it, as on CPU)."""
  peaks = []
  for learner in run.learners:
    for device in learner.mesh_devices:
      stats = device.memory_stats()
      if stats and "peak_bytes_in_use" in stats:
        peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None
