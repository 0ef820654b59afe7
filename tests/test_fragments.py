"""Tests for algorithm.fragments: the parameters split into P fragments (docs/design.md §2)."""

import itertools

import jax
import numpy as np
import pytest

from decoupled_diloco.algorithm import fragments as fr

F32 = np.float32
EMBEDDING = "embedder/embedding"


def _tensors(sizes: dict[str, int], dtype=F32) -> dict[str, jax.ShapeDtypeStruct]:
  return {name: jax.ShapeDtypeStruct((n,), dtype) for name, n in sizes.items()}


def _transformer(num_layers=12, d=512, vocab=32000, mlp=2048) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes of a small decoder-only transformer, as a flat dict of abstract arrays."""
  shapes = {EMBEDDING: (vocab, d), "final_norm/scale": (d,)}
  for i in range(num_layers):
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      shapes[f"layers/{i}/attn/{proj}/kernel"] = (d, d)
    shapes[f"layers/{i}/mlp/up/kernel"] = (d, mlp)
    shapes[f"layers/{i}/mlp/gate/kernel"] = (d, mlp)
    shapes[f"layers/{i}/mlp/down/kernel"] = (mlp, d)
    shapes[f"layers/{i}/attn_norm/scale"] = (d,)
    shapes[f"layers/{i}/mlp_norm/scale"] = (d,)
  return {name: jax.ShapeDtypeStruct(s, F32) for name, s in shapes.items()}


def _assert_exact_cover(params, fragments, num_fragments):
  assert [f.index for f in fragments] == list(range(num_fragments))
  names = [n for f in fragments for n in f.names]
  assert sorted(names) == sorted(params), "every parameter in exactly one fragment"
  for f in fragments:
    assert f.names, f"fragment {f.index} is empty"
    assert list(f.names) == sorted(f.names)
    assert f.nbytes == sum(fr.tensor_nbytes(params[n]) for n in f.names)


@pytest.mark.parametrize("method", fr.METHODS)
@pytest.mark.parametrize("num_fragments", [1, 2, 5, 12])
def test_every_parameter_is_in_exactly_one_fragment(method, num_fragments):
  params = _transformer()
  fragments = fr.partition(params, num_fragments, method, embedding_names=[EMBEDDING])
  _assert_exact_cover(params, fragments, num_fragments)
  owner = fr.fragment_of(fragments)
  assert set(owner) == set(params)
  for f in fragments:
    assert all(owner[n] == f.index for n in f.names)


def test_balanced_is_greedy_largest_first():
  # LPT on sizes 3,3,2,2,2 into 2 bins: 3->A, 3->B, 2->A (5), 2->B (5), 2->A (7). The optimum is
  # 6 (3+3 | 2+2+2): greedy is not optimal, but within its 4/3 guarantee (7 <= 8).
  params = _tensors({"a": 3, "b": 3, "c": 2, "d": 2, "e": 2}, dtype=np.int8)
  frag_a, frag_b = fr.partition(params, 2, "balanced")
  assert frag_a.names == ("a", "c", "e") and frag_a.nbytes == 7
  assert frag_b.names == ("b", "d") and frag_b.nbytes == 5
  assert fr.peak_to_ideal((frag_a, frag_b)) == pytest.approx(7 / 6)


def _optimal_peak(sizes, num_fragments) -> int:
  """The smallest possible peak bin of a split of ``sizes`` into P bins, by exhaustive search.

  Branch and bound; a tensor is tried only once in bins of equal load (they are interchangeable).
  """
  sizes = sorted(sizes, reverse=True)
  best = sum(sizes)
  loads = [0] * num_fragments

  def place(i):
    nonlocal best
    if i == len(sizes):
      best = min(best, max(loads))
      return
    tried = set()
    for p in range(num_fragments):
      if loads[p] in tried or loads[p] + sizes[i] >= best:
        continue
      tried.add(loads[p])
      loads[p] += sizes[i]
      place(i + 1)
      loads[p] -= sizes[i]

  place(0)
  return best


def _assert_graham_bound(fragments, sizes, num_fragments):
  # Graham (1969): the largest-first greedy peak is at most (4/3 - 1/(3P)) of the optimal peak.
  # In integers: 3P · peak <= (4P - 1) · OPT.
  peak = max(f.nbytes for f in fragments)
  opt = _optimal_peak(sizes, num_fragments)
  assert 3 * num_fragments * peak <= (4 * num_fragments - 1) * opt, (sizes, peak, opt)


def _assert_list_scheduling_bound(fragments, sizes, num_fragments):
  # The peak fragment is a single tensor, or its last tensor s_j joined it when it was the lightest,
  # i.e. held at most (total - s_j) / P, so peak <= total / P + (1 - 1/P) s_j; and s_j <= s_{P+1}
  # because the first P tensors each open their own fragment. In integers:
  # P · peak <= max(P · largest, total + (P - 1) · s_{P+1}).
  ordered = sorted(sizes, reverse=True)
  s_next = ordered[num_fragments] if len(ordered) > num_fragments else 0
  peak = max(f.nbytes for f in fragments)
  bound = max(num_fragments * ordered[0], sum(sizes) + (num_fragments - 1) * s_next)
  assert num_fragments * peak <= bound, (peak, sum(sizes) / num_fragments, ordered[0], s_next)


def _random_sizes(rng, num_tensors):
  # Heavy-tailed byte sizes with some repeats, as in real models (many equal layer tensors).
  sizes = np.maximum(1, rng.lognormal(8, 2, num_tensors).astype(int))
  sizes[: num_tensors // 3] = sizes[0]
  return [int(n) for n in sizes]


def test_balanced_is_within_four_thirds_of_the_optimum_on_random_sizes():
  for seed in range(200):
    rng = np.random.default_rng(seed)
    sizes = _random_sizes(rng, int(rng.integers(1, 10)))
    num_fragments = int(rng.integers(1, len(sizes) + 1))
    params = _tensors({f"t{i:02d}": n for i, n in enumerate(sizes)}, dtype=np.int8)
    fragments = fr.partition(params, num_fragments, "balanced")
    _assert_exact_cover(params, fragments, num_fragments)
    _assert_graham_bound(fragments, sizes, num_fragments)


def test_balanced_exceeds_the_ideal_by_less_than_one_small_tensor_on_random_sizes():
  for seed in range(200):
    rng = np.random.default_rng(1000 + seed)
    sizes = _random_sizes(rng, int(rng.integers(1, 200)))
    num_fragments = int(rng.integers(1, len(sizes) + 1))
    params = _tensors({f"t{i:03d}": n for i, n in enumerate(sizes)}, dtype=np.int8)
    fragments = fr.partition(params, num_fragments, "balanced")
    _assert_exact_cover(params, fragments, num_fragments)
    _assert_list_scheduling_bound(fragments, sizes, num_fragments)


def test_four_thirds_is_relative_to_the_optimum_not_the_ideal():
  # 4 equal tensors in 3 fragments: some fragment holds 2, so peak / ideal = 2 / (4/3) = 1.5 for any
  # split. The 4/3 bound is relative to the best possible peak (docs/design.md §2); "peak <= 4/3 of
  # the ideal" needs many tensors that are small next to the ideal.
  fragments = fr.partition(_tensors({"a": 1, "b": 1, "c": 1, "d": 1}), 3, "balanced")
  assert fr.peak_to_ideal(fragments) == pytest.approx(1.5)


@pytest.mark.parametrize("num_fragments", [2, 4, 8, 24])
def test_balanced_peak_is_within_four_thirds_on_a_transformer(num_fragments):
  # Many similar tensors: the peak is within 4/3 of max(ideal, largest tensor). With P >= 8 the
  # 64 MB embedding alone exceeds the ideal share and is the peak.
  params = _transformer(num_layers=24)
  fragments = fr.partition(params, num_fragments, "balanced")
  sizes = [fr.tensor_nbytes(x) for x in params.values()]
  peak = max(f.nbytes for f in fragments)
  assert 3 * peak <= 4 * max(sum(sizes) / num_fragments, max(sizes))
  _assert_list_scheduling_bound(fragments, sizes, num_fragments)


def test_balanced_does_not_depend_on_dict_order():
  params = _transformer(num_layers=4)
  reordered = dict(reversed(list(params.items())))
  assert fr.partition(params, 5, "balanced") == fr.partition(reordered, 5, "balanced")


def test_round_robin_deals_sorted_names_in_turn():
  params = _tensors({"d": 1, "a": 100, "c": 1, "b": 1, "e": 1})
  fragments = fr.partition(params, 2, "round_robin")
  assert [f.names for f in fragments] == [("a", "c", "e"), ("b", "d")]


def test_layer_strided_puts_layer_i_in_fragment_i_mod_p():
  params = _transformer(num_layers=6)
  fragments = fr.partition(params, 3, "layer_strided")
  owner = fr.fragment_of(fragments)
  for name in params:
    i = fr.layer_index(name)
    if i is not None:
      assert owner[name] == i % 3, name
  # Outside the layers: the embedding goes first (largest) to the lightest fragment; all fragments
  # hold 2 layers of equal size, so that is fragment 0. Then the tiny final norm goes to the
  # lightest, now fragment 1.
  assert owner[EMBEDDING] == 0
  assert owner["final_norm/scale"] == 1


def test_layer_index_reads_the_layers_path_component():
  assert fr.layer_index("layers/12/attn/q_proj/kernel") == 12
  assert fr.layer_index("decoder/layers/3/mlp") == 3
  assert fr.layer_index("final_norm/scale") is None
  assert fr.layer_index("extra_layers/3/w") is None


@pytest.mark.parametrize("method", fr.METHODS)
def test_embedding_is_flagged_on_its_fragment_only(method):
  params = _transformer(num_layers=4)
  fragments = fr.partition(params, 4, method, embedding_names=[EMBEDDING])
  flagged = [f for f in fragments if f.embedding_names]
  assert len(flagged) == 1
  assert flagged[0].embedding_names == (EMBEDDING,)
  assert EMBEDDING in flagged[0].names


def test_num_params_counts_elements_not_bytes():
  params = {
      "a": jax.ShapeDtypeStruct((3, 4), np.float32),  # 12 elements, 48 bytes
      "b": jax.ShapeDtypeStruct((5,), jax.numpy.bfloat16),  # 5 elements, 10 bytes
      "c": np.zeros((2, 2), np.float64),  # 4 elements, 32 bytes
  }
  (only,) = fr.partition(params, 1, "balanced")
  assert only.num_params == 12 + 5 + 4
  assert only.nbytes == 48 + 10 + 32


def test_peak_to_ideal_by_hand():
  frags = (fr.Fragment(0, ("a",), 30), fr.Fragment(1, ("b",), 10))
  # ideal = 40 / 2 = 20, peak = 30 -> 1.5
  assert fr.peak_to_ideal(frags) == pytest.approx(1.5)


def test_fragment_without_sizes_refuses_num_params():
  with pytest.raises(ValueError, match="sizes"):
    _ = fr.Fragment(0, ("a",), 4).num_params


@pytest.mark.parametrize("num_fragments", [0, -1, 1.5])
def test_too_few_fragments_is_an_error(num_fragments):
  with pytest.raises(ValueError, match=r"config\.sync\.num_fragments"):
    fr.partition(_tensors({"a": 1, "b": 1}), num_fragments, "balanced")


@pytest.mark.parametrize("method", ["balanced", "round_robin"])
def test_more_fragments_than_tensors_is_an_error(method):
  with pytest.raises(ValueError, match=r"config\.sync\.num_fragments=3.*\(2\)"):
    fr.partition(_tensors({"a": 1, "b": 1}), 3, method)


def test_layer_strided_needs_a_layer_per_fragment():
  params = _transformer(num_layers=2)  # 2 layers, many tensors
  with pytest.raises(ValueError, match=r"config\.sync\.num_fragments=3.*layers \(2\)"):
    fr.partition(params, 3, "layer_strided")


def test_unknown_method_names_the_field_and_the_choices():
  with pytest.raises(ValueError, match=r"config\.sync\.fragmentation='zigzag'") as err:
    fr.partition(_tensors({"a": 1}), 1, "zigzag")
  for method in fr.METHODS:
    assert method in str(err.value)


def test_unknown_embedding_name_is_an_error():
  with pytest.raises(ValueError, match="embedder"):
    fr.partition(_tensors({"a": 1}), 1, "balanced", embedding_names=["embedder/embedding"])


def test_partition_is_exhaustive_on_all_small_size_sets():
  # Every multiset of 1..6 tensors with sizes in {1, 2, 3, 5} and every valid P: an exact cover, no
  # empty fragment, and Graham's bound against the true optimum.
  for count in range(1, 7):
    for sizes in itertools.combinations_with_replacement([1, 2, 3, 5], count):
      params = _tensors({f"t{i}": n for i, n in enumerate(sizes)})
      for p in range(1, count + 1):
        fragments = fr.partition(params, p, "balanced")
        _assert_exact_cover(params, fragments, p)
        _assert_graham_bound(fragments, [4 * n for n in sizes], p)
