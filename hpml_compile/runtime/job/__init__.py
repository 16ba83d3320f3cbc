"""The processes of a run: launching ranks, supervising them, and the closed loop that re-plans between segments.

:mod:`.launcher` starts the ranks with torchrun (``hpml-compile run``) and :mod:`.scriptlaunch` a user's
script; :mod:`.supervisor` restarts failed segments and applies re-plans, on one host; :mod:`.multihost` does so
across hosts, which meet in the job's store (:mod:`.hosts`: host 0 decides, a silent host is lost);
:mod:`.rank_entry` and
:mod:`.worker` are one rank's process (parse the run's options, rebuild the model, train); :mod:`.lifeline`
ends ranks whose supervisor died; :mod:`.adapt` is the closed loop on rank 0 (measure, decide, re-plan
or move rows); :mod:`.spawn` starts gloo ranks on this host with a deadline (tests and the link probe).
This is the top room: it may import every other room.
"""
