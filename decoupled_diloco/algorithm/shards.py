"""The fragments divided among the syncer's shards, balanced by bytes (docs/design.md §2).

The paper's syncer is "a central, CPU-only process, sharded M ways": each shard owns some of the P
fragments, and with them their Theta_p, outer states, rounds, merges and checkpoint. A merge of
fragment p reads and writes only fragment p's buffers, so the shards never exchange anything; what
a shard costs is the bytes of the fragments it owns, every merge of each touching all of them once
per period H. The fragments are therefore packed by their byte size, as the fragments themselves
pack tensors (`fragments.py`): greedy largest-first into the shard with the fewest bytes so far
(Graham's LPT rule), ties to the shard with fewer fragments, then to the lower index. Its heaviest
shard is at most total/S + (1 - 1/S) x the largest fragment, and at most 4/3 - 1/(3S) times the
best possible heaviest shard; with S <= P every shard owns at least one fragment.

Pure: the owner of each fragment, from the fragments' byte sizes alone.
"""

from __future__ import annotations

from collections.abc import Sequence

FIELD = "config.syncer.num_shards"


def assign(fragment_nbytes: Sequence[int], num_shards: int) -> tuple[int, ...]:
  """owner[p]: the shard that owns fragment p, for fragments of `fragment_nbytes[p]` bytes.

  Deterministic: the same sizes give the same owners in every process of a run (each Ray shard
  process and the command compute it alone). One shard owns everything.
  """
  num_fragments = len(fragment_nbytes)
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"{FIELD}={num_shards!r} must be an integer >= 1")
  if num_shards > num_fragments:
    raise ValueError(f"{FIELD}={num_shards} must be at most config.sync.num_fragments="
                     f"{num_fragments}: each shard owns at least one fragment")
  if any(n < 0 for n in fragment_nbytes):
    raise ValueError(f"fragment sizes must be >= 0 bytes, got {list(fragment_nbytes)}")
  loads = [0] * num_shards
  counts = [0] * num_shards
  owner = [0] * num_fragments
  # Largest first; equal sizes in fragment order, so the result does not depend on a sort's whims.
  for p in sorted(range(num_fragments), key=lambda p: (-fragment_nbytes[p], p)):
    shard = min(range(num_shards), key=lambda s: (loads[s], counts[s], s))
    owner[p] = shard
    loads[shard] += fragment_nbytes[p]
    counts[shard] += 1
  return tuple(owner)


def owned(owner: Sequence[int], shard: int) -> tuple[int, ...]:
  """The fragments `shard` owns, in fragment order."""
  return tuple(p for p, s in enumerate(owner) if s == shard)


def loads(owner: Sequence[int], fragment_nbytes: Sequence[int], num_shards: int) -> list[int]:
  """Bytes of the fragments each shard owns."""
  totals = [0] * num_shards
  for p, shard in enumerate(owner):
    totals[shard] += fragment_nbytes[p]
  return totals
