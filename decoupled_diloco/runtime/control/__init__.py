"""What drives a run: supervision, the syncer's keeper, job restarts, progress output."""
