"""Helpers the tests share (the test modules import nothing from one another):

* ``models``: the example models (the one loader tests use) and small hand-written ones;
* ``numerics``: ``init`` and ``Pair``, smp-fx trained against the unpartitioned model;
* ``compare``: the names of the tensors that differ, for multi-process test bodies;
* ``dist``: run a function on real torch.distributed ranks (processes);
* ``threads``: ranks played by threads, for the checkpoint commit protocol;
* ``ckpt``: a tied model, a trained plain optimizer and stage layouts for checkpoint tests.
"""
