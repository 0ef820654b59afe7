"""The event tape and its replay: a recorded decoupled run replays bit for bit; a tape
with an offer taken out is caught at the right merge; a counterfactual replay under another merge
rule follows the same arrival pattern to other parameters."""

import json
import os

import pytest

from conftest import tiny_settings
from decoupled_diloco import command_line
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.records import event_tape
from decoupled_diloco.runtime.records import revision
from decoupled_diloco import replay_config
from decoupled_diloco.runtime import train
from experiments import tiny_cpu

# K = 1, the grace window on, learner 3 twice as slow as the others, learner 1 crashing before
# its step 10 and rejoining from a peer's state: a race worth replaying.
_RECORDED = dict(sync__quorum=1, sync__grace_gamma=0.5, sync__grace_cap_s=0.2,
                 learner_step_delays_s=(0.02, 0.02, 0.02, 0.04), num_steps=24)
_CRASH = "crash@learner=1,step=10,down_s=0.2"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("recorded")
  summary = train.execute(train.build(tiny_settings(workdir, chaos__schedule=_CRASH,
                                                    **_RECORDED)), progress=False)
  assert summary["rejoins"] == 1
  return str(workdir), summary


def _replay(workdir, recording, **overrides):
  # The replay takes its faults from the tape, not from config.chaos.
  settings = tiny_settings(workdir, replay=recording, **{**_RECORDED, **overrides})
  return train.replay(train.build(settings), progress=False)


