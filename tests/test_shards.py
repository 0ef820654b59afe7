"""Tests for algorithm.shards: the fragments divided among the syncer's shards, balanced by bytes
(docs/design.md §2: the syncer is sharded, each shard owning some fragments)."""

import itertools

import numpy as np
import pytest

from decoupled_diloco.algorithm import shards


def test_one_shard_owns_every_fragment():
  assert shards.assign([5, 1, 9, 3], 1) == (0, 0, 0, 0)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_every_fragment_has_one_owner_and_every_shard_owns_one(num_shards):
  sizes = [int(n) for n in np.random.default_rng(num_shards).integers(1, 1000, 24)]
  owner = shards.assign(sizes, num_shards)
  assert len(owner) == 24 and set(owner) == set(range(num_shards))
  assert sorted(p for s in range(num_shards) for p in shards.owned(owner, s)) == list(range(24))
  assert sum(shards.loads(owner, sizes, num_shards)) == sum(sizes)


def test_the_heaviest_shard_is_within_lpt_s_bound_of_the_ideal_and_of_the_best():
  rng = np.random.default_rng(0)
  for _ in range(50):
    sizes = [int(n) for n in rng.integers(1, 100, int(rng.integers(4, 9)))]
    num_shards = int(rng.integers(2, 4))
    peak = max(shards.loads(shards.assign(sizes, num_shards), sizes, num_shards))
    assert peak <= sum(sizes) / num_shards + (1 - 1 / num_shards) * max(sizes)
    best = min(max(shards.loads(o, sizes, num_shards))
               for o in itertools.product(range(num_shards), repeat=len(sizes)))
    assert peak <= (4 / 3 - 1 / (3 * num_shards)) * best + 1e-9


def test_largest_first_into_the_lightest_shard():
  # By size: 8 -> shard 0; 5 -> 1; 4 -> 1 (5 < 8, now 9); 3 -> 0 (8 < 9, now 11); 1 -> 1 (9 < 11).
  assert shards.assign([3, 8, 1, 5, 4], 2) == (0, 0, 1, 1, 1)
  # Equal sizes alternate in fragment order: the same owners in every process of a run.
  assert shards.assign([2, 2, 2, 2], 2) == (0, 1, 0, 1)


@pytest.mark.parametrize("num_shards,needle", [
    (0, "config.syncer.num_shards=0 must be an integer >= 1"),
    (True, "must be an integer >= 1"),
    (5, "config.syncer.num_shards=5 must be at most config.sync.num_fragments=4"),
])
def test_a_shard_count_no_split_can_serve_is_refused_naming_the_field(num_shards, needle):
  with pytest.raises(ValueError, match=needle):
    shards.assign([1, 2, 3, 4], num_shards)
