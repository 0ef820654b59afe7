"""What a run writes down and reads back: checkpoints, job state, the event tape, goodput."""
