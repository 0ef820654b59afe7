"""The single-controller runtime: learner threads, the syncer, the controller; it moves data.

It calls `algorithm` for every decision about what to merge and how, and `lm` for what is trained,
and it reads only the validated `settings.RunSettings`, never the raw experiment config.
"""
