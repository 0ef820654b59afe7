"""Tests of decoupled_diloco.lm.data: byte tokens, packed windows, learner shards, grain state."""

import math

import numpy as np
import pytest

from decoupled_diloco.lm import data

SEQ_LEN = 16
WINDOW = SEQ_LEN + 1


@pytest.fixture(scope="module")
def random_tokens() -> np.ndarray:
  # Random bytes make every 17-byte window unique, so a row identifies its window index.
  return np.random.default_rng(0).integers(0, 256, 203 * WINDOW + 5).astype(np.uint8)


def _window_index(tokens: np.ndarray) -> dict[bytes, int]:
  return {tokens[i * WINDOW:(i + 1) * WINDOW].tobytes(): i for i in range(len(tokens) // WINDOW)}


def _rows_to_windows(batch: dict[str, np.ndarray], index: dict[bytes, int]) -> list[int]:
  windows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1).astype(np.uint8)
  return [index[row.tobytes()] for row in windows]


def _loader(tokens, **overrides):
  kwargs = dict(seq_len=SEQ_LEN, batch_size=4, shard_index=0, num_shards=1, seed=0)
  kwargs.update(overrides)
  return data.make_train_loader(tokens, **kwargs)


def test_load_tokens_returns_the_file_bytes(tmp_path):
  path = tmp_path / "text.txt"
  path.write_bytes("héllo\n".encode())
  tokens = data.load_tokens(str(path))
  assert tokens.dtype == np.uint8
  assert tokens.tolist() == [104, 0xC3, 0xA9, 108, 108, 111, 10]


def test_missing_or_empty_file_errors_name_config_data_source(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"config\.data\.source="):
    data.load_tokens(str(tmp_path / "absent.txt"))
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ValueError, match=r"config\.data\.source=.*empty"):
    data.load_tokens(str(tmp_path / "empty.txt"))


def test_bundled_corpus_is_tiny_shakespeare():
  tokens = data.load_tokens(data.default_corpus_path())
  assert len(tokens) == 1_115_394
  assert tokens[:9].tobytes() == b"First Cit"


def test_split_holds_out_the_last_fraction():
  tokens = np.arange(100, dtype=np.uint8)
  train, evals = data.split_tokens(tokens, 0.1)
  assert train.tolist() == list(range(90)) and evals.tolist() == list(range(90, 100))


@pytest.mark.parametrize("fraction", [0.0, 0.6, -0.1])
def test_eval_fraction_outside_range_is_an_error(fraction):
  with pytest.raises(ValueError, match=r"config\.data\.eval_fraction="):
    data.split_tokens(np.zeros(100, np.uint8), fraction)


def test_windows_are_consecutive_file_bytes_with_targets_shifted_by_one():
  tokens = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
  source = data.PackedSequences(tokens, seq_len=4)
  assert len(source) == 26 // 5
  second = source[1]
  assert second["inputs"].dtype == np.int32 and second["inputs"].shape == (4,)
  assert bytes(second["inputs"].astype(np.uint8)) == b"fghi"
  assert bytes(second["targets"].astype(np.uint8)) == b"ghij"


def test_loader_batches_come_from_the_file(random_tokens):
  batch = next(iter(_loader(random_tokens)))
  assert batch["inputs"].shape == (4, SEQ_LEN) and batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  windows = _rows_to_windows(batch, _window_index(random_tokens))  # KeyError if not a window.
  assert len(set(windows)) == 4


def test_learner_shards_are_disjoint_and_cover_nearly_everything(random_tokens):
  index = _window_index(random_tokens)
  num_windows, num_shards = len(index), 3
  shards = []
  for shard in range(num_shards):
    loader = _loader(random_tokens, batch_size=1, shard_index=shard, num_shards=num_shards,
                     num_epochs=1)
    seen = [w for batch in loader for w in _rows_to_windows(batch, index)]
    assert len(seen) == len(set(seen)) == num_windows // num_shards
    shards.append(set(seen))
  for a in range(num_shards):
    for b in range(a + 1, num_shards):
      assert not shards[a] & shards[b]
  # drop_remainder=True loses at most num_shards - 1 windows.
  assert len(set().union(*shards)) >= num_windows - (num_shards - 1)


def test_same_seed_same_batches_other_seed_other_order(random_tokens):
  def first_batches(seed):
    iterator = iter(_loader(random_tokens, seed=seed))
    return np.stack([next(iterator)["inputs"] for _ in range(3)])

  np.testing.assert_array_equal(first_batches(7), first_batches(7))
  assert not np.array_equal(first_batches(7), first_batches(8))


def test_iterator_state_restores_the_next_batch_across_epochs(random_tokens):
  # 203 windows / 4 shards = 50 per shard = 12 batches of 4 per epoch: 14 batches crosses an epoch.
  loader = _loader(random_tokens, num_shards=4, shard_index=2, seed=3)
  iterator = iter(loader)
  for _ in range(14):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(2)]

  restored = iter(loader)
  restored.set_state(state)
  for batch in expected:
    got = next(restored)
    np.testing.assert_array_equal(got["inputs"], batch["inputs"])
    np.testing.assert_array_equal(got["targets"], batch["targets"])


