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


def test_unmerged_steps_are_counted_per_learner_over_its_worst_fragment():
  records = [_merge(0, 1, (0, 0, 10), (1, 0, 7)), _merge(1, 1, (0, 0, 8))]
  # Learner 0: fragment 0 up to 10, fragment 1 up to 8 -> 2 left; learner 1: nothing in fragment 1.
  assert tape.unmerged_steps_at_end(records, [10, 9], num_fragments=2) == [2, 9]
  assert tape.unmerged_steps_at_end(records + [_merge(1, 2, (0, 8, 10), (1, 0, 9)),
                                               _merge(0, 2, (1, 7, 9))],
                                    [10, 9], num_fragments=2) == [0, 0]
