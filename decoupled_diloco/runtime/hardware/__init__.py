"""The accelerator side: TPU AOT compiles, HLO analysis, memory fit checks."""
