"""The merge-tape audits on hand-written tapes."""

from decoupled_diloco.algorithm import tape


def _merge(fragment, version, *offers):
  """offers: (learner, since, step)."""
  return {"fragment": fragment, "version": version, "learners": [o[0] for o in offers],
          "since_steps": [o[1] for o in offers], "learner_steps": [o[2] for o in offers]}


def test_disjoint_offers_are_not_double_merges():
  records = [_merge(0, 1, (0, 0, 4), (1, 0, 3)), _merge(0, 2, (0, 4, 8)), _merge(1, 1, (0, 0, 6))]
  assert tape.double_merged_offers(records) == 0


def test_an_offer_starting_before_the_last_merged_step_is_a_double_merge():
  # Learner 0's steps (0, 4] merged in version 1; version 2 takes (0, 6]: steps 1-4 again.
  records = [_merge(0, 1, (0, 0, 4)), _merge(0, 2, (0, 0, 6), (1, 0, 6))]
  assert tape.double_merged_offers(records) == 1
  # The same steps in another fragment are not a double merge.
  assert tape.double_merged_offers([_merge(0, 1, (0, 0, 4)), _merge(1, 1, (0, 0, 6))]) == 0


def test_a_merge_a_syncer_crash_took_down_is_lost_not_merged():
  """A syncer process killed after a merge went on its tape and before its broadcasts left: the
  restarted syncer restores fragment 1 at version 0 (no learner holds version 1), and the same
  steps are merged again. Marked lost, that is neither a double merge nor merged tokens."""
  records = [_merge(0, 1, (0, 0, 2)), _merge(1, 1, (0, 0, 3), (1, 0, 2))]
  for r in records:
    r["tokens"] = [128 * (step - since) for since, step in zip(r["since_steps"],
                                                                r["learner_steps"])]
  assert tape.lost_merges(records, [1, 0]) == [1]  # fragment 0's version 1 reached the learners
  records[1]["lost"] = True
  assert tape.lost_merges(records, [1, 0]) == []  # a later restart does not count it again
  records.append(_merge(1, 1, (0, 0, 13)))  # the restarted syncer's own version 1
  records[-1]["tokens"] = [13 * 128]
  assert tape.double_merged_offers(records) == 0
  assert [r["version"] for r in tape.installed(records)] == [1, 1]
  assert tape.unmerged_steps_at_end(records, [13, 2], num_fragments=2) == [11, 2]
  # Learner 1 failed holding fragment 1 at version 0: its offer in the lost merge never reached
  # Theta, so its tokens are lost with it, not merged.
  assert tape.merged_after_failure(records, 1, 0, [1, 0]) == 0
  # Had it applied the lost merge (fragment 1 at version 1) before failing, its counters would no
  # longer hold that offer's tokens: they are lost with the syncer's crash and its failure.
  assert tape.applied_then_lost(records, 1, 0, [1, 0]) == 0
  assert tape.applied_then_lost(records, 1, 0, [1, 1]) == 256
  assert tape.applied_then_lost(records, 0, 0, [1, 1]) == 3 * 128  # learner 0's offer in it
  del records[1]["lost"]
  assert tape.double_merged_offers(records) == 1 and tape.merged_after_failure(
      records, 1, 0, [1, 0]) == 256
  assert tape.applied_then_lost(records, 1, 0, [1, 1]) == 0  # not lost: merged


def test_unmerged_steps_are_counted_per_learner_over_its_worst_fragment():
  records = [_merge(0, 1, (0, 0, 10), (1, 0, 7)), _merge(1, 1, (0, 0, 8))]
  # Learner 0: fragment 0 up to 10, fragment 1 up to 8 -> 2 left; learner 1: nothing in fragment 1.
  assert tape.unmerged_steps_at_end(records, [10, 9], num_fragments=2) == [2, 9]
  assert tape.unmerged_steps_at_end(records + [_merge(1, 2, (0, 8, 10), (1, 0, 9)),
                                               _merge(0, 2, (1, 7, 9))],
                                    [10, 9], num_fragments=2) == [0, 0]
