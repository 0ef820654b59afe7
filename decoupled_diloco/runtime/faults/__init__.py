"""Faults made on purpose: the injector that fires the chaos schedule, damaged checkpoints."""
