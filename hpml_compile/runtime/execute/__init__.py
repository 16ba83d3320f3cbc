"""Running a build on a rank: the executor, the pipeline over it, and what a training step needs around it.

:mod:`.executor` runs the build's per-rank action lists (in one process or on a rank); :mod:`.pipeline`
is :class:`~.pipeline.Pipeline`, the executor with its process group, retries and measurements;
:mod:`.session` forms the process group on torchrun's store and re-forms it after a transient failure;
:mod:`.data` loads and shards the batches; :mod:`.trainer` runs steps with a data source, evaluation and
checkpoints; :mod:`.checkpoint` and :mod:`.safe_dcp` write and read DCP checkpoints; :mod:`.scaler` is
the loss scaler; :mod:`.gather` assembles the full state dict and outputs; :mod:`.batchcheck` checks a
batch against the build. It imports :mod:`..sync` and :mod:`..observe`, never :mod:`..job`.
"""
