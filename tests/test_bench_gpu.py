"""scripts/bench_gpu.py's report name: one per card, so two cards of one day keep their own."""

import pytest

from tests.conftest import load_script

bench_gpu = load_script("bench_gpu")


@pytest.mark.parametrize("kind, name", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"),
                                        ("TPU v5 lite", "tpu_v5_lite"), ("", "unknown")])
def test_the_card_name_is_the_model_of_the_device_kind(kind, name):
  assert bench_gpu.card_name(kind) == name
