"""The stages on top of the two libraries: one small file per stage (prepare, collect, train, export, eval, demo),
the run config that composes every section (:mod:`recipes.config`), and the ``eagle`` command (:mod:`recipes.cli`).

The only layer that imports both ``eagle`` (the runtime library) and ``train`` (the training library).
"""
