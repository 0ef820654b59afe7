"""The single-controller runtime end to end: learner threads on their own meshes plus the syncer.

Runs are tiny (a 2-layer, 32-wide model, 24 steps) so that each takes seconds on 2 cores.
"""

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from conftest import tiny_settings
from decoupled_diloco import settings
from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.core import learner as learner_lib

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(tmp_path, **overrides):
  run = train.build(tiny_settings(tmp_path, **overrides))
  summary = train.execute(run, progress=False)
  return run, summary


def test_decoupled_run_trains_merges_and_writes_its_summary(tmp_path):
  # 96 steps: enough for the global model to be clearly trained (it ends at 3.1-3.3 nats/byte
  # over repeated runs; 24 steps leave it near 4.0-4.4, too close to a threshold).
  run, summary = _run(tmp_path, syncer__num_devices=2, num_steps=96)
  assert summary["mode"] == "decoupled"
  assert summary["learner_steps"] == [96] * 4
  assert summary["tokens_trained"] == 4 * 96 * 4 * 32
  assert summary["learner_errors"] == [None] * 4
  # The global model learned: far under the uniform-byte loss ln(256) = 5.55 nats.
  assert summary["final_eval_loss"] < 4.0
  assert summary["merges"] == len(run.syncer.tape) > 0
  # Every fragment was merged at least once (the final flush guarantees it).
  assert {d["fragment"] for d in run.syncer.tape} == set(range(4))
  # Bytes up are exactly the bf16 outer gradients (2 bytes a value) of the learners that took part.
  expected_up = sum(2 * run.fragments[d["fragment"]].num_params * len(d["learners"])
                    for d in run.syncer.tape)
  assert summary["bytes_learner_to_syncer"] == expected_up
  assert sum(f.num_params for f in run.fragments) == summary["num_params"]
  # Two syncer shards: a ring all-reduce of every merge's terms (w*phi per value, w*|D|, w per
  # tensor, fp32) moves 2 * (2 - 1) * terms * 4 bytes.
  expected_allreduce = sum(
      2 * 4 * (run.fragments[d["fragment"]].num_params + 2 * len(run.fragments[d["fragment"]].names))
      for d in run.syncer.tape)
  assert summary["bytes_syncer_allreduce"] == expected_allreduce
  with open(os.path.join(tmp_path, "summary.json")) as f:
    on_disk = json.load(f)
  for key in ("mode", "num_learners", "tokens_trained", "final_eval_loss", "bytes_learner_syncer",
              "bytes_syncer_allreduce", "wall_seconds", "learner_steps", "merges"):
    assert key in on_disk
  # build_seconds split into its compiles: where the build time went.
  for key in ("init_compile_s", "train_compile_s", "eval_compile_s", "syncer_compile_s"):
    assert 0 < summary[key] < summary["build_seconds"], key
  assert summary["eval_seconds"] > 0 and summary["host_peak_rss_bytes"] > 0
  # The end of the run after the last step: the flush, then the rest (the final eval among it).
  assert 0 < summary["flush_seconds"] <= summary["end_seconds"] < summary["wall_seconds"]
  assert summary["end_seconds"] >= summary["eval_history"][-1]["seconds"]
  assert summary["unmerged_steps_at_end"] == [0] * 4 and summary["double_merged_offers"] == 0
  kinds = {json.loads(line)["kind"] for line in open(os.path.join(tmp_path, "metrics.jsonl"))}
  assert {"learner", "merge", "eval"} <= kinds
  assert os.listdir(os.path.join(tmp_path, "tb"))


def test_failed_learner_never_stops_the_others_or_the_syncer(tmp_path):
  def crash_learner_2(learner, step):
    if learner == 2 and step == 6:
      raise RuntimeError("injected crash")

  # No restart (config.max_restarts=0): the run goes on without it. tests/test_self_healing.py
  # covers the restart.
  run = train.build(tiny_settings(tmp_path, max_restarts=0), step_hook=crash_learner_2)
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"] == [24, 24, 6, 24]
  assert "injected crash" in summary["learner_errors"][2]
  assert [e is None for e in summary["learner_errors"]] == [True, True, False, True]
  late = [d for d in run.syncer.tape if min(d["learner_steps"]) > 10]
  assert late, "merges must go on after the crash"
  assert all(2 not in d["learners"] for d in late)
  assert np.isfinite(summary["final_eval_loss"])


