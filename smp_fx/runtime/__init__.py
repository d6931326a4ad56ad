"""The pipeline runtime: ``smp.step`` and microbatching, the lowering of schedules to a
rank's ops, the one executor that runs them, the conductor that lets the step function's
threads take turns, and the transports that move values between stages."""
