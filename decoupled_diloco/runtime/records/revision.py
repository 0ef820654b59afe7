"""Which code made a record: the package's version and, in a git checkout, its commit.

A recording replays bit for bit only on the revision that made it: a merge that changes its float
arithmetic (a fused program, another rounding) moves the last bits of Theta, and the replay then
meets a merged value unlike the recording's. The tape keeps the revision, so that such a replay
says which two revisions met instead of leaving a mystery.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess

import decoupled_diloco


@functools.cache
def current() -> dict[str, str | bool | None]:
  """{"version", "commit", "dirty"}: commit and dirty None outside a git checkout."""
  try:
    version = importlib.metadata.version("decoupled-diloco")
  except importlib.metadata.PackageNotFoundError:
    version = None
  root = os.path.dirname(os.path.dirname(os.path.abspath(decoupled_diloco.__file__)))
  commit = _git(root, "rev-parse", "HEAD")
  dirty = None
  if commit is not None:
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", "decoupled_diloco")
    dirty = bool(status)
  return {"version": version, "commit": commit, "dirty": dirty}


def describe(revision: dict | None) -> str:
  """One short name for a revision: "0.1.0 at 1a2b3c4d5e6f (with uncommitted changes)"."""
  if not revision:
    return "an unknown revision (recorded before tapes kept theirs)"
  name = revision.get("version") or "an unknown version"
  if revision.get("commit"):
    name += f" at {revision['commit'][:12]}"
    if revision.get("dirty"):
      name += " (with uncommitted changes)"
  return name


def same(recorded: dict | None, now: dict) -> bool:
  """Whether a record's revision is this one: known, equal, and neither with uncommitted changes
  (which no commit names)."""
  return bool(recorded) and recorded.get("commit") is not None and not recorded.get("dirty") and (
      not now.get("dirty")) and (recorded.get("version"), recorded.get("commit")) == (
          now.get("version"), now.get("commit"))


def _git(root: str, *args: str) -> str | None:
  try:
    out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10,
                         check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()
