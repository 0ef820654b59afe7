"""scripts/study_common.py: how a study finds the runs it made and what its tables say."""

import importlib.util
import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(name="sc")
def _study_common():
  spec = importlib.util.spec_from_file_location("study_common",
                                                _ROOT / "scripts" / "study_common.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["study_common"] = module  # its dataclass looks its module up by name
  spec.loader.exec_module(module)
  return module


def _finished_run(directory: pathlib.Path, cmd: list[str], loss: float) -> None:
  directory.mkdir(parents=True)
  (directory / "command.json").write_text(json.dumps(cmd))
  (directory / "summary.json").write_text(json.dumps({"final_eval_loss": loss}))


def test_a_run_made_from_another_checkout_is_adopted_not_trained_again(sc, tmp_path, monkeypatch):
  monkeypatch.setenv("STUDY_ROOT", str(tmp_path))
  monkeypatch.setenv("STUDY_READ_ONLY", "1")  # a run it had to make would fail the test
  arm = sc.Arm("M=2", {"num_learners": 2})
  # The same command, made from a checkout at /elsewhere with another python, in a workdir of
  # another name.
  cmd = sc.command({**sc.QUIET, **sc.STUDY_SETTINGS, "num_learners": 2, "num_steps": 5, "seed": 0,
                    "workdir": "/somewhere/else"})
  cmd = ["/elsewhere/.venv/bin/python"] + [
      "--config=/elsewhere/experiments/tiny_cpu.py" if a.startswith("--config=") else a
      for a in cmd[1:]]
  _finished_run(tmp_path / "old", cmd, 2.5)
  results = sc.run_study("x", [arm], [0], base={"num_steps": 5}, fresh=False,
                         figures=lambda workdir, summary: {"loss": summary["final_eval_loss"],
                                                           "workdir": workdir})
  assert results["M=2"][0]["loss"] == 2.5
  assert results["M=2"][0]["workdir"].exists() and not (tmp_path / "old").exists()
  # Another seed is another command: nothing to adopt, and a read-only study says so.
  with pytest.raises(RuntimeError, match="STUDY_READ_ONLY: no finished run"):
    sc.run_study("x", [arm], [1], base={"num_steps": 5}, fresh=False,
                 figures=lambda workdir, summary: {})


def test_runs_of_an_earlier_results_file_are_read_back_and_reported(sc, tmp_path, monkeypatch):
  monkeypatch.setenv("STUDY_ROOT", str(tmp_path / "runs"))
  monkeypatch.setenv("STUDY_READ_ONLY", "1")  # a run it had to make would fail the test
  earlier = tmp_path / "study_x.json"
  earlier.write_text(json.dumps({
      "date": "2026-11-20", "runs": {"M=2": {"0": {"loss": 2.5}}},
      "calibration": {"M=2 calibration": {"0": {"step_s": 0.3}}},
      # a run the earlier file had itself read back keeps the date it was made
      "confirm_runs": {"M=4": {"0": {"loss": 2.4}}},
      "read_back": [{"arm": "M=4", "seed": 0, "date": "2026-11-10"}]}))
  sc.read_previous(str(earlier))
  arms = [sc.Arm("M=2", {"num_learners": 2}), sc.Arm("M=4", {"num_learners": 4})]
  results = sc.run_study("x", arms, [0], base={"num_steps": 5}, fresh=False,
                         figures=lambda workdir, summary: {})
  assert results == {"M=2": {0: {"loss": 2.5}}, "M=4": {0: {"loss": 2.4}}}
  with pytest.raises(RuntimeError, match="STUDY_READ_ONLY: no finished run"):  # a new seed runs
    sc.run_study("x", arms[:1], [1], base={"num_steps": 5}, fresh=False,
                 figures=lambda workdir, summary: {})
  stem = sc.write("x", {"runs": results}, "# x", out_dir=tmp_path / "out")
  report = json.loads(stem.with_suffix(".json").read_text())
  assert report["read_back"] == [{"arm": "M=2", "seed": 0, "date": "2026-11-20"},
                                 {"arm": "M=4", "seed": 0, "date": "2026-11-10"}]
  assert "M=2 seed 0 (2026-11-20); M=4 seed 0 (2026-11-10)" in stem.with_suffix(".md").read_text()


def test_spreads_paired_gaps_and_error_bars(sc):
  results = {"dp": {0: {"loss": 2.0}, 1: {"loss": 2.2}},
             "M=8": {0: {"loss": 2.1}, 1: {"loss": 2.25}}}
  stats = sc.summarize(results, ["loss"])
  assert stats["M=8"]["loss"] == pytest.approx(
      {"mean": 2.175, "min": 2.1, "max": 2.25, "spread": 0.15, "n": 2})
  assert sc.fmt(stats["M=8"]["loss"]) == "2.1750 (2.1000-2.2500)"
  assert sc.fmt(sc.spread([1.5])) == "1.5000"  # one seed: no range
  # The gap is smaller than the seed spread (0.15) but positive on both seeds.
  assert sc.paired(results, "M=8", "dp", key="loss") == "+0.1000 / +0.0500"
  down, up = sc.yerr([stats["dp"]["loss"], stats["M=8"]["loss"]])
  assert down == pytest.approx([0.1, 0.075]) and up == pytest.approx([0.1, 0.075])
  assert sc.markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
