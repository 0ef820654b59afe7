"""A user's first hour: every mistake a user can make on the command line of main.py or
of a script ends in one line (plus at most a hint) that names the field or the flag, exit status 2,
no traceback, and leaves the workdir, an earlier run's files and any earlier output as they were.

main.py's rows run in this process (absl's flags reset between them by the `main_cli` fixture);
a few rows run `python -m decoupled_diloco.main` and every script in a process of its own, as a
user does, since a script's flags and its exit are what is tested there.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from absl import flags
from absl import logging as absl_logging

from decoupled_diloco import config_help
from decoupled_diloco import errors
from decoupled_diloco import settings
from decoupled_diloco.runtime import train

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CORPUS = _ROOT / "decoupled_diloco" / "lm" / "corpora" / "tinyshakespeare.txt"
# Lines on stderr that are not the error's message: absl's log lines ("I1126 06:28:53.866 ...
# file.py:439] ..."; their level is another concern), and prepare_data.py's progress bar.
_NOT_THE_MESSAGE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|\[#* *\] \d+/\d+ files)")


def _message_lines(stderr: str) -> list[str]:
  return [l for l in stderr.strip().splitlines() if l.strip() and not _NOT_THE_MESSAGE.match(l)]


def _snapshot(root: pathlib.Path) -> dict[str, tuple[bytes, int] | None]:
  """Every file under `root` with its bytes and mtime; {} when `root` does not exist."""
  if not root.exists():
    return {}
  return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
          for p in sorted(root.rglob("*"))}


@pytest.fixture(name="inputs", scope="module")
def fixture_inputs(tmp_path_factory) -> pathlib.Path:
  """Small bad (and good) inputs the rows name as {inputs}/NAME."""
  root = tmp_path_factory.mktemp("inputs")
  (root / "3_bytes.txt").write_bytes(b"abc")
  text = _CORPUS.read_bytes()[:2000]
  (root / "2_kb.txt").write_bytes(text)
  (root / "empty.txt").write_bytes(b"")
  (root / "all_bad.jsonl").write_text('{"x": 1}\n{"text": 2}\nnot json\n', encoding="utf-8")
  (root / "a_file").write_text("not a directory", encoding="utf-8")
  (root / "no_tape").mkdir()
  (root / "tok_existing.json").write_text("an earlier tokenizer", encoding="utf-8")
  shards = root / "shards"
  shards.mkdir()
  (shards / "meta.json").write_text("{}", encoding="utf-8")
  (shards / "train-00000.array_record").write_bytes(b"earlier shards")
  (root / "run_without_checkpoints").mkdir()
  return root


@pytest.fixture(name="earlier_run")
def fixture_earlier_run(tmp_path) -> pathlib.Path:
  """A workdir holding an earlier run's outputs, which no failed invocation may touch."""
  workdir = tmp_path / "earlier"
  (workdir / "tb").mkdir(parents=True)
  (workdir / "tb" / "events.out.tfevents.1").write_bytes(b"\x00earlier events")
  (workdir / "metrics.jsonl").write_text('{"kind": "progress", "step": 400}\n', encoding="utf-8")
  (workdir / "tape.jsonl").write_text('{"kind": "config"}\n', encoding="utf-8")
  (workdir / "summary.json").write_text('{"final_eval_loss": 1.9}\n', encoding="utf-8")
  return workdir


def _reset_flags() -> None:
  """absl keeps one parse per process and ml_collections defines a flag per --config.FIELD
  override it sees: both are undone so that the next row parses its own command line."""
  for name in [n for n in flags.FLAGS if n.startswith("config.")]:
    delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()