def test_learner_never_waits_for_a_stalled_syncer(tmp_path):
  """The syncer's own thread is stuck after its first merge until every learner has made four
  more steps (a minute at most): learners that waited for it would never make them."""
  run = train.build(tiny_settings(tmp_path, learner_step_delays_s=(0.05,) * 4))
  finish_merge = run.syncer._finish_merge
  stepped_on = []

  def stuck_syncer(done):
    if not stepped_on:
      targets = [min(learner.step + 4, 24) for learner in run.learners]
      give_up_at = time.monotonic() + 60
      while (any(l.step < t for l, t in zip(run.learners, targets))
             and time.monotonic() < give_up_at):
        time.sleep(0.01)
      stepped_on.append(all(l.step >= t for l, t in zip(run.learners, targets)))
    finish_merge(done)

  run.syncer._finish_merge = stuck_syncer
  summary = train.execute(run, progress=False)
  assert stepped_on == [True]
  assert summary["learner_steps"] == [24] * 4


def test_diloco_mode_merges_every_learner_every_period_in_lock_step(tmp_path):
  run, summary = _run(tmp_path, mode="diloco")
  assert len(run.fragments) == 1
  assert summary["merges"] == 24 // 4
  for decision in run.syncer.tape:
    assert decision["learners"] == [0, 1, 2, 3]
    assert decision["steps"] == [4] * 4
  # After the last lock-step merge every learner holds exactly the global model.
  theta = run.syncer.global_params()
  for learner in run.learners:
    params = jax.device_get(learner.flat_params())
    for name, value in theta.items():
      np.testing.assert_allclose(params[name], value, rtol=0, atol=0)


def test_streaming_mode_waits_for_every_learner_with_fragments(tmp_path):
  run, summary = _run(tmp_path, mode="streaming")
  in_training = [d for d in run.syncer.tape if not d["final"]]
  assert len(in_training) == 24  # 4 fragments x 6 rounds in 24 steps
  assert all(d["learners"] == [0, 1, 2, 3] for d in in_training)
  # Every fragment's round starts on its staggered offset: step % H == p * H / P.
  assert all(d["learner_steps"] == [d["clock"]] * 4 and d["clock"] % 4 == d["fragment"]
             for d in in_training)


def test_full_quorum_admits_every_learner(tmp_path):
  run, summary = _run(tmp_path, sync__quorum=4)
  regular = [d for d in run.syncer.tape if not d["final"]]
  assert regular and all(d["learners"] == [0, 1, 2, 3] for d in regular)
  # The flush takes in every learner that still has steps to give, and leaves none behind.
  assert summary["unmerged_steps_at_end"] == [0] * 4


def test_dp_mode_is_one_learner_with_the_same_token_budget(tmp_path):
  _, summary = _run(tmp_path, mode="dp")
  assert summary["num_learners"] == 1 and summary["merges"] == 0
  assert summary["tokens_trained"] == 4 * 24 * 4 * 32
  assert summary["bytes_learner_syncer"] == 0
  assert summary["final_eval_loss"] < 4.5
  assert summary["flush_seconds"] == 0 < summary["end_seconds"]  # no syncer, nothing to flush


def test_syncer_anchor_int4_and_mixing_run(tmp_path):
  run, summary = _run(tmp_path, merge__anchor="syncer", merge__alpha=0.5,
                      compression__outer_grad="int4", compression__broadcast="bf16")
  assert summary["merges"] > 0 and np.isfinite(summary["final_eval_loss"])
  # int4 with one fp32 scale per 64 values is about 8x smaller than fp32.
  values = sum(f.num_params * len(d["learners"]) for d in run.syncer.tape
               for f in [run.fragments[d["fragment"]]])
  assert summary["bytes_learner_to_syncer"] < values * 4 / 6


def test_measured_bytes_per_step_match_the_bandwidth_model(tmp_path):
  """The runtime's byte counters agree with sim.bandwidth for the same model and settings.

  With P = H one fragment is synced per inner step, so each round's bytes per learner are what the
  model charges a learner for one inner step of a model the size of that fragment.
  """
  from decoupled_diloco.sim import bandwidth  # pylint: disable=g-import-not-at-top
  # Steps slowed to ~0.1 s so that most rounds complete before their fragment falls due again.
  run, _ = _run(tmp_path, sync__quorum=4, compression__outer_grad="int4",
                compression__broadcast="bf16", learner_step_delays_s=(0.1,) * 4)
  rounds = [d for d in run.syncer.tape if len(d["learners"]) == 4]
  assert len(rounds) >= 8
  for d in rounds:
    fragment = run.fragments[d["fragment"]]
    measured = (d["bytes_up"] + d["bytes_down"]) / 4
    model = bandwidth.bytes_per_inner_step(fragment.num_params, 1, "int4", "bf16", 64)
    assert measured == pytest.approx(model, rel=0.05), (d, fragment)


