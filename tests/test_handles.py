"""Both kinds of learner and of syncer offer everything the controller reads of them
(runtime/core/handles.py), so nothing in the controller needs to guess with getattr/hasattr.

The classes are inspected, not built (no devices, no Ray): a member is a class attribute, a method or
property, or an attribute its `__init__` assigns to `self`."""

import ast
import inspect
import re
import textwrap
import typing

import pytest

from decoupled_diloco.runtime.core import handles
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import learner_status
from decoupled_diloco.runtime.core.syncer import sharded as sharded_syncer
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.transport import ray_learner
from decoupled_diloco.runtime.transport import ray_syncer


def _protocol_members(protocol: type) -> set[str]:
  """What a Protocol names: its annotated attributes, methods and properties (its bases' too)."""
  names = set()
  for klass in protocol.__mro__:
    if klass in (typing.Protocol, typing.Generic, object):
      continue
    names |= set(getattr(klass, "__annotations__", {}))
    names |= {n for n, v in vars(klass).items() if not n.startswith("_")
              and (callable(v) or isinstance(v, property))}
  return names


def _assigned_in_init(klass: type) -> set[str]:
  """`self.x = ...`, `self.x: T = ...` and `self.x, self.y = ...` in the class's __init__."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(klass.__init__)))
  names = set()
  for node in ast.walk(tree):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) else [])
    for target in targets:
      for part in ast.walk(target):
        if (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
            and part.value.id == "self"):
          names.add(part.attr)
  return names


def _offered(klass: type) -> set[str]:
  return set(dir(klass)) | _assigned_in_init(klass)


@pytest.mark.parametrize("klass,protocol", [
    (learner_lib.Learner, handles.LearnerHandle),
    (ray_learner.RemoteLearner, handles.LearnerHandle),
    (ray_learner.RemoteLearner, handles.LearnerProcessHandle),
    (syncer_lib.Syncer, handles.SyncerHandle),
    (ray_syncer.RemoteSyncer, handles.SyncerHandle),
    (sharded_syncer.ShardedSyncer, handles.SyncerHandle),
], ids=lambda x: x.__name__)
def test_each_kind_offers_every_member_its_protocol_names(klass, protocol):
  missing = sorted(_protocol_members(protocol) - _offered(klass))
  assert not missing, f"{klass.__name__} lacks {missing} of {protocol.__name__}"


def test_the_protocols_name_what_the_controller_used_to_guess():
  assert {"replicas_agree", "published", "step_times", "respawn"} <= _protocol_members(
      handles.LearnerHandle)
  assert {"process_died", "kill", "model"} <= _protocol_members(handles.SyncerHandle)


def test_a_local_syncer_never_dies_as_a_process():
  assert syncer_lib.Syncer.process_died.fget(object()) is False


def test_a_learner_status_holds_what_its_remote_handle_reads():
  """Every field a RemoteLearner reads of a status is one Learner.status() fills in."""
  fields = {f.name for f in handles.LearnerStatus.__dataclass_fields__.values()}
  source = inspect.getsource(learner_status.status)
  assert all(f"{name}=" in source for name in fields)
  remote = inspect.getsource(ray_learner.RemoteLearner)
  read = set(re.findall(r"status\.([a-z_]+)", remote))
  assert {"step", "counters", "num_steps_done"} <= read
  assert read <= fields, sorted(read - fields)