@pytest.fixture(name="main_cli")
def fixture_main_cli(monkeypatch, capsys):
  """Runs decoupled_diloco.main's command line in this process: call(*args) -> (exit code, the
  message lines of stderr, stdout)."""
  from decoupled_diloco import main as main_lib  # pylint: disable=g-import-not-at-top
  # JAX starts here with conftest's fake devices, as every other test's runs find it: a row run
  # first in a fresh process would otherwise start it with the experiment's 9 (and set XLA_FLAGS
  # for every later test's subprocesses).
  jax.devices()
  monkeypatch.chdir(_ROOT)  # the rows name experiments/ as a user in a clone does

  def call(*args: str) -> tuple[int, list[str], str]:
    argv = ["decoupled_diloco.main", *args]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
    _reset_flags()
    with pytest.raises(SystemExit) as exit_info:
      main_lib.run(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, _message_lines(captured.err), captured.out

  handler = absl_logging.get_absl_handler()
  filters = list(handler.filters)
  yield call
  _reset_flags()
  handler.filters[:] = filters  # the run's quiet_logs filter stays with its row


@dataclasses.dataclass(frozen=True)
class Row:
  args: tuple[str, ...]  # after --config=experiments/tiny_cpu.py unless no_config
  names: str  # what the line must name (a field or a flag)
  no_config: bool = False

  def argv(self, inputs: pathlib.Path, workdir: pathlib.Path) -> list[str]:
    args = [a.format(inputs=inputs, workdir=workdir) for a in self.args]
    if self.no_config:
      return args
    # The session's compilation cache (conftest) stays this process's: a run's own would outlive
    # its row.
    head = ["--config=experiments/tiny_cpu.py", "--config.compilation_cache_dir=none"]
    return head + args + ([] if any("config.workdir" in a for a in args)
                          else [f"--config.workdir={workdir}"])


# Mistakes found by flag parsing or settings.validate, before a run is built.
_CONFIG_ROWS = {
    "no --config": Row(("--config.workdir={workdir}",), "--config", no_config=True),
    "no such config file": Row(("--config=experiments/nope.py",), "--config=experiments/nope.py",
                               no_config=True),
    "config file whose get_config fails": Row(("--config=experiments/tiny_cpu.py:an_arg",),
                                              "--config=experiments/tiny_cpu.py:an_arg",
                                              no_config=True),
    "override before --config": Row(("--config.num_steps=5", "--config=experiments/tiny_cpu.py"),
                                    "--config.num_steps=5", no_config=True),
    "unknown field": Row(("--config.nonexistent=1",), "config.nonexistent"),
    "misspelt field": Row(("--config.sync.qorum=1",), "config.sync.qorum"),
    "renamed field": Row(("--config.data.path=x",), "config.data.path"),
    "a section given a value": Row(("--config.sync=1",), "config.sync"),
    "not an integer": Row(("--config.num_steps=abc",), "config.num_steps"),
    "a float for an integer": Row(("--config.num_steps=1.5",), "config.num_steps"),
    "zero steps": Row(("--config.num_steps=0",), "config.num_steps"),
    "quorum above num_learners": Row(("--config.sync.quorum=9",), "config.sync.quorum"),
    "unknown mode": Row(("--config.mode=async",), "config.mode"),
    "unknown dtype": Row(("--config.model.dtype=float8",), "config.model.dtype"),
    "unknown wire format": Row(("--config.compression.outer_grad=int3",),
                               "config.compression.outer_grad"),
    "alpha of 1": Row(("--config.merge.alpha=1.0",), "config.merge.alpha"),
    "eval fraction above 0.5": Row(("--config.data.eval_fraction=0.9",),
                                   "config.data.eval_fraction"),
    "sequence longer than the model's": Row(("--config.data.seq_len=256",), "config.data.seq_len"),
    "batch that does not split over the mesh": Row(("--config.data.batch_size=3",),
                                                   "config.data.batch_size"),
    "profile past the end": Row(("--config.profile_steps=(5, 500)",), "config.profile_steps"),
    "unknown fault": Row(("--config.chaos.schedule=explode@learner=1",), "config.chaos.schedule"),
    "late learner out of range": Row(("--config.late_learners=(7,)",), "config.late_learners"),
    "no such data source": Row(("--config.data.source={inputs}/absent.txt",), "config.data.source"),
    "no such tokenizer": Row(("--config.data.tokenizer={inputs}/absent.model",),
                             "config.data.tokenizer"),
    "unknown tokenizer kind": Row(("--config.data.tokenizer=gpt2",), "config.data.tokenizer"),
    "workdir that is a file": Row(("--config.workdir={inputs}/a_file/run",), "config.workdir"),
    "replay of a workdir without a tape": Row(("--config.replay={inputs}/no_tape",),
                                              "config.replay"),
    "positional argument": Row(("foo",), "foo"),
    "unknown flag": Row(("--bogus",), "--bogus"),
}
# Mistakes found while the run is built (data, devices, checkpoints): after the workdir is known.
_BUILD_ROWS = {
    "3-byte corpus": Row(("--config.data.source={inputs}/3_bytes.txt",), "config.data"),
    "2 KB corpus": Row(("--config.data.source={inputs}/2_kb.txt",), "config.data.seq_len"),
    "jsonl of bad records only": Row(("--config.data.source={inputs}/all_bad.jsonl",),
                                     "config.data.source"),
    # 4 learners x (4, 1) + the syncer: 17 devices, more than this process has (conftest's 12).
    "mesh needing more devices than exist": Row(("--config.learner_mesh_shapes=((4, 1),)",),
                                                "config.learner_mesh_shapes"),
    "resume with no checkpoint": Row(("--config.restore=latest",), "config.restore"),
    # Found once the learner's step is compiled, after the run has opened its workdir.
    "learners that do not fit the device memory": Row(
        ("--config.devices.memory_per_device_gb=0.0001", "--config.num_learners=1",
         "--config.model.num_layers=1", "--config.sync.num_fragments=4"),
        "config.devices.memory_per_device_gb"),
}


def _assert_one_line(code, lines, names: str) -> None:
  assert code == errors.EXIT_BAD_INPUT, (code, lines)
  assert 1 <= len(lines) <= 2, lines  # the message, and at most a hint
  assert not any("Traceback" in l for l in lines), lines
  assert names in lines[0], lines


@pytest.mark.parametrize("row", _CONFIG_ROWS.values(), ids=_CONFIG_ROWS.keys())
def test_config_mistake_is_one_line_naming_it_and_touches_no_workdir(row, main_cli, inputs,
                                                                     earlier_run, tmp_path):
  before = _snapshot(earlier_run)
  code, lines, _ = main_cli(*row.argv(inputs, earlier_run))
  _assert_one_line(code, lines, row.names)
  assert _snapshot(earlier_run) == before
  code, lines, _ = main_cli(*row.argv(inputs, tmp_path / "fresh"))
  _assert_one_line(code, lines, row.names)
  assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("row", _BUILD_ROWS.values(), ids=_BUILD_ROWS.keys())
def test_input_the_run_cannot_use_is_one_line_and_leaves_no_stub_workdir(row, main_cli, inputs,
                                                                         earlier_run, tmp_path):
  code, lines, _ = main_cli(*row.argv(inputs, tmp_path / "fresh"))
  _assert_one_line(code, lines, row.names)
  assert not (tmp_path / "fresh").exists(), sorted(os.listdir(tmp_path / "fresh"))
  before = _snapshot(earlier_run)
  code, lines, _ = main_cli(*row.argv(inputs, earlier_run))
  _assert_one_line(code, lines, row.names)
  assert _snapshot(earlier_run) == before


def test_ctrl_c_while_the_run_is_built_is_one_line_and_exit_130(main_cli, monkeypatch, tmp_path):
  def interrupted(run_settings):
    os.makedirs(run_settings.workdir)
    raise KeyboardInterrupt

  monkeypatch.setattr(train, "train_and_evaluate", interrupted)
  code, lines, _ = main_cli("--config=experiments/tiny_cpu.py",
                            f"--config.workdir={tmp_path / 'run'}")
  assert code == errors.EXIT_INTERRUPTED and len(lines) == 1 and "Interrupted" in lines[0], lines


def test_debug_gives_the_traceback_back(main_cli, tmp_path):
  with pytest.raises(errors.InputError, match=r"config\.sync\.quorum=9"):
    main_cli("--config=experiments/tiny_cpu.py", f"--config.workdir={tmp_path / 'run'}",
             "--config.sync.quorum=9", "--debug")


@pytest.mark.parametrize("flag", ["--help_config", "--helpshort"])
def test_help_lists_every_config_field_with_its_description_and_exits_0(flag, main_cli):
  """--help_config with or without --config, and --helpshort, which absl ended in exit 1."""
  described = config_help.descriptions()
  for args in ((flag,), ("--config=experiments/one_gpu.py", flag)):
    code, lines, listing = main_cli(*args)
    assert code in (0, None) and not lines, lines
    for name in settings.config_fields():
      assert f"config.{name}=" in listing and described[name] in listing, name


def test_every_config_field_has_a_one_line_description():
  """The experiment's comments are the descriptions --help_config prints (config_help.py)."""
  described = config_help.descriptions()
  missing = [name for name in settings.config_fields() if not described.get(name)]
  assert not missing, f"fields of experiments/tiny_cpu.py without a comment: {missing}"
  assert all("\n" not in text for text in described.values())


# Rows run as a user runs them: a process of its own, its stderr and its exit status.
def _command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # as in a user's shell: the run asks for its fake devices itself
  return subprocess.run([sys.executable, *args], cwd=_ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


_TOKENIZER = "scripts/train_tokenizer.py"
_PREPARE = "scripts/prepare_data.py"
_SAMPLE = "scripts/sample.py"
# (command line, what the one line must name, what must not be in it, outputs that must not appear)
_PROCESS_ROWS = {
    "main: no such config file": (
        ("-m", "decoupled_diloco.main", "--config=experiments/nope.py"), "--config=", None, ()),
    "main: mesh needing more fake devices than asked for": (
        ("-m", "decoupled_diloco.main", "--config=experiments/tiny_cpu.py",
         "--config.workdir={out}/run", "--config.devices.num_fake_cpu_devices=4"),
        "config.learner_mesh_shapes", None, ("run",)),
    "main: 2 KB corpus": (
        ("-m", "decoupled_diloco.main", "--config=experiments/tiny_cpu.py",
         "--config.workdir={out}/run", "--config.data.source={inputs}/2_kb.txt"),
        "config.data.seq_len", None, ("run",)),
    "train_tokenizer: vocabulary of 5": (
        (_TOKENIZER, "--input={inputs}/2_kb.txt", "--vocab_size=5", "--out={out}/t.model"),
        "--vocab_size=5", None, ("t.model",)),
    "train_tokenizer: vocabulary below the text's characters": (
        (_TOKENIZER, "--input={inputs}/2_kb.txt", "--vocab_size=300", "--out={out}/t.model"),
        "--vocab_size=300", "character_coverage", ("t.model",)),
    "train_tokenizer: vocabulary the text cannot reach": (
        (_TOKENIZER, "--input={inputs}/2_kb.txt", "--vocab_size=100000", "--out={out}/t.json"),
        "--vocab_size=100000", None, ("t.json",)),
    "train_tokenizer: empty input": (
        (_TOKENIZER, "--input={inputs}/empty.txt", "--vocab_size=300", "--out={out}/t.json"),
        "--input=", None, ("t.json",)),
    "train_tokenizer: --out of no known kind": (
        (_TOKENIZER, "--input={inputs}/2_kb.txt", "--vocab_size=300", "--out={out}/t.bin"),
        "--out=", None, ("t.bin",)),
    "train_tokenizer: no --input": (
        (_TOKENIZER, "--vocab_size=300", "--out={out}/t.json"), "--input", "config.data", ()),
    "train_tokenizer: no such input": (
        (_TOKENIZER, "--input={inputs}/absent.txt", "--vocab_size=300", "--out={out}/t.json"),
        "--input=", "config.data", ("t.json",)),
    "train_tokenizer: an existing --out": (
        (_TOKENIZER, "--input={inputs}/2_kb.txt", "--vocab_size=300",
         "--out={inputs}/tok_existing.json"), "--out=", None, ()),
    "prepare_data: zero seq_len": (
        (_PREPARE, "--input={inputs}/2_kb.txt", "--tokenizer=byte", "--seq_len=0",
         "--out_dir={out}/shards"), "--seq_len=0", None, ("shards",)),
    "prepare_data: into an existing dataset": (
        (_PREPARE, "--input={inputs}/2_kb.txt", "--tokenizer=byte", "--seq_len=32",
         "--out_dir={inputs}/shards"), "--out_dir=", None, ()),
    "prepare_data: seq_len longer than the text": (
        (_PREPARE, "--input={inputs}/2_kb.txt", "--tokenizer=byte", "--seq_len=5000",
         "--out_dir={out}/shards"), "--seq_len=5000", None, ("shards",)),
    "soak_chaos: a config the settings refuse (a script validating its own config)": (
        ("scripts/soak_chaos.py", "--num_steps=6", "--out={out}/soak.json",
         "--config.model.num_layers=1"), "config.sync.num_fragments=24", None, ("soak.json",)),
    "sample: no such workdir": (
        (_SAMPLE, "--workdir={out}/absent"), "--workdir=", None, ("absent",)),
    "sample: a workdir without checkpoints": (
        (_SAMPLE, "--workdir={inputs}/run_without_checkpoints"), "holds no job checkpoint", None,
        ()),
}


@pytest.mark.parametrize("row", _PROCESS_ROWS.values(), ids=_PROCESS_ROWS.keys())
def test_command_mistake_is_one_line_exit_2_and_writes_nothing(row, inputs, tmp_path):
  args, names, unwanted, outputs = row
  before = _snapshot(inputs)
  out = _command(*(a.format(inputs=inputs, out=tmp_path) for a in args))
  lines = _message_lines(out.stderr)
  assert out.returncode == errors.EXIT_BAD_INPUT, out.stderr[-3000:]
  assert 1 <= len(lines) <= 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert names in lines[0], lines
  assert unwanted is None or unwanted not in out.stderr, lines
  assert not any((tmp_path / o).exists() for o in outputs), os.listdir(tmp_path)
  assert _snapshot(inputs) == before


@pytest.mark.parametrize("script", [_TOKENIZER, _PREPARE, _SAMPLE])
def test_script_help_exits_0(script):
  out = _command(script, "--helpshort")
  assert out.returncode == 0 and "--" in out.stdout, out.stderr[-2000:]