def test_learner_restarted_from_its_snapshot_matches_an_uninterrupted_one(tmp_path):
  """Stop a learner mid-run, restart a new one from its snapshot (train state, data position,
  counters): it ends exactly where an uninterrupted learner ends."""

  reference = train.build(tiny_settings(tmp_path / "reference", mode="dp"))
  train.execute(reference, progress=False)

  stopped = train.build(tiny_settings(tmp_path / "stopped", mode="dp"))
  first = stopped.learners[0]
  first._step_hook = lambda _, step: first.stop() if step == 9 else None
  first.start()
  first.join()
  snapshot = first.snapshot()
  assert snapshot.step == first.step == 10

  fresh = train.build(tiny_settings(tmp_path / "fresh", mode="dp")).learners[0]
  resumed = learner_lib.Learner(
      0, train_step=fresh._train_step, state=fresh._state, param_shardings=fresh._shardings,
      batches=fresh._batches, fragments=(), options=fresh._options, snapshot=snapshot)
  assert resumed.step == 10
  resumed.start()
  resumed.finished_training.wait(60)
  resumed.release()
  resumed.join()
  assert resumed.step == 24
  want = jax.device_get(reference.learners[0].params())
  got = jax.device_get(resumed.params())
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)


# ---- the rounds around the merge -----------------------------------------------------------------

# The outer step that is the identity: Theta_p <- the learner's fragment as the merge saw it
# (A - (A - theta) in float32). With one learner there is no asynchrony between learners, and the
# learner's rebase keeps its own values exactly (algorithm/receive.py), so decoupled makes dp's
# steps bit for bit: the same loss at every step. The final eval is Theta's, which differs from the
# learner's values by an ulp where a weight came near zero.
_IDENTITY = dict(outer__name="sgd", outer__learning_rate=1.0, outer__momentum=0.0,
                 merge__keep_in_flight_progress=True, compression__outer_grad="fp32",
                 compression__broadcast="fp32")
_ONE_LEARNER = dict(num_learners=1, learner_mesh_shapes=((2, 1),), num_steps=48)


@pytest.mark.parametrize("merge_delay_s, scan_layers, donate",
                         [(0.0, False, "auto"), (0.03, True, "auto"), (0.0, False, "always")])
def test_identity_outer_step_with_one_learner_tracks_dp_under_a_busy_syncer(tmp_path,
                                                                            merge_delay_s,
                                                                            scan_layers, donate):
  """P = H = 2 and tau = 1: a fragment falls due every step and comes back about
  when it falls due again, so pulls and broadcasts of the same fragment meet all the time; with
  merge_delay_s every merge also comes back late while the learner runs ahead. No step may be lost
  or merged twice, so the final loss equals dp's. With stacked layers the learner reads and writes
  its fragments as slices of the stacked tensors. With the state donated, as on an accelerator,
  pulls read the copies made before each step overwrites the state (runtime/core/learner.py)."""
  layout = {"model__scan_layers": scan_layers, "donate_state": donate}
  dp_run, dp = _run(tmp_path / "dp", mode="dp", **_ONE_LEARNER, **layout)
  # 10 ms steps: a merge (~10 ms here) comes back about one step after its round opened.
  run = train.build(tiny_settings(tmp_path / "decoupled", sync__num_fragments=2, sync__period=2,
                                  sync__overlap=1, learner_step_delays_s=(0.01,), **_IDENTITY,
                                  **_ONE_LEARNER, **layout))
  assert run.settings.donates_state == (donate == "always")
  if merge_delay_s:
    compute = run.syncer._compute_merge

    def late_merge(p, offers):
      time.sleep(merge_delay_s)
      return compute(p, offers)

    run.syncer._compute_merge = late_merge
  decoupled = train.execute(run, progress=False)
  # A fragment fell due at (nearly) every step, and merges ran while the learner trained. How
  # many ran depends on the machine's load: dues that meet a merge in flight coalesce.
  assert decoupled["merges_due"] >= 20
  assert decoupled["merges_before_flush"] >= 2, decoupled["merges"]
  assert decoupled["double_merged_offers"] == 0
  assert decoupled["unmerged_steps_at_end"] == [0]
  # Every step's loss is dp's, bit for bit, however the merges fell.
  np.testing.assert_array_equal(run.learners[0].losses, dp_run.learners[0].losses)
  assert decoupled["final_eval_loss"] == pytest.approx(dp["final_eval_loss"], rel=1e-6)
  # After the flush the learner holds the global model.
  theta = run.syncer.global_params()
  learner = jax.device_get(run.learners[0].flat_params())
  for name, value in theta.items():
    np.testing.assert_allclose(learner[name], value, rtol=0, atol=0)


