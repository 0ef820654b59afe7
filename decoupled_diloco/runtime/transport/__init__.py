"""How learners and the syncer are started and reached: in threads, or as Ray actors."""
