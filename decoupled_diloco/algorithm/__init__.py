"""The paper's math as pure functions: no threads, no I/O, no clock, nothing of the runtime.

Fragments, merge rules, the outer optimizer, wire formats, the sync schedule, the grace window and
the merge-tape audits. Each is tested on its own; tests/test_layers.py keeps this package pure.
"""