def test_identity_outer_step_with_one_learner_tracks_dp_under_a_lagging_syncer(tmp_path):
  """The lagging regime (issue 41): every merge holds the syncer's one worker for 3 learner steps
  (config.syncer.merge_delay_steps), so each reaches the learner more than 3 steps after the
  state it offered and, with a fragment due at every step, the merges fall behind and the dues
  coalesce. The lag is counted on the syncer's clock, not in seconds: the same on an idle and a
  loaded host. No step may be lost or merged twice, so the learner makes dp's steps: the same
  loss at every step, and the final eval loss within the identity's bound of 0.1%."""
  lag = 3
  dp_run, dp = _run(tmp_path / "dp", mode="dp", **_ONE_LEARNER)
  run, decoupled = _run(tmp_path / "decoupled", syncer__merge_delay_steps=lag, **_IDENTITY,
                        **_ONE_LEARNER)
  with open(tmp_path / "decoupled" / "tape.jsonl", encoding="utf-8") as f:
    applied = [e for e in map(json.loads, f) if e["kind"] == "apply"]
  # Steps the learner made on top of each merged offer before the merge reached it (the flush's
  # merges, after its last step, excepted).
  lags = [e["step"] - e["merged"] for e in applied if e["step"] < _ONE_LEARNER["num_steps"]]
  assert len(lags) >= 2 and min(lags) > lag, lags
  assert decoupled["due_while_in_flight"] > 0  # the syncer fell behind
  assert decoupled["double_merged_offers"] == 0
  assert decoupled["discarded_progress"] == [0.0]
  # dp's steps, bit for bit (a lost fragment-step would move the next losses far more).
  np.testing.assert_array_equal(run.learners[0].losses, dp_run.learners[0].losses)
  assert decoupled["final_eval_loss"] == pytest.approx(dp["final_eval_loss"], rel=1e-6)
  assert decoupled["unmerged_steps_at_end"] == [0]


def test_after_the_flush_every_learner_holds_the_global_model_and_no_step_is_left_out(tmp_path,
                                                                                   monkeypatch):
  """The flush merges every learner's last steps, whatever it last received,
  and every learner ends holding Theta (to float32 rounding: an offer anchored one version behind
  is rebased through Theta - A_now + A_offer, exact in reals, not in float32)."""
  deliver, after_training = learner_lib.Learner.deliver, []

  def counted(self, broadcast):
    if self.finished_training.is_set():
      after_training.append(broadcast.fragment)
    deliver(self, broadcast)

  monkeypatch.setattr(learner_lib.Learner, "deliver", counted)
  run, summary = _run(tmp_path, learner_step_delays_s=(0.0, 0.0, 0.02, 0.0))
  assert summary["rounds_without_quorum"] == 0
  assert summary["unmerged_steps_at_end"] == [0] * 4
  assert summary["double_merged_offers"] == 0
  # Merges reached learners that had finished: the flush's own, or, on a host slow enough that the
  # syncer's last rounds took the learners' final publications (the flush then merges nothing),
  # those rounds'.
  assert after_training, summary["final_merges"]
  _every_learner_holds_theta(run)


def _every_learner_holds_theta(run):
  theta = run.syncer.global_params()
  for learner in run.learners:
    params = jax.device_get(learner.flat_params())
    for name, value in theta.items():
      np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-6,
                                 err_msg=f"learner {learner.index} {name}")


