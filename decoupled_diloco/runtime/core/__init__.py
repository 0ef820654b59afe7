"""The runtime's core: the learner loop, the syncer and what they exchange; no transport, no control."""
