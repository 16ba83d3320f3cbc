"""What a run measures and reports, and the re-plan policy that reads the measurements.

:mod:`.monitor` records each step (JSON lines, TensorBoard); :mod:`.events` is the run's event log;
:mod:`.host` and :mod:`.gpustats` sample host and GPU counters; :mod:`.held` counts the bytes a rank
holds; :mod:`.live` raises alerts while the run goes; :mod:`.summary` turns the records into the report
and the measured profile, :mod:`.timeline` into a per-rank timeline and :mod:`.page` into the report
page; :mod:`.policy` holds the small pure decisions (when a mismatch is worth a re-plan, a busy host, a
memory shortfall). It imports only :mod:`..sync` (for the communicators' byte counters).
"""