def test_the_flush_returns_once_every_learner_applied_its_broadcasts_however_late_they_arrive(
    tmp_path, monkeypatch):
  """Over a network a broadcast is on its way when the syncer has sent it, not applied: the
  command's release of the learners can overtake it (seen on real sites, where the learner's link
  had been down). Here every broadcast to a learner that finished training arrives 0.4 s late; the
  flush still returns only once each learner holds the final Theta, so no learner ends with
  merged steps still in its counters (the token account counted them twice) or without Theta."""
  deliver = learner_lib.Learner.deliver
  delayed = []

  def late(self, broadcast):
    if self.finished_training.is_set():
      delayed.append((self.index, broadcast.fragment))
      threading.Timer(0.4, deliver, (self, broadcast)).start()
    else:
      deliver(self, broadcast)

  monkeypatch.setattr(learner_lib.Learner, "deliver", late)
  run, summary = _run(tmp_path, num_learners=2, num_steps=12, learner_mesh_shapes=((1, 1),))
  # Some broadcast reached a finished learner late: the flush's own (its final rounds merged the
  # steps after the last offers) or, on a host slow enough that the syncer's rounds took the
  # learners' last publications, those rounds' (the flush then has nothing left to merge: CI once
  # ended with final_merges 0). Either way the flush must wait for them.
  assert delayed, summary["final_merges"]
  assert summary["unmerged_steps_at_end"] == [0, 0]
  tokens = summary["fragment_token_accounting"]
  assert tokens["unmerged_at_end"] == 0, tokens
  assert tokens["made"] == tokens["merged"] + tokens["discarded"], tokens
  _every_learner_holds_theta(run)


def _sleeps(learner, noise_s, steps, delay_s=0.0):
  """The sleep after each of `learner`'s steps, drawn again from its seeded stream:
  `learner.step_times[j]` holds the one after step j + 1."""
  draws = np.random.default_rng((*learner._options.noise_seed, 0, 0)).random(steps)
  return delay_s + 2 * noise_s * draws


def test_step_noise_spreads_each_learners_step_times_by_its_own_draws(tmp_path):
  """config.learner_step_noise_s: every step sleeps U[0, 2 x noise) more, a stream per learner.
  Fitted within one run, so whatever the host's load: a learner's step times follow its own
  draws (a second more sleep, about a second more step) and none of another learner's."""
  # Draws of U[0, 0.2): big beside a loaded host's jitter (a step's own time varied by ~0.05 s
  # with both cores busy), so the own-draw correlation stands well clear of the chance ones
  # (about 0.2 with 22 steps); at U[0, 0.1) another learner's draws came out ahead once.
  noise, steps = 0.1, 24
  run, _ = _run(tmp_path, num_steps=steps, learner_step_noise_s=noise)
  sleeps = [_sleeps(learner, noise, steps) for learner in run.learners]
  for m, learner in enumerate(run.learners):
    times = np.asarray(learner.step_times[2:])
    own = sleeps[m][2:2 + len(times)]
    slope = np.polyfit(own, times, 1)[0]
    assert slope > 0.5, (m, slope, times)
    others = [abs(np.corrcoef(sleeps[k][2:2 + len(times)], times)[0, 1]) for k in range(4) if k != m]
    assert np.corrcoef(own, times)[0, 1] > max(others), (m, others)


# Two runs and a regression of step times on sleeps: 18-31 s, and its slope left the bounds once on
# a 2-core host at load 5 (0.48). test_step_noise_spreads_each_learners_step_times_by_its_own_draws
# keeps the default suite's check that the drawn sleeps reach the step times.
@pytest.mark.slow
def test_a_step_delay_shorter_than_the_step_still_slows_the_learner_by_the_delay(tmp_path):
  """learner_step_delays_s and learner_step_noise_s emulate slower hardware: a step takes its own
  time plus the sleep drawn for it, also when that is shorter than the step (slept while the step
  ran, it would hide behind it). One learner, one run: each step's sleep (its noise, from the
  learner's seeded stream) is regressed against its time, so the host's load, which a before /
  after pair of runs sees differently, cancels out. A first run sets the sleeps to at most a
  step."""
  # A step long on the devices (a wider model, a bigger batch) next to its host work.
  one = dict(num_steps=24, data__batch_size=64, model__embed_dim=128, model__mlp_dim=512,
             num_learners=1, learner_mesh_shapes=((2, 1),))
  quiet_run, _ = _run(tmp_path / "quiet", **one)
  noise = round(float(np.median(quiet_run.learners[0].step_times[2:])) / 2, 4)
  run, _ = _run(tmp_path / "slow", learner_step_delays_s=(noise / 4,), learner_step_noise_s=noise,
                **one)
  learner = run.learners[0]
  sleeps = _sleeps(learner, noise, one["num_steps"], delay_s=noise / 4)
  times = np.asarray(learner.step_times)
  slope = np.polyfit(sleeps[2:len(times)], times[2:], 1)[0]
  assert 0.7 < slope < 1.3, (slope, noise, times)


