"""Calibration: measure this machine into a ``DeviceSpec`` that plans are priced with.

``smp-fx calibrate`` is a thin shell over it; it sits beside ``smp_fx.cli``, above the
runtime it measures, with ``cost_model.calibrate`` measuring the device figures below it.
See docs/cli.md, 'smp-fx calibrate', and docs/performance.md for the figures behind each
fit.
"""
