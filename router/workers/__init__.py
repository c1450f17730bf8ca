"""The worker processes: their pool, launch, state machine, placement and events."""