def test_learners_of_different_batch_sizes_train_count_and_weigh_their_own_tokens(tmp_path):
  """config.data.learner_batch_sizes: each learner steps on its own batch; the summary counts
  the tokens each one trained, and the merge weights (tokens^2 / steps) grow with the batch."""
  sizes = (2, 4, 4, 8)
  run, summary = _run(tmp_path, data__learner_batch_sizes=sizes)
  seq_len = run.settings.data.seq_len
  assert summary["tokens_trained"] == 24 * sum(sizes) * seq_len
  tokens = summary["fragment_token_accounting"]
  assert tokens["made"] == (
      24 * sum(sizes) * seq_len * len(run.fragments))
  assert tokens["made"] == (tokens["merged"] + tokens["discarded"] + tokens["lost_at_failures"]
                            + tokens["unmerged_at_end"])
  checked = 0
  for record in run.syncer.tape:
    for m, tokens, steps, weight in zip(record["learners"], record["tokens"], record["steps"],
                                        record["weights"]):
      if steps:
        assert tokens == steps * sizes[m] * seq_len, record
        assert weight == pytest.approx(tokens * tokens / steps)
        checked += 1
  assert checked >= 40


def test_a_validation_split_is_evaluated_beside_the_eval_split(tmp_path):
  """config.data.validation_fraction: every evaluation reports the global model on both."""
  _, summary = _run(tmp_path, data__validation_fraction=0.1, eval_every=12)
  # One evaluation once the clock passes 12 (the controller polls it: 12 or a step or two later),
  # one more if the slowest learner was still under 12 when the fastest finished (a loaded
  # machine: evaluations then follow the slowest one), and the final one.
  history = summary["eval_history"]
  steps = [e["step"] for e in history]
  assert 2 <= len(steps) <= 3 and 12 <= steps[0] < 24 and steps[-1] == 24, steps
  assert [e["final"] for e in history] == [False] * (len(steps) - 1) + [True]
  assert all(e["slowest_step"] >= 12 for e in history[1:-1]), history
  for e in summary["eval_history"]:
    # Another split of the same kind of text: the same model's loss on it differs a little (an
    # early model's can be above the uniform byte loss, ln 256 = 5.55, on both).
    assert np.isfinite(e["validation_loss"]) and e["validation_loss"] != e["eval_loss"]
    assert abs(e["validation_loss"] / e["eval_loss"] - 1) < 0.25, e
  assert summary["final_validation_loss"] == summary["eval_history"][-1]["validation_loss"]


def test_slow_learner_keeps_being_synced_after_the_fastest_ones_finish(tmp_path):
  """Fragments fall due on the clock of the fastest learner still training."""
  period = 4
  run, summary = _run(tmp_path, learner_step_delays_s=(0.0, 0.0, 0.0, 0.08))
  slow_steps = [step for d in run.syncer.tape if not d["final"]
                for learner, step in zip(d["learners"], d["learner_steps"]) if learner == 3]
  assert summary["learner_steps"] == [24] * 4
  # The fast learners finish while the slow one is far behind; it is still merged in regular
  # rounds up to its last period, with no gap longer than two periods.
  assert max(slow_steps) >= 24 - 2 * period
  gaps = np.diff(sorted(set([0] + slow_steps)))
  assert gaps.max() <= 2 * period, sorted(slow_steps)


def test_a_run_shorter_than_log_every_still_prints_its_last_step_line(tmp_path, caplog):
  run = train.build(tiny_settings(tmp_path, num_steps=4, log_every=25, eval_every=0))
  with caplog.at_level(logging.INFO, logger="absl"):
    train.execute(run, progress=True)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert len(lines) == 1 and lines[0].startswith("step 4/4 | loss "), lines


