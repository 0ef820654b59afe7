"""scripts/bench_one_device.py's comparison of learners sharing a device with learners on their own
(--compare_own_devices, issue 44): the mode's config, the tape's discard figures, the comparison."""

import json

from tests.conftest import load_script

bench = load_script("bench_one_device")


def test_own_devices_is_the_decoupled_run_with_a_device_per_learner():
  assert bench.mode_overrides("dp", "cpu") == {"mode": "dp"}
  assert bench.mode_overrides("decoupled", "cpu") == {"mode": "decoupled"}
  assert bench.mode_overrides(bench.OWN_DEVICES, "cpu") == {
      "mode": "decoupled", "devices.learners_sharing_devices": 1,
      "devices.num_fake_cpu_devices": 5}
  assert "devices.num_fake_cpu_devices" not in bench.mode_overrides(bench.OWN_DEVICES, "gpu")


def test_the_rounds_figures_come_from_the_tape_and_the_merge_records(tmp_path):
  events = [{"kind": "take", "step": 10, "batches": 12},
            {"kind": "take", "step": 11, "batches": 12},
            {"kind": "apply", "step": 13, "merged": 10},
            {"kind": "apply", "step": 13, "merged": 11},
            {"kind": "apply", "step": 14, "merged": None},  # a merge without this learner
            {"kind": "merge", "fragment": 0}]
  (tmp_path / "tape.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  merge = {"kind": "merge", "final": False, "copy_s": 0.01, "grace_window_s": 0.0, "queue_s": 0.2,
           "sync_s": 0.3, "learners": [0, 1]}
  final = {**merge, "final": True, "queue_s": 9.0, "learners": [0, 1, 2, 3]}
  later = {**merge, "queue_s": 0.4, "learners": [0, 1, 2, 3]}
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in (merge, {"kind": "learner"}, later, final)))
  figures = bench.round_figures(str(tmp_path))
  assert figures["steps_dropped_per_apply"] == 2.5 and figures["batches_ahead_of_offer"] == 1.5
  assert round(figures["median_queue_s"], 6) == 0.3  # the flush's rounds left out
  assert figures["median_grace_window_s"] == 0.0 and figures["learners_per_merge"] == 3.0
  assert bench.round_figures(str(tmp_path / "dp")) == {}


def test_sharing_is_compared_with_own_devices_and_with_dp():
  sharing = {"goodput": 0.84, "tokens_per_s": 1000.0, "final_eval_loss": 2.2, "evals": [[10, 2.2]]}
  own = {"goodput": 0.45, "tokens_per_s": 1250.0}
  dp = {"tokens_per_s": 2000.0, "final_eval_loss": 2.0, "evals": [[10, 2.0]]}
  both = bench.compare({"decoupled": sharing, bench.OWN_DEVICES: own})
  assert round(both["goodput_sharing_minus_own_devices"], 6) == 0.39
  assert both["tokens_per_s_sharing_over_own_devices"] == 0.8
  assert "tokens_per_s_decoupled_over_dp" not in both
  three = bench.compare({"decoupled": sharing, bench.OWN_DEVICES: own, "dp": dp})
  assert three["tokens_per_s_decoupled_over_dp"] == 0.5
  assert three["eval_loss_at_equal_tokens"] == [[10, 2.2, 2.0]]
  assert bench.compare({"dp": dp}) == {}
