"""A learner is a jax.distributed job of its own: no MEGASCALE_* setting reaches its JAX.

A TPU VM provisioned for a multislice job carries `MEGASCALE_*` settings, and with them
`jax.distributed.initialize()` (libtpu, on TPU) joins every slice into ONE synchronous job that
fails as a unit, the very coupling Decoupled DiLoCo removes. Ray workers inherit the raylet's
environment, so each learner process clears them itself before its JAX starts
(`clear_megascale`), and the command never puts them in a runtime_env (`without_megascale`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

MEGASCALE_PREFIX = "MEGASCALE_"


def without_megascale(env: Mapping[str, str]) -> dict[str, str]:
  """`env` less every MEGASCALE_* setting: what may go into a learner's runtime_env."""
  return {k: v for k, v in env.items() if not k.startswith(MEGASCALE_PREFIX)}


def clear_megascale(environ: dict[str, str] | Any = os.environ) -> list[str]:
  """Removes every MEGASCALE_* setting from `environ` (this process's, inherited from the raylet);
  returns the names removed. Called by a learner process before its JAX starts a backend."""
  names = sorted(k for k in environ if k.startswith(MEGASCALE_PREFIX))
  for name in names:
    del environ[name]
  return names
