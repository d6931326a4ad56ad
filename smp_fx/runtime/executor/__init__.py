"""The executor: schedules lowered to this rank's op list and run, the conductor's turns,
the step's diagnostics (flight record, failures)."""
