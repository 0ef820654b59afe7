"""Every learner's mesh inside one slice (runtime/core/slices.py, devices.build_meshes).

The TPU devices are the compile-only devices of real multi-slice topologies (libtpu, the `tpu`
extra: each carries its `slice_index`, chip coordinates and host), handed over in shuffled order, as
a controller may list them; emulated slices of fake CPU devices go through the run's own
`build_meshes`.
"""

import random

import pytest

from decoupled_diloco.runtime import tpu_aot
from decoupled_diloco.runtime.core import devices
from decoupled_diloco.runtime.core import slices


def _shuffled(items, seed):
  items = list(items)
  random.Random(seed).shuffle(items)
  return items


def _slice_of(placement):
  return {(d.slice_index, d.device_kind) for d in placement.devices}


def _meshes(device_list, sizes, shapes, **kwargs):
  placed = slices.place(slices.group_slices(device_list), sizes, **kwargs)
  return placed, [devices.placed_mesh(p, shape) for p, shape in zip(placed, shapes)]


def test_two_v5p_slices_give_each_learner_one_whole_slice_whatever_the_device_order():
  pod = tpu_aot.topology_devices("v5p:2x2x2", num_slices=2)
  assert sorted({d.slice_index for d in pod}) == [0, 1]
  reference = None
  for seed in range(4):
    placed, meshes = _meshes(_shuffled(pod, seed), [8, 8], [(2, 2, 2)] * 2)
    assert [_slice_of(p) for p in placed] == [{(0, "TPU v5")}, {(1, "TPU v5")}]
    assert all(p.whole_slice for p in placed)
    ids = [m.devices.tolist() for m in meshes]
    assert reference is None or ids == reference, "the device order changed the meshes"
    reference = ids
  first = meshes[0].devices
  assert {tuple(d.coords) for d in first.flat} == {(x, y, z) for x in (0, 1) for y in (0, 1)
                                                   for z in (0, 1)}


def test_smaller_learners_share_a_slice_and_never_span_two():
  pod = _shuffled(tpu_aot.topology_devices("v5p:2x2x2", num_slices=2), 7)
  placed = slices.place(slices.group_slices(pod), [4] * 4)
  assert [_slice_of(p) for p in placed] == [{(0, "TPU v5")}] * 2 + [{(1, "TPU v5")}] * 2
  held = [d for p in placed for d in p.devices]
  assert len(set(held)) == len(held) == 16
  # Learners that share devices take the same ones, and a group of them one slice.
  shared = slices.place(slices.group_slices(pod), [8] * 4, sharing=2)
  assert shared[0].devices == shared[1].devices and shared[2].devices == shared[3].devices
  assert _slice_of(shared[0]) != _slice_of(shared[2])


def test_a_heterogeneous_pod_matches_each_learner_to_a_slice_of_its_generation():
  pod = (list(tpu_aot.topology_devices("v6e:2x2", num_slices=2))
         + list(tpu_aot.topology_devices("v5p:2x2x1", num_slices=2)))
  topologies = ("v5p:2x2x1", "v6e:2x2", "v5p:2x2x1", "v6e:2x2")
  reference = None
  for seed in range(3):
    placed, meshes = _meshes(_shuffled(pod, seed), [4] * 4, [(2, 1, 2)] * 4,
                             generations=[t.split(":")[0] for t in topologies])
    kinds = [{d.device_kind for d in m.devices.flat} for m in meshes]
    assert kinds == [{"TPU v5"}, {"TPU v6 lite"}, {"TPU v5"}, {"TPU v6 lite"}]
    assert all(len(_slice_of(p)) == 1 for p in placed)
    assert len({frozenset(_slice_of(p)) for p in placed}) == 4
    where = [sorted(_slice_of(p)) for p in placed]
    assert reference is None or where == reference
    reference = where


@pytest.mark.parametrize("sizes,generations,expected", [
    # A learner larger than any slice.
    ([16, 8], (), r"^learner 0 needs 16 devices in one slice \(config entry 0\), but the largest "
                  r"slice has 8: shrink the mesh or use larger slices; slices here: slice 0: 8 x "
                  r"TPU v5; slice 1: 8 x TPU v5$"),
    # More learners than slices.
    ([8, 8, 8], (), r"^learner 2 needs 8 devices in one slice \(config entry 2\), but every slice "
                    r"that could hold it is taken: add a slice, or shrink the meshes so that "
                    r"learners share one; slices here: slice 0: 8 x TPU v5, 8 taken by "
                    r"learner\(s\) 0; slice 1: 8 x TPU v5, 8 taken by learner\(s\) 1$"),
    # A generation no slice has.
    ([8, 8], ("v5p", "v6e"), r"^learner 1 needs 8 v6e devices in one slice \(config entry 1\), "
                             r"but no slice here has v6e chips; slices here: slice 0: 8 x TPU "
                             r"v5, 8 taken by learner\(s\) 0; slice 1: 8 x TPU v5$"),
])
def test_a_layout_that_cannot_be_placed_is_refused_in_one_line(sizes, generations, expected):
  pod = _shuffled(tpu_aot.topology_devices("v5p:2x2x2", num_slices=2), 3)
  with pytest.raises(ValueError, match=expected):
    slices.place(slices.group_slices(pod), sizes, generations=generations,
                 what=[f"config entry {m}" for m in range(len(sizes))])


def test_fake_cpu_slices_place_learners_as_a_run_would_and_refuse_what_does_not_fit():
  # 12 fake CPU devices (tests/conftest.py) in emulated slices of 3: a 2-device learner per
  # slice, the third device of each left over; the syncer takes the first device nobody holds.
  meshes, syncer = devices.build_meshes(((2, 1),) * 4, 1, "cpu", fake_slice_size=3)
  assert [[d.id for d in m.devices.flat] for m in meshes] == [[0, 1], [3, 4], [6, 7], [9, 10]]
  assert [d.id for d in syncer.devices.flat] == [2]
  # Without slices the learners take consecutive devices, as they always did.
  meshes, syncer = devices.build_meshes(((2, 1),) * 4, 1, "cpu")
  assert [[d.id for d in m.devices.flat] for m in meshes] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert [d.id for d in syncer.devices.flat] == [8]
  with pytest.raises(ValueError, match=r"^learner 3 needs 3 devices in one slice "
                                       r"\(config.learner_mesh_shapes\[3\]=\(3, 1\)\), but every "
                                       r"slice that could hold it is taken"):
    devices.build_meshes(((3, 1),) * 4, 0, "cpu", fake_slice_size=4)


def test_one_job_spans_every_slice():
  """dp mode's one synchronous learner (and a Ray learner process's own job) takes devices of
  several slices: its all-reduce crossing them is what dp costs."""
  (mesh,), _ = devices.build_meshes(((8, 1),), 0, "cpu", fake_slice_size=4, one_job=True)
  assert [d.id for d in mesh.devices.flat] == list(range(8))
