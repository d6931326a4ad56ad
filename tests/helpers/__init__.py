"""Helpers the tests share (fixtures every test gets live in ``tests/conftest.py``):

* ``models``: the example models (the one loader tests use) and small hand-written ones;
* ``numerics``: ``init`` and ``Pair``, smp-fx trained against the unpartitioned model;
* ``reference``: ``train_plain``, the unpartitioned model trained in one process;
* ``compare``: the names of the tensors that differ, for multi-process test bodies;
* ``dist``: run a function on real torch.distributed ranks (processes);
* ``threads``: ranks played by threads, for the checkpoint commit protocol;
* ``ckpt``: a tied model, a trained plain optimizer, stage layouts and a save killed
  half-way, for checkpoint tests;
* ``file_order``: the plugin (registered by ``conftest.py``) running the longest files first.
"""