# Slow, so that the default suite stays under 10 min (7 s).
@pytest.mark.slow
def test_progress_lines_and_evaluations_go_on_while_a_straggler_trains_after_the_fastest_finish(
    tmp_path, caplog):
  """Once the fastest learners are done, the run is not silent until the straggler ends: progress
  lines and evaluations follow the slowest learner still training, on the same boundaries, and
  each evaluation names the slowest learner's step beside the fastest's."""
  run = train.build(tiny_settings(tmp_path, eval_every=4, log_every=4,
                                  learner_step_delays_s=(0.0, 0.0, 0.0, 0.25)))
  with caplog.at_level(logging.INFO, logger="absl"):
    summary = train.execute(run, progress=True)
  tail = [e for e in summary["eval_history"] if e["step"] == 24 and not e["final"]]
  assert tail and all(e["slowest_step"] < 24 for e in tail), summary["eval_history"]
  slowest = [e["slowest_step"] for e in summary["eval_history"]]
  assert slowest == sorted(slowest) and summary["eval_history"][-1]["slowest_step"] == 24
  waiting = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("step 24/24") and "still training: learner 3 at step"
             in r.getMessage()]
  assert waiting, [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def _broken_syncer_run(tmp_path, *, fail_in: str):
  """A run whose syncer fails on its 3rd merge ("training") or its first final merge ("flush")."""
  run = train.build(tiny_settings(tmp_path, learner_step_delays_s=(0.02,) * 4))
  syncer = run.syncer
  compute, calls = syncer._compute_merge, []

  def failing(p, offers):
    calls.append(p)
    in_flush = syncer._flush_state == "running"
    if (fail_in == "training" and len(calls) == 3) or (fail_in == "flush" and in_flush):
      raise ValueError("injected syncer failure")
    return compute(p, offers)

  syncer._compute_merge = failing
  return run


@pytest.mark.parametrize("fail_in", ["training", "flush"])
def test_a_syncer_failure_reaches_the_caller_and_stops_every_learner(tmp_path, fail_in):
  """In training and in the final flush (whose rounds are the only ones opened while the flush
  runs, whatever the machine's load)."""
  run = _broken_syncer_run(tmp_path / "run", fail_in=fail_in)
  with pytest.raises(RuntimeError, match="the syncer failed") as raised:
    train.execute(run, progress=False)
  assert "injected syncer failure" in repr(raised.value.__cause__)
  assert not os.path.exists(tmp_path / "run" / "summary.json")
  for learner in run.learners:
    assert not learner._thread.is_alive(), f"learner {learner.index} still runs"


def test_syncer_memory_is_theta_and_the_outer_state_whatever_the_number_of_steps(tmp_path):
  """Between rounds the syncer holds Theta and the outer momentum, 8 bytes per
  parameter, and nothing that grows with the steps."""
  held = []
  for num_steps in (48, 480):
    _, summary = _run(tmp_path / str(num_steps), **{**_ONE_LEARNER, "num_steps": num_steps})
    assert summary["syncer_held_bytes"] == summary["syncer_steady_state_bytes"]
    held.append(summary["syncer_held_bytes"])
    # Peak: plus at most one fragment's host copy per learner in each of a few open rounds.
    assert summary["syncer_peak_held_bytes"] <= held[-1] + 4 * summary["num_params"] * 4
  assert held[0] == held[1] == 8 * summary["num_params"] + 0  # Nesterov: one slot


def test_global_model_is_evaluated_on_a_learners_devices(tmp_path):
  """Never on the syncer's host CPU devices."""
  run = train.build(tiny_settings(tmp_path))
  evaluated_on = set(run.evaluator.mesh.devices.flat)
  assert evaluated_on == set(run.learners[0].mesh_devices)
  assert not evaluated_on & set(run.syncer.model.mesh.devices.flat)
  run.metrics.close()
  dp = train.build(tiny_settings(tmp_path / "dp", mode="dp"))
  assert dp.evaluator.mesh.devices.size == 8  # the whole dp learner mesh
  dp.metrics.close()


@pytest.mark.slow  # 25 s on CI: a throughput study, kept out of the default run
def test_merges_keep_up_with_one_learner(tmp_path):
  """Before the flush, at least 95% of the merges that fell due have happened.
  The default experiment's model and sync settings (P = H = 24, tau = 2), one learner."""
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
  config = tiny_cpu.get_config()
  config.update_from_flattened_dict({
      "workdir": str(tmp_path), "num_steps": 96, "eval_every": 0, "eval_batches": 1,
      "num_learners": 1, "devices.num_fake_cpu_devices": 12})
  summary = train.execute(train.build(settings.validate(config)), progress=False)
  assert summary["merges_due"] >= 96 - 2
  assert summary["merges_before_flush"] >= 0.95 * summary["merges_due"], (
      summary["merges_before_flush"], summary["merges_due"])


def test_pulls_are_answered_without_waiting_for_a_step_boundary(tmp_path):
  """A due fragment is taken from each learner's latest publication at once.
  With 0.1 s steps and every learner needed (K = 4), a pull served at the next step boundary would
  make the median quorum wait about half a step or more; here it is a small fraction of one, on
  this run's own step times (a loaded host stretches both)."""
  run, _ = _run(tmp_path, sync__quorum=4, learner_step_delays_s=(0.1,) * 4, num_steps=16)
  waits = [d["quorum_wait_s"] for d in run.syncer.tape if not d["final"]]
  step_s = np.median([t for learner in run.learners for t in learner.step_times])
  assert len(waits) >= 8
  assert np.median(waits) < 0.25 * step_s, (waits, step_s)


def test_a_run_whose_learners_all_hang_fails_after_the_stall_timeout(tmp_path):
  """execute() must not wait without bound while the learners train."""
  run = train.build(tiny_settings(tmp_path, stall_timeout_s=2.0))

  released = []

  def hang_at_step_5(learner, step):
    if step == 5:
      # Released when the run stops the learner (True), or after a minute (False).
      released.append(run.learners[learner]._stop.wait(60))

  for learner in run.learners:
    learner._step_hook = hang_at_step_5
  with pytest.raises(RuntimeError, match="config.stall_timeout_s"):
    train.execute(run, progress=False)
  # The run gave up and stopped every hung learner: none waited out its minute.
  assert released and all(released), released
  assert not any(learner._thread.is_alive() for learner in run.learners)


def _build_seconds_in_a_fresh_process(tmp_path, **overrides) -> float:
  """train.build's seconds in a new Python process: no compiled program of an earlier build (in
  memory or in the persistent cache) is reused, as for a user starting a run."""
  code = ("import sys, json; sys.path[:0] = ['tests', '.']; import conftest; "
          "from decoupled_diloco.runtime import train; "
          f"run = train.build(conftest.tiny_settings({str(tmp_path)!r}, **{overrides!r})); "
          "print(json.dumps(run.build_seconds))")
  out = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True,
                       check=True, timeout=600)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 34 s on CI: two fresh processes that compile 4 and 16 layers