def _read_tape(recording):
  with open(os.path.join(recording, "tape.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_the_tape_records_every_merge_take_and_apply_of_the_run(recorded):
  recording, summary = recorded
  records = _read_tape(recording)
  assert records[0]["kind"] == "config" and records[0]["config"]["sync.quorum"] == "1"
  merges = [r for r in records if r["kind"] == "merge" and r["version"] is not None]
  assert len(merges) == summary["merges"]
  takes = [r for r in records if r["kind"] == "take"]
  applies = [r for r in records if r["kind"] == "apply"]
  # Every offer a merge took was a take of that learner's, from that publication.
  taken = {(t["learner"], t["fragment"], t["step"], t["publication"]) for t in takes}
  for merge in merges:
    for m, _, step, publication in merge["offers"]:
      assert (m, merge["fragment"], step, publication) in taken
  # Each incarnation's events are numbered in the order its state changed.
  for m, incarnation in ((0, 0), (1, 0), (1, 1), (2, 0), (3, 0)):
    seqs = [r["seq"] for r in records if r["kind"] in ("take", "apply", "respawn")
            and r["learner"] == m and r["incarnation"] == incarnation]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs
  assert {a["learner"] for a in applies} == {0, 1, 2, 3}
  # The crash and the new incarnation: its respawn comes first among its events, naming the peer
  # publication it started from and the Theta versions it received.
  [respawn] = [r for r in records if r["kind"] == "respawn"]
  assert respawn["learner"] == 1 and respawn["incarnation"] == 1 and respawn["seq"] == 1
  assert respawn["failed_step"] == 10 and respawn["peer"] != 1
  assert len(respawn["versions"]) == 4 and respawn["peer_step"] >= 9
  assert {"fault", "rejoin"} <= {r["kind"] for r in records}


def test_a_recorded_run_replays_bit_for_bit(recorded, tmp_path):
  recording, summary = recorded
  replayed = _replay(tmp_path, recording)
  assert replayed["replay_exact"] and replayed["replay_changed_fields"] == []
  assert "learner_step_delays_s" not in replayed["replay_ignored_fields"]  # set alike
  assert replayed["merges"] == summary["merges"] and replayed["replay_respawns"] == 1
  assert replayed["params_sha256"] == summary["params_sha256"]
  assert replayed["params_equal_to_recording"]
  assert replayed["learner_params_sha256"] == summary["learner_params_sha256"]
  assert replayed["final_eval_loss"] == summary["final_eval_loss"]
  with open(os.path.join(tmp_path, "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["params_sha256"] == summary["params_sha256"]


def test_a_tape_with_one_participant_taken_out_is_caught_at_that_merge(recorded, tmp_path):
  recording, _ = recorded
  records = _read_tape(recording)
  # A merge in the middle of the run with two participants or more loses its last one.
  merges = [r for r in records if r["kind"] == "merge" and r["version"] and len(r["offers"]) >= 2]
  merge = merges[len(merges) // 2]
  for field in ("offers", "accepted", "offer_fingerprints", "anchor_versions"):
    merge[field] = merge[field][:-1]
  forged = tmp_path / "forged"
  forged.mkdir()
  with open(forged / "tape.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  with pytest.raises(event_tape.ReplayDiverged,
                     match=f"fragment {merge['fragment']} version {merge['version']}: "):
    _replay(tmp_path / "replay", str(forged))


def test_the_tape_names_the_revision_that_recorded_it():
  here = revision.current()
  assert here["version"] and set(here) == {"version", "commit", "dirty"}
  assert revision.same(dict(here, dirty=False), dict(here, dirty=False)) == (here["commit"] is not None)
  assert not revision.same(None, here) and not revision.same(dict(here, dirty=True), here)
  assert revision.describe({"version": "0.1.0", "commit": "1a2b3c4d5e6f7a8b", "dirty": True}) == (
      "0.1.0 at 1a2b3c4d5e6f (with uncommitted changes)")


def test_a_replay_diverging_on_another_revision_says_which_two_met(recorded, tmp_path):
  """A recording replays bit for bit on the revision that made it; on another one the first
  difference says so, in one line, with the two revisions."""
  recording, _ = recorded
  records = _read_tape(recording)
  assert records[0]["kind"] == "config" and records[0]["revision"] == event_tape.load(
      recording).revision == revision.current()
  records[0]["revision"] = {"version": "0.0.1", "commit": "0" * 40, "dirty": False}
  merge = [r for r in records if r["kind"] == "merge" and r["version"] and len(r["offers"]) >= 2][0]
  for field in ("offers", "accepted", "offer_fingerprints", "anchor_versions"):
    merge[field] = merge[field][:-1]  # what another revision's rounding would make of it
  older = tmp_path / "older"
  older.mkdir()
  with open(older / "tape.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  with pytest.raises(event_tape.ReplayDiverged) as err:
    _replay(tmp_path / "replay", str(older))
  message = str(err.value)
  assert message.startswith("the recording came from 0.0.1 at 000000000000 and this is "
                            f"{revision.describe(revision.current())}: a recording replays "
                            "exactly on the revision that made it; fragment "), message
  assert "\n" not in message


def test_a_counterfactual_replay_under_average_ends_with_other_parameters(recorded, tmp_path):
  recording, summary = recorded
  replayed = _replay(tmp_path, recording, merge__rule="average")
  assert not replayed["replay_exact"] and replayed["replay_changed_fields"] == ["merge.rule"]
  assert replayed["merges"] == summary["merges"]  # the same arrival pattern, merge for merge
  assert replayed["params_sha256"] != summary["params_sha256"]
  assert not replayed["params_equal_to_recording"]
  assert replayed["final_eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=0.2)


def test_a_counterfactual_replay_with_the_asynchrony_options_on_follows_the_same_pattern(
    recorded, tmp_path):
  recording, summary = recorded
  replayed = _replay(tmp_path, recording, outer__nesterov_delay=2,
                     outer__staleness_scaling="inverse")
  assert not replayed["replay_exact"]
  assert replayed["replay_changed_fields"] == ["outer.nesterov_delay", "outer.staleness_scaling"]
  assert replayed["merges"] == summary["merges"]
  assert replayed["params_sha256"] != summary["params_sha256"]


def test_a_recording_made_before_a_field_was_added_replays_exactly_at_its_old_value():
  now = {"outer.nesterov_delay": "0", "outer.staleness_scaling": "'none'", "merge.rule": "'rda'"}
  assert event_tape.changed_fields({"merge.rule": "'rda'"}, now)["counterfactual"] == []
  changed = event_tape.changed_fields({"merge.rule": "'rda'"},
                                      {**now, "outer.nesterov_delay": "4"})
  assert changed["counterfactual"] == ["outer.nesterov_delay"]


def test_a_replay_with_other_model_settings_is_refused_naming_the_field(recorded, tmp_path):
  recording, _ = recorded
  with pytest.raises(event_tape.TapeError,
                     match="config.model.mlp_dim=128 cannot change in a replay: the recording has 64"):
    _replay(tmp_path, recording, model__mlp_dim=128)
  # Refused before the run was built (nothing compiled, no metrics opened).
  assert not (tmp_path / "metrics.jsonl").exists()


def _command_line_replay(recording, *args):
  """What main does with `--config=experiments/tiny_cpu.py --config.replay=recording *args`: the
  experiment file's config, the command line's fields on top, the recording's for the rest."""
  argv = ["main", "--config=experiments/tiny_cpu.py", f"--config.replay={recording}", *args]
  config = tiny_cpu.get_config()
  config.replay = recording
  for arg in args:
    name, value = arg[len("--config."):].split("=", 1)
    config.update_from_flattened_dict({name: value if name in ("workdir", "merge.rule",
                                                               "compilation_cache_dir")
                                       else int(value)})
  given = command_line.override_names(argv)
  return settings_lib.validate(replay_config.with_recording(config, given))


def test_a_replay_given_only_the_recording_reruns_it_bit_for_bit(recorded, tmp_path):
  recording, summary = recorded
  # The session's compilation cache, not a cold one in the replay's workdir.
  settings = _command_line_replay(recording, f"--config.workdir={tmp_path}",
                                  "--config.compilation_cache_dir=none")
  assert settings.num_steps == 24 and settings.model.embed_dim == 32  # the recording's, not the file's
  replayed = train.replay(train.build(settings), progress=False)
  assert replayed["replay_exact"] and replayed["replay_counterfactual"] == []
  assert replayed["params_sha256"] == summary["params_sha256"]
  assert replayed["learner_params_sha256"] == summary["learner_params_sha256"]
  assert replayed["final_eval_loss"] == summary["final_eval_loss"]


def test_an_override_on_a_replay_is_a_counterfactual_listed_with_both_values(recorded, tmp_path):
  recording, summary = recorded
  settings = _command_line_replay(recording, f"--config.workdir={tmp_path}",
                                  "--config.compilation_cache_dir=none", "--config.merge.rule=average")
  replayed = train.replay(train.build(settings), progress=False)
  assert not replayed["replay_exact"]
  recorded_rule = event_tape.load(recording).config["merge.rule"]
  assert replayed["replay_counterfactual"] == [
      {"field": "merge.rule", "recorded": recorded_rule, "replayed": "'average'"}]
  assert replayed["merges"] == summary["merges"]
  with open(os.path.join(tmp_path, "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["replay_counterfactual"][0]["field"] == "merge.rule"


def test_an_override_a_replay_cannot_follow_is_refused_naming_the_field(recorded, tmp_path):
  recording, _ = recorded
  settings = _command_line_replay(recording, f"--config.workdir={tmp_path}",
                                  "--config.model.mlp_dim=128")
  with pytest.raises(event_tape.TapeError, match=r"^config.model.mlp_dim=128 cannot change in a "
                                                 r"replay: the recording has 64"):
    train.build(settings)
  assert not (tmp_path / "metrics.jsonl").exists()


def test_the_bundled_corpus_is_recorded_as_its_config_value_not_this_checkout_s_path(recorded):
  """A replay in another clone or revision reads its own copy of the bundled corpus: the tape
  names it '' (config.data.source's value for it), not the recording checkout's file."""
  recording, _ = recorded
  assert event_tape.load(recording).config["data.source"] == "''"


def test_a_replay_without_a_workdir_writes_next_to_the_recording(recorded):
  recording, _ = recorded
  settings = _command_line_replay(recording)
  assert settings.workdir == os.path.normpath(recording) + "_replay"
  # The replay's own fields keep the file's values: not the recording's checkpoints or faults.
  assert settings.checkpoint.dir.startswith(settings.workdir) and not settings.chaos.enabled


def test_replay_settings_are_validated(tmp_path):
  with pytest.raises(ValueError, match="config.replay=.*holds no tape.jsonl"):
    tiny_settings(tmp_path / "a", replay=str(tmp_path))
  (tmp_path / "rec").mkdir()
  (tmp_path / "rec" / "tape.jsonl").write_text("")
  with pytest.raises(ValueError, match="config.replay=.*decoupled runs only"):
    tiny_settings(tmp_path / "a", replay=str(tmp_path / "rec"), mode="dp")
  with pytest.raises(ValueError, match="config.replay=.*is config.workdir"):
    tiny_settings(tmp_path / "rec", replay=str(tmp_path / "rec"))


def test_a_syncer_restart_is_on_the_tape_and_its_replay_is_refused(tmp_path):
  recording = tmp_path / "faulty"
  train.execute(train.build(tiny_settings(
      recording, chaos__schedule="syncer_crash@second=1,down_s=0.2", checkpoint__every_steps=8,
      learner_step_delays_s=(0.05,) * 4)), progress=False)
  kinds = {r["kind"] for r in _read_tape(recording)}
  assert {"config", "take", "apply", "merge", "fault", "syncer_restart", "checkpoint"} <= kinds
  with pytest.raises(event_tape.TapeError,
                     match="faults a replay does not follow yet .*syncer_crash.*syncer_restart"):
    event_tape.load(str(recording))


def test_a_replay_on_other_batches_stops_naming_the_learner_and_its_steps(recorded, tmp_path):
  recording, _ = recorded
  records = _read_tape(recording)
  # As if learner 2 had read other data from its 6th batch on: its takes from then on name
  # other CRCs of its batches.
  for record in records:
    if record["kind"] == "take" and record["learner"] == 2 and record["batches"] >= 6:
      record["data_crc"] ^= 1
  first_bad = min(r["batches"] for r in records if r["kind"] == "take" and r["learner"] == 2
                  and r["batches"] >= 6)
  forged = tmp_path / "forged"
  forged.mkdir()
  with open(forged / "tape.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  with pytest.raises(event_tape.ReplayDiverged,
                     match=rf"learner 2 \(incarnation 0\): the batches it trained on differ .*"
                           rf"-{first_bad} \(steps .*-{first_bad};"):
    _replay(tmp_path / "replay", str(forged))


@pytest.mark.parametrize("schedule,absences,rejoins,delta", [
    # The syncer marks the hung learner absent; back, it is sent the newest merges.
    ("hang@learner=2,step=6,seconds=1.5", 1, 0, False),
    # Nothing reaches or leaves learner 1 for 1.5 s (merges and pulls lost); learner 3 crashes.
    # Theta goes out as int4 deltas against R_p: the lost broadcasts and the rejoin make the
    # syncer send keyframes to some learners and deltas to others, all on the tape.
    ("partition@learner=1,step=6,seconds=1.5;crash@learner=3,step=12,down_s=0.3", 1, 1, True),
    # Learner 2's state holds NaNs after its step 9: offered, rejected, and it fails and rejoins.
    ("nan@learner=2,step=8", 0, 1, False),
])
def test_hung_partitioned_crashed_and_nan_learners_replay_bit_for_bit(tmp_path, schedule, absences,
                                                                      rejoins, delta):
  recorded = dict(sync__quorum=1, learner_step_delays_s=(0.02,) * 4, num_steps=24,
                  sync__heartbeat_timeout_s=0.5)
  if delta:
    recorded["compression__broadcast_delta"] = "int4"
  summary = train.execute(train.build(tiny_settings(
      tmp_path / "a", chaos__schedule=schedule, **recorded)), progress=False)
  assert summary["heartbeat_absences"] >= absences and summary["rejoins"] == rejoins
  if delta:  # both kinds went out
    assert 0 < summary["broadcast_keyframes"] < summary["merges"] * 4, summary
  replayed = train.replay(train.build(tiny_settings(
      tmp_path / "b", replay=str(tmp_path / "a"), **recorded)), progress=False)
  assert replayed["params_equal_to_recording"] and replayed["replay_exact"]
  assert replayed["learner_params_sha256"] == summary["learner_params_sha256"]


def test_reading_a_tape_marks_the_merges_a_restarted_syncer_lost(tmp_path):
  """A syncer_restart record names the merges its predecessor took down with it: the reader marks
  the newest earlier merge of each (fragment, version) lost, not the one the restarted syncer
  makes again, nor an older one of the same version before an earlier restart."""
  records = [{"kind": "config"},
             {"kind": "merge", "fragment": 1, "version": 1},
             {"kind": "syncer_restart", "lost_merge_versions": [[1, 1]]},
             {"kind": "merge", "fragment": 0, "version": 1},
             {"kind": "merge", "fragment": 1, "version": 1},  # made again after the restart
             {"kind": "merge", "fragment": 0, "version": 2},
             # (1, 1) again: the merge made after the first restart, lost by the second one.
             {"kind": "syncer_restart", "lost_merge_versions": [[0, 2], [1, 1]]},
             {"kind": "merge", "fragment": 0, "version": 2},
             {"kind": "merge", "fragment": 0, "version": None, "final": True}]  # rejected round
  path = tmp_path / event_tape.TAPE_FILE
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  read = event_tape.read(str(path))
  assert [r.get("lost", False) for r in read] == [
      False, True, False, False, True, True, False, False, False]
  path.write_text(path.read_text() + '{"kind": "mer', encoding="utf-8")
  with pytest.raises(json.JSONDecodeError, match=r"line 10 of .* is not JSON"):
    event_tape.read(str(path))
