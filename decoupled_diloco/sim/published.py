"""The paper's published figures (docs/design.md §7), for side-by-side comparison only.

No simulator module imports this file (a test checks it): the paper's numbers are never an input.
"""

# Table 1: goodput (%) vs simulated chips, chip MTBI = 1 year.
CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
MTBI_YEARS = 1.0
GOODPUT = {
    "dp": (72, 57, 38, 27, 18),
    "elastic_dp": (88, 80, 69, 58, 40),
    "decoupled_m2": (94, 88, 80, 70, 54),
    "decoupled_m4": (96, 93, 89, 82, 73),
    "decoupled_m8": (98, 96, 94, 88, 80),
    "decoupled_m16": (99, 98, 96, 93, 86),
}
LEARNER_COUNTS = (2, 4, 8, 16)

# Bandwidth claims.
BANDWIDTH_REDUCTION_RANGE = (60, 242)  # "60-242x less than DP"
DP_GBITS_8_DATACENTERS = 198.0  # Gbit/s DP needs across 8 datacenters ...
DECOUPLED_GBITS_8_DATACENTERS = 0.84  # ... vs Decoupled DiLoCo
WAN_GBITS_RANGE = (2.0, 5.0)  # 12B model across 4 US regions over 2-5 Gbit/s WAN ...
WALL_CLOCK_SPEEDUP_AT_LEAST = 20.0  # ... "more than 20x faster" than conventional synchronisation
