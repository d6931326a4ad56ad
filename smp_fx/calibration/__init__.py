"""Calibration: measure this machine into a ``DeviceSpec`` that plans are priced with.

``smp-fx partition`` and ``DistributedModel`` predict a plan's cost from a device spec;
the built-in specs carry datasheet figures, a calibrated one this machine's. The command
``smp-fx calibrate`` is a thin shell over this package (it parses its flags, calls
``spec.calibrate`` and writes the file). One module per concept:

- ``spec``: ``calibrate(CalibrationOptions, world)``: the order of the fits, each folded
  into the spec with its source;
- ``reference``: the models the fits run (a two-block transformer, a ResNet-style stack,
  a tiny MLP);
- ``in_place``: how much slower ops run inside a model than alone (``fit_scales``,
  ``fit_conv_scale``);
- ``runs``: a model trained and timed with ``smp.step`` under a fresh ``smp.init``;
- ``runtime_fit``: the runtime's own figures fitted through those runs (per action and
  per step, the in-step scales, per message and ``pipelined_scale``);
- ``solve``: the arithmetic the fits share (a two-unknown least squares, the limits).

Layer: beside ``smp_fx.cli``, above the runtime it measures (``smp_fx.model``,
``smp_fx.step``, ``smp_fx.world``); ``cost_model.calibrate`` measures the device figures
below it.
"""