def test_a_deep_stacked_model_builds_about_as_fast_as_a_shallow_one(tmp_path):
  """With stacked layers, 16 layers build in at most 1.5x the time of 4 (the
  unrolled default experiment: 2.6x). Each build runs in its own fresh process; two learners, so
  that the train steps' compile (what depth costs) outweighs the fixed costs (measured: stacked
  1.10x, unrolled 2.18x)."""
  seconds = {layers: _build_seconds_in_a_fresh_process(
      tmp_path / str(layers), model__num_layers=layers, model__scan_layers=True, num_learners=2)
             for layers in (4, 16)}
  assert seconds[16] <= 1.5 * seconds[4], seconds

def test_delta_broadcast_trains_sends_fewer_bytes_down_and_leaves_every_learner_on_r_p(tmp_path):
  """config.compression.broadcast_delta=int4: merges send Theta_p - R_p in int4 (keyframes to
  learners that do not hold R_p's version). Finished learners say which versions they hold, so
  the flush sends them deltas too: measured 3 keyframes in 32 merges and 0.16x the full
  broadcast's bytes down; 24 and 0.30x when only step reports said it."""
  _, full = _run(tmp_path / "full")
  run, summary = _run(tmp_path / "delta", compression__broadcast_delta="int4")
  assert summary["merges"] > 0 and summary["learner_errors"] == [None] * 4
  # Trained: under the uniform-byte loss ln(256) = 5.55 nats the untrained model starts at.
  assert np.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < 5.0
  assert summary["bytes_syncer_to_learners"] < 0.25 * full["bytes_syncer_to_learners"]
  assert run.syncer.stats.keyframes < summary["merges"] / 4
  print("bytes_syncer_to_learners: full", full["bytes_syncer_to_learners"], "int4 delta",
        summary["bytes_syncer_to_learners"], "keyframes", run.syncer.stats.keyframes,
        "merges", summary["merges"], full["merges"], "loss", summary["final_eval_loss"],
        full["final_eval_loss"])
  # Every learner ends holding R_p of the newest version, bit for bit.
  versions = np.asarray(run.syncer.model.versions)
  for learner in run.learners:
    np.testing.assert_array_equal(learner._anchor_versions, versions)
    for p in range(len(run.fragments)):
      for name, value in run.syncer.model.received_fragment(p).items():
        np.testing.assert_array_equal(learner._anchors[name], value, err_msg=name)
