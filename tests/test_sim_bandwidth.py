"""Tests for decoupled_diloco.sim.bandwidth: DP vs Decoupled DiLoCo cross-datacenter traffic (§7)."""

import math

import pytest

from decoupled_diloco.sim import bandwidth as bw


@pytest.mark.parametrize(
    "num_values, fmt, block_size, expected",
    [
        (1000, "fp32", 64, 4000),  # 4 bytes a value
        (1000, "bf16", 64, 2000),  # 2 bytes a value
        (1000, "int8", 64, 1064),  # 1000 values + ⌈1000/64⌉ = 16 scales · 4 bytes
        (1000, "int4", 64, 564),  # 500 bytes of packed pairs + 16 scales
        (1001, "int4", 64, 565),  # an odd count pads half a byte
        (1, "int4", 64, 5),
        (1001, "int2", 64, 251 + 64),  # four values a byte
        (1001, "int1", 64, 126 + 64),  # eight values a byte
        (7, "int8", 2, 23),  # 7 + 4 scales · 4 bytes
        (0, "int4", 64, 0),
    ],
)
def test_encoded_bytes_by_hand(num_values, fmt, block_size, expected):
  assert bw.encoded_bytes(num_values, fmt, block_size) == expected


def test_encoded_bytes_agree_with_the_runtime_wire_format():
  compression = pytest.importorskip("decoupled_diloco.algorithm.compression")
  for fmt in bw.FORMATS:
    for n in (0, 1, 63, 64, 65, 1001, 4096):
      for block in (1, 3, 64):
        assert bw.encoded_bytes(n, fmt, block) == compression.encoded_nbytes(n, fmt, block)


def test_one_fragment_goes_each_way_per_inner_step():
  # 2400 parameters in 24 fragments of 100 values; with P = H one fragment syncs per step.
  assert bw.bytes_per_inner_step(2400, 24, "bf16", "bf16") == 100 * 2 + 100 * 2
  # int4 up (50 packed bytes + 2 scales) and bf16 down.
  assert bw.bytes_per_inner_step(2400, 24, "int4", "bf16", block_size=64) == (50 + 2 * 4) + 200
  assert bw.bytes_per_inner_step(2400, 24, "fp32", "int8", block_size=100) == 400 + (100 + 4)


def test_uneven_fragments_average_to_the_total_over_the_period():
  n, p = 1003, 24  # 19 fragments of 42 values, 5 of 41
  per_step = bw.bytes_per_inner_step(n, p, "int4", "int8", block_size=16)
  total = 19 * (bw.encoded_bytes(42, "int4", 16) + bw.encoded_bytes(42, "int8", 16)) + 5 * (
      bw.encoded_bytes(41, "int4", 16) + bw.encoded_bytes(41, "int8", 16))
  assert per_step == pytest.approx(total / p)
  # A longer sync period spreads the same bytes over more steps.
  assert bw.bytes_per_inner_step(n, p, "int4", "int8", 16, sync_period=48) == pytest.approx(
      total / 48)


def test_int4_is_four_times_smaller_than_bf16_up_to_the_scales():
  n, p = 12_000_000, 24
  bf16 = bw.bytes_per_inner_step(n, p, "bf16", "bf16")
  int4 = bw.bytes_per_inner_step(n, p, "int4", "int4", block_size=64)
  assert bf16 / int4 == pytest.approx(16 / (4 + 32 / 64), rel=1e-4)  # up to a partial block


def test_ring_allreduce_sends_two_n_minus_one_over_n_of_the_gradient():
  assert bw.dp_ring_allreduce_bytes_per_step(1e9, 1, 2) == 0.0
  assert bw.dp_ring_allreduce_bytes_per_step(1e9, 2, 2) == pytest.approx(1e9 * 2)
  assert bw.dp_ring_allreduce_bytes_per_step(1e9, 8, 2) == pytest.approx(2 * 7 / 8 * 1e9 * 2)
  assert bw.dp_ring_allreduce_bytes_per_step(1e9, 10**6, 4) == pytest.approx(2 * 1e9 * 4, rel=1e-5)


@pytest.mark.parametrize("datacenters", [2, 4, 8])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_reduction_factor_is_2_d_minus_1_over_d_times_h_times_bit_ratio(datacenters, fmt):
  n, t, p = 12e9, 1.0, 24
  dp = bw.dp_wan_gbits(n, datacenters, t, "bf16")
  ddl = bw.decoupled_wan_gbits(n, p, t, fmt, fmt, sync_period=p, overlap=2)
  expected = 2 * (datacenters - 1) / datacenters * p * 16 / bw.bits_per_value(fmt)
  assert dp / ddl == pytest.approx(expected)


def test_paper_setting_needs_hundreds_of_gbits_for_dp_and_a_few_for_decoupled():
  # 12B parameters, 1 s steps, 8 datacenters: DP 2·7/8·12e9·16 bit = 336 Gbit/s; Decoupled bf16
  # 12e9/24·16 bit = 8 Gbit/s, int4 with block-64 scales 12e9/24·4.5 bit = 2.25 Gbit/s.
  assert bw.dp_wan_gbits(12e9, 8, 1.0) == pytest.approx(336.0)
  assert bw.decoupled_wan_gbits(12e9, 24, 1.0, "bf16", "bf16") == pytest.approx(8.0)
  assert bw.decoupled_wan_gbits(12e9, 24, 1.0, "int4", "int4") == pytest.approx(2.25)


def test_overlap_only_matters_when_a_fragment_cannot_finish_in_tau_steps():
  n, t = 12e9, 1.0
  # P = H: one fragment per step binds for any τ >= 1.
  assert bw.decoupled_wan_gbits(n, 24, t, overlap=1) == bw.decoupled_wan_gbits(n, 24, t, overlap=4)
  # Few big fragments synced often: the τ-step latency bound binds and τ helps.
  assert bw.decoupled_wan_gbits(n, 4, t, sync_period=24, overlap=1) == pytest.approx(
      2 * bw.decoupled_wan_gbits(n, 4, t, sync_period=24, overlap=2))


def test_dp_slows_down_on_a_thin_wan_link_and_decoupled_does_not():
  n, t = 12e9, 1.0
  # 2·3/4·12e9·16 bit = 288 Gbit per step over 5 Gbit/s: 57.6 s of communication a step.
  assert bw.dp_step_s(n, 4, t, 5.0) == pytest.approx(1.0 + 57.6)
  assert bw.decoupled_step_s(n, 24, t, 5.0, "int4", "int4") == t
  assert bw.dp_step_s(n, 4, t, 5.0) / bw.decoupled_step_s(n, 24, t, 5.0, "int4", "int4") > 20
  # With ample bandwidth neither is slowed.
  assert bw.dp_step_s(n, 4, t, math.inf) == t


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match="outer_grad_format"):
    bw.bytes_per_inner_step(100, 4, "int3", "bf16")
  with pytest.raises(ValueError, match="num_fragments"):
    bw.bytes_per_inner_step(100, 0)
  with pytest.raises(ValueError, match="num_workers"):
    bw.dp_ring_allreduce_bytes_per_step(100, 0, 2)
  with pytest.raises(ValueError, match="overlap"):
    bw.decoupled_wan_gbits(100, 4, 1.0, overlap=0)
