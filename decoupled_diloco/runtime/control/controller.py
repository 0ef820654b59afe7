"""The controller: runs a built run to the end.

It starts the syncer, the fault injector, the supervisor, the keeper and the learners, then watches
them from one loop (`_train_until_done`): it raises a failure of the syncer or of a restart, and a
stall of every learner, logs the progress line, evaluates the global model on config.eval_every,
and takes the checkpoints that are due. At the end it flushes the syncer, takes the final
checkpoint and the final evaluation, and writes `workdir/summary.json`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.runtime.control import checkpoint_cadence
from decoupled_diloco.runtime.control import live_bar
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import signals
from decoupled_diloco.runtime.control import summary as summary_lib
from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.records import goodput as goodput_lib


def execute(run: run_lib.Run, *, progress: bool = True) -> dict[str, Any]:
  """Runs a built run to the end; returns (and writes) the summary.

  Any failure of the syncer, a stall of every learner for `config.stall_timeout_s`, or a Ctrl-C
  stops every learner and the syncer before the error propagates: no thread trains on alone.
  SIGTERM or a first Ctrl-C (from the main thread's handlers) writes a checkpoint first and
  raises `Interrupted`; a second one exits at once.
  """
  settings, learners, syncer = run.settings, run.learners, run.syncer
  start = time.perf_counter()
  evals: list[dict[str, Any]] = list(run.history["evals"])
  saver = checkpoint_cadence.Checkpointer(run, evals, start)
  stop = signals.StopSignal()
  try:
    stop.install()
    if syncer is not None:
      syncer.start()
    started = time.monotonic()  # the origin of the fault and failure records' seconds
    run.started_at = started
    saver.train_started = time.perf_counter()
    if run.injector is not None:
      run.injector.start(started)
    if run.supervisor is not None:
      run.supervisor.start(started)
    if run.restarter is not None:
      run.restarter.start(started)
    if run.keeper is not None:
      run.keeper.start(started, run.history["train_seconds"], run.history["faults"])
    if run.corrupter is not None:
      run.corrupter.start(started, run.history["train_seconds"], run.history["faults"])
    for learner in learners:
      if run.supervisor is None or not run.supervisor.holds_back(learner.index):
        learner.start()
    bar = live_bar.LiveBar(settings.num_steps) if progress else None
    try:
      _train_until_done(run, evals, progress, saver, stop, bar)
    finally:
      if bar is not None:
        bar.close()
    if stop.signum is not None:
      signals.stop_with_checkpoint(run, saver, stop.signum)
    if run.injector is not None:
      run.injector.stop()
    if run.supervisor is not None:
      run.supervisor.stop()
      _check_supervisor(run.supervisor)
    trained_at = time.perf_counter()
    train_seconds = trained_at - saver.train_started
    flush_seconds = 0.0
    syncer = run.syncer  # the current one (a crashed syncer was replaced)
    if syncer is not None:
      # Merge what every learner did since its last sync, so the global model holds all the work.
      if not syncer.flush(timeout=run.settings.stall_timeout_s):
        raise RuntimeError(f"the final flush did not finish within config.stall_timeout_s="
                           f"{run.settings.stall_timeout_s} s")
      flush_seconds = time.perf_counter() - trained_at
    # The final checkpoint: a run resumed from it has nothing left to train.
    saver.save_now(timeout_s=run.settings.stall_timeout_s, train_seconds=train_seconds)
    for learner in learners:
      learner.release()
    for learner in learners:
      learner.join()
    if syncer is not None:
      syncer.stop()
      syncer.join()
      _check_syncer(syncer)
    if run.transport is not None:
      run.transport.finish(learners, syncer)
    saver.close()
  except BaseException:
    _shut_down(run)
    saver.close(raise_errors=False)
    raise
  finally:
    stop.uninstall()
  final = evaluate(run, max(l.step for l in learners), final=True)
  evals.append(final)
  train_seconds += run.history["train_seconds"]
  wall_seconds = time.perf_counter() - start + run.history["wall_seconds"]
  summary = summary_lib.run_summary(run, evals, train_seconds, wall_seconds)
  # This process's end of the run, after the last learner's last step: the final flush (its share
  # of the learners' idle time in `time_buckets`, which a short run feels most), then the final
  # checkpoint, the joins and the final evaluation.
  summary["flush_seconds"] = round(flush_seconds, 3)
  summary["end_seconds"] = round(time.perf_counter() - trained_at, 3)
  summary.update(summary_lib.params_hashes(run))
  summary.update(goodput_lib.summary(goodput_lib.whole_run(
      run, started_at=run.started_at, ended_at=time.monotonic(), final=True)))
  run.metrics.flush()
  with open(os.path.join(settings.workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  if progress:
    logging.info("done: final eval loss %.4f nats/token (%.4f bits/byte), %.1f s, summary in %s",
                 final["eval_loss"], final["eval_bits_per_byte"], summary["wall_seconds"],
                 os.path.join(settings.workdir, "summary.json"))
    logging.info("goodput %.1f%% (learner-seconds on steps that reached the global model), uptime "
                 "%.1f%% (wall time with a learner training); per learner in time_buckets",
                 100 * summary["goodput"], 100 * summary["uptime"])
  run.metrics.close()
  return summary


def _train_until_done(run: run_lib.Run, evals: list[dict[str, Any]], progress: bool,
                      saver: checkpoint_cadence.Checkpointer, stop: signals.StopSignal,
                      bar: live_bar.LiveBar | None = None) -> None:
  """Watches the learners until every one has made its last step (or failed), or a stop signal."""
  settings, learners, syncer = run.settings, run.learners, run.syncer
  stall_timeout = settings.stall_timeout_s
  clock = max(l.step for l in learners)
  next_log = (clock // settings.log_every + 1) * settings.log_every
  next_eval = (clock // settings.eval_every + 1) * settings.eval_every if settings.eval_every \
      else None
  tail_log = tail_eval = None  # the boundaries once the fastest learner is done (see below)
  last_steps, last_change = -1, time.monotonic()
  supervisor, keeper, restarter = run.supervisor, run.keeper, run.restarter
  lock_step = settings.sync is not None and settings.sync.lock_step
  while not all(l.finished_training.is_set() for l in learners) or (
      supervisor is not None and supervisor.pending) or (keeper is not None and keeper.down) or (
      restarter is not None and restarter.pending):
    time.sleep(0.05)
    if stop.signum is not None:
      return
    if restarter is not None:
      restarter.tick()
    if keeper is not None:
      keeper.tick()
      run.syncer = syncer = keeper.syncer
    if run.corrupter is not None:
      run.corrupter.tick()
    if keeper is None or not (keeper.down or syncer.process_died):
      _check_syncer(syncer)  # (a syncer process that died is the keeper's to restore)
    _check_supervisor(supervisor)
    steps = sum(l.steps_made for l in learners)
    if steps != last_steps:
      last_steps, last_change = steps, time.monotonic()
    elif supervisor is not None and supervisor.pending and not any(l.alive for l in learners):
      last_change = time.monotonic()  # every learner is down, waiting for a repair: no stall
    elif lock_step and supervisor is not None and supervisor.repairing:
      last_change = time.monotonic()  # the barrier waits for a learner being repaired: no stall
    elif restarter is not None and restarter.pending:
      last_change = time.monotonic()  # the dp job is down, waiting for its repair: no stall
    elif time.monotonic() - last_change > stall_timeout:
      raise RuntimeError(
          f"no learner made a step for {stall_timeout} s (config.stall_timeout_s); learner "
          f"steps {[l.step for l in learners]}")
    clock = max(l.step for l in learners)
    if bar is not None:
      bar.show(clock)
    if clock < settings.num_steps:
      if progress and clock >= next_log:
        _log_progress(run, clock, evals)
        next_log += settings.log_every
      if next_eval is not None and clock >= next_eval:
        evals.append(evaluate(run, clock))
        next_eval += settings.eval_every
    else:
      # The fastest learner is done and others still train (a straggler, a learner that rejoined
      # behind): progress lines and evaluations go on by the step of the slowest one still
      # training, on the same boundaries, instead of stopping until the run ends.
      training = [l.step for l in learners if not l.finished_training.is_set()]
      tail = min(training) if training else settings.num_steps
      if tail_log is None:
        tail_log = (tail // settings.log_every + 1) * settings.log_every
        tail_eval = ((tail // settings.eval_every + 1) * settings.eval_every
                     if settings.eval_every else None)
      if progress and tail >= tail_log and tail < settings.num_steps:
        _log_progress(run, clock, evals)
        tail_log = (tail // settings.log_every + 1) * settings.log_every
      if tail_eval is not None and tail >= tail_eval and tail < settings.num_steps:
        evals.append(evaluate(run, clock))
        tail_eval = (tail // settings.eval_every + 1) * settings.eval_every
    saver.tick(clock)
  if progress:  # the last step's line: a run shorter than config.log_every has one too
    _log_progress(run, max(l.step for l in learners), evals)


def _check_supervisor(supervisor: supervisor_lib.Supervisor | None) -> None:
  if supervisor is not None and supervisor.error is not None:
    raise RuntimeError(f"restarting a failed learner failed: {supervisor.error!r}"
                       ) from supervisor.error


def _check_syncer(syncer: syncer_lib.Syncer | None) -> None:
  if syncer is not None and syncer.error is not None:
    raise RuntimeError(f"the syncer failed: {syncer.error!r}") from syncer.error


def _shut_down(run: run_lib.Run) -> None:
  """Stops every thread of a failed or interrupted run and closes its files."""
  if run.injector is not None:
    run.injector.stop()
  if run.supervisor is not None:
    run.supervisor.halt()
  for learner in run.learners:
    learner.stop()
  if run.syncer is not None:
    run.syncer.stop()
  for learner in run.learners:
    learner.join(timeout=30)
  if run.syncer is not None:
    run.syncer.join(timeout=30)
  if run.transport is not None:
    run.transport.shut_down(run.learners, run.syncer)
  run.metrics.close()


def evaluate(run: run_lib.Run, clock: int, final: bool = False) -> dict[str, Any]:
  started, started_at = time.perf_counter(), time.monotonic()
  params = run_lib.global_params(run)
  loss = run.evaluator(params)
  bpb = _bits_per_byte(run, loss)
  run.eval_windows.append((started_at, time.monotonic()))
  # at_s: when the evaluated Theta was read, in seconds since this process's training started
  # (time-to-loss figures; a resumed run counts from its own start).
  # step: the fastest learner's; slowest_step: the slowest learner's (they differ by a straggler's
  # lag, and after the fastest learner is done, `step` stays at num_steps while the others train).
  record = {"step": clock, "slowest_step": min(l.step for l in run.learners),
            "eval_loss": loss, "eval_bits_per_byte": bpb, "final": final,
            "seconds": time.perf_counter() - started,
            "at_s": started_at - run.started_at if run.started_at is not None else 0.0}
  if run.validator is not None:
    record["validation_loss"] = run.validator(params)
  run.metrics.write("eval", record, step=clock,
                    scalars={"eval/loss": loss, "eval/bits_per_byte": bpb})
  logging.info("eval at step %d: global model %.4f nats/token, %.4f bits/byte%s", clock, loss,
               bpb, " (final)" if final else "")
  return record


def _bits_per_byte(run: run_lib.Run, loss: float) -> float:
  """Nats per eval token as bits per byte of the text those tokens cover: comparable across
  tokenizers (for bytes it is loss / ln 2)."""
  info = run.data_info
  return float(loss * info["eval_tokens"] / (max(info["eval_bytes"], 1) * np.log(2)))


def _log_progress(run: run_lib.Run, clock: int, evals: list[dict[str, Any]]) -> None:
  losses = " ".join(f"{l.losses[-1]:.3f}" if l.losses else "-" for l in run.learners)
  settings = run.settings
  rates = " ".join(
      f"{settings.tokens_per_step(l.index) / np.mean(l.step_times[-settings.log_every:]) / 1e3:.1f}k"
      if l.step_times else "-" for l in run.learners)
  line = f"step {clock}/{settings.num_steps} | loss {losses} | tokens/s {rates}"
  if clock >= settings.num_steps:
    training = [l for l in run.learners if not l.finished_training.is_set()]
    if training:  # the fastest is done: who the run still waits for
      line += " | still training: " + ", ".join(
          f"learner {l.index} at step {l.step}" for l in training)
  recent = summary_lib.throughput(run, run.learners, last=settings.log_every)
  if recent.tokens_per_s_per_device is not None:
    line += f" | tok/s/dev {recent.tokens_per_s_per_device:,.0f}"
  if recent.mfu is not None:
    line += f" | mfu {100 * recent.mfu:.1f}%"
  if run.syncer is not None:
    stats = run.syncer.stats
    line += (f" | merges {stats.merges} | MB to/from syncer "
             f"{(stats.bytes_up + stats.bytes_down) / 1e6:.2f}")
  if evals:
    line += f" | eval {evals[-1]['eval_loss']:.3f}"
  logging.info(line)
