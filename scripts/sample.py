r"""Text from a trained run: loads its newest checkpoint's global model and continues a prompt.

  .venv/bin/python scripts/sample.py --workdir=workdir/tiny_cpu --prompt="ROMEO:" --num_tokens=200
  .venv/bin/python scripts/sample.py --workdir=DIR --prompt=TEXT --temperature=0.8 --top_k=40 \
      [--seed=0] [--checkpoint=N] [--checkpoint_dir=DIR/checkpoints] [--tokenizer=PATH]

The global model is the syncer's Theta (decoupled, diloco and streaming modes) or the one model of a
dp run, from the newest job checkpoint that reads back whole (a run writes one at its end when
config.checkpoint.every_steps > 0). The model's shape and its tokenizer come from the checkpoint
itself, so no config is needed. Prints the prompt and its continuation; temperature 0 is greedy.
"""

import os
import re
import sys
import time

from absl import flags

from decoupled_diloco import errors
from decoupled_diloco.lm import sampling
from decoupled_diloco.lm import tokenizers
from decoupled_diloco.runtime.records import checkpoints

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's config.workdir.")
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text to continue.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 200, "New tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 40, "Draw from the k most likely tokens; 0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of the draws.")
_CHECKPOINT = flags.DEFINE_integer("checkpoint", None, "Checkpoint number; default the newest.")
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "The run's config.checkpoint.dir; default WORKDIR/checkpoints.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "Tokenizer (byte or a .model/.json path); default the run's "
    "config.data.tokenizer, as recorded in the checkpoint.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: flags take the form --name=value")
  for flag in (_WORKDIR, _CHECKPOINT_DIR):
    if flag.value is not None and "://" not in flag.value and not os.path.isdir(flag.value):
      raise errors.InputError(f"--{flag.name}={flag.value}: no such directory")
  directory = _CHECKPOINT_DIR.value or os.path.join(_WORKDIR.value, "checkpoints")
  flag = "--checkpoint_dir" if _CHECKPOINT_DIR.value else "--workdir"
  try:
    saved = checkpoints.read_model(directory, _CHECKPOINT.value)
  except checkpoints.CheckpointError as err:
    which = f"--checkpoint={_CHECKPOINT.value}" if _CHECKPOINT.value is not None else flag
    raise errors.InputError(f"{which}: {err}") from err
  spec = _TOKENIZER.value or saved.config_value("data.tokenizer")
  tokenizer = tokenizers.load(spec, field="--tokenizer" if _TOKENIZER.value else
                              "the run's config.data.tokenizer")
  try:
    prompt = tokenizer.encode(_PROMPT.value)
    start = time.perf_counter()
    new = sampling.generate(saved.model_cfg, saved.params, prompt, num_tokens=_NUM_TOKENS.value,
                            temperature=_TEMPERATURE.value, top_k=_TOP_K.value, seed=_SEED.value)
  except ValueError as err:  # sampling names its argument: --num_tokens, --temperature, --top_k
    raise errors.InputError(f"--{err}" if re.match(r"^(num_tokens|temperature|top_k)=", str(err))
                            else f"--prompt: {err}") from err
  seconds = time.perf_counter() - start
  print(f"[{saved.path}: {saved.source}'s model at step {saved.clock}, tokenizer {tokenizer.name}, "
        f"temperature {_TEMPERATURE.value}, top_k {_TOP_K.value}, seed {_SEED.value}; "
        f"{len(new)} tokens in {seconds:.1f} s]", file=sys.stderr)
  print(_PROMPT.value + tokenizer.decode(new))


if __name__ == "__main__":
  errors.run_main(main)