@pytest.mark.parametrize("shard_index, old, new", [(0, 4, 2), (1, 4, 2), (3, 4, 8), (1, 2, 4)])
def test_a_position_moved_to_another_shard_count_keeps_the_windows_read(random_tokens, shard_index,
                                                                          old, new):
  """An elastic restore (runtime/records/elastic_restore.py): a learner that read k batches of shard i of
  `old` goes on with the batch a fresh loader of shard i of `new` gives after k batches."""
  before = iter(_loader(random_tokens, num_shards=old, shard_index=shard_index, seed=3))
  fresh = iter(_loader(random_tokens, num_shards=new, shard_index=shard_index, seed=3))
  for _ in range(5):
    next(before)
    next(fresh)
  moved = iter(_loader(random_tokens, num_shards=new, shard_index=shard_index, seed=3))
  moved.set_state(data.reshard_position(before.get_state(), shard_index=shard_index,
                                        old_num_shards=old, new_num_shards=new))
  np.testing.assert_array_equal(next(moved)["inputs"], next(fresh)["inputs"])


def test_eval_batches_are_fixed_and_drawn_from_the_held_out_tail(random_tokens):
  train, evals = data.split_tokens(random_tokens, 0.2)
  first = data.make_eval_batches(evals, seq_len=SEQ_LEN, batch_size=4, max_batches=3)
  again = data.make_eval_batches(evals, seq_len=SEQ_LEN, batch_size=4, max_batches=3)
  assert len(first) == 3
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  # In order: batch j, row r is window 4j + r of the eval split.
  eval_index, train_index = _window_index(evals), _window_index(train)
  assert [_rows_to_windows(b, eval_index) for b in first] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                              [8, 9, 10, 11]]
  rows = np.concatenate([first[0]["inputs"], first[0]["targets"][:, -1:]], 1).astype(np.uint8)
  assert not any(row.tobytes() in train_index for row in rows)
  # max_batches beyond the split yields only the full batches there are.
  assert len(data.make_eval_batches(evals, seq_len=SEQ_LEN, batch_size=4, max_batches=99)) == (
      len(evals) // WINDOW // 4)


@pytest.mark.parametrize("overrides, field", [
    (dict(seq_len=0), "seq_len"), (dict(batch_size=0), "batch_size"),
    (dict(batch_size=1000), "batch_size"), (dict(seq_len=10_000), "seq_len"),
])
def test_loader_errors_name_the_field(random_tokens, overrides, field):
  with pytest.raises(ValueError, match=rf"config\.data\.{field}="):
    _loader(random_tokens, **overrides)


def test_unigram_entropy_of_four_equally_frequent_bytes_is_log_four():
  assert data.unigram_entropy(np.frombuffer(b"abcd" * 50, np.uint8)) == pytest.approx(math.log(4))
  assert data.unigram_entropy(np.frombuffer(b"aaaa", np.uint8)) == 0.0


def test_bigram_entropy_uses_add_one_smoothing_over_256_bytes():
  train = np.frombuffer(b"ab" * 50, np.uint8)  # 50 "ab" pairs, 49 "ba" pairs.
  evals = np.frombuffer(b"aba", np.uint8)
  p_b_given_a = (50 + 1) / (50 + 256)
  p_a_given_b = (49 + 1) / (49 + 256)
  expected = -(math.log(p_b_given_a) + math.log(p_a_given_b)) / 2
  assert data.bigram_entropy(train, evals) == pytest.approx(expected)


def test_reference_entropies_of_the_bundled_corpus():
  tokens = data.load_tokens(data.default_corpus_path())
  train, evals = data.split_tokens(tokens, 0.1)
  unigram = data.unigram_entropy(tokens)
  bigram = data.bigram_entropy(train, evals)
  # English text: ~4.8 bits = ~3.31 nats per character; one byte of context saves ~0.8 nats.
  assert unigram == pytest.approx(3.31, abs=0.02)
  assert 2.40 < bigram < 2.60


def test_the_validation_split_is_carved_from_the_training_text_before_the_eval_tail(tmp_path):
  """config.data.validation_fraction: train, validation and eval are disjoint consecutive parts of
  the text, in that order; with 0 there is no validation split and train is as before."""
  from decoupled_diloco.lm import tokenizers  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / "corpus.txt"
  text = bytes(range(32, 127)) * 40
  corpus.write_bytes(text)
  tok = tokenizers.load("byte")
  load = lambda v: data.load_dataset(str(corpus), tokenizer=tok, text_field="text", seq_len=16,
                                     eval_fraction=0.1, validation_fraction=v)
  plain, split = load(0.0), load(0.2)
  assert plain.validation is None
  whole = np.frombuffer(text, np.uint8)
  train_all, evals = data.split_tokens(whole, 0.1)
  n_val = int(round(len(train_all) * 0.2))
  np.testing.assert_array_equal(split.train._tokens, train_all[:len(train_all) - n_val])
  np.testing.assert_array_equal(split.validation._tokens, train_all[len(train_all) - n_val:])
  np.testing.assert_array_equal(split.eval._tokens, evals)
  np.testing.assert_array_equal(plain.train._tokens, train_all)
