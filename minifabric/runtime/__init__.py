"""The life of one rank, from its start to its end, with one owner per stage.

1. **launch** (:mod:`~minifabric.runtime.launcher`, :mod:`~minifabric.runtime.run_script`): start
   the other local processes (``acc.launch()`` re-runs the script, ``acc.launch(fn)`` spawns, and
   ``minifabric run`` goes through torchrun), each rank through the script runner, and end them all
   when one fails. :mod:`~minifabric.runtime.environment` says who started this process (torchrun,
   SLURM, LSF, MPI, Kubeflow, Ray Train, or nobody) and where rank 0 is.
2. **rendezvous** (:mod:`~minifabric.runtime.rendezvous`): check the world and meet every other rank
   within the join timeout, before the default process group is created on the store.
3. **join** (:mod:`~minifabric.runtime.rank`): the strategy's :class:`~minifabric.runtime.rank.Rank`
   joins the process group, installs the signal handling (:mod:`~minifabric.runtime.signals`) and
   starts the hang watcher (:mod:`~minifabric.runtime.hang`) and the heartbeat
   (:mod:`~minifabric.runtime.heartbeat`, which reads the kernel through
   :mod:`~minifabric.runtime.liveness`).
4. **steps and stop** (:mod:`~minifabric.runtime.rank`): the rank counts optimizer steps and
   remembers the last committed checkpoint; ``should_stop`` is the agreement of every rank on a
   preemption signal or Ray Train's notice (:mod:`~minifabric.runtime.ray`).
5. **leave or fail**: at a normal end the rank *leaves* the process group together with the others
   (:meth:`~minifabric.runtime.rank.Rank.leave`); a rank that fails, is interrupted or is stopped
   *ends* at once, says why in one line and posts it for the others (:mod:`~minifabric.runtime.signals`,
   :func:`~minifabric.runtime.rank.end`); the heartbeat names a rank that stopped or ended silently.

What is true of the whole process (which rank it is, whether it failed) lives in one record,
reached through :func:`minifabric.runtime.rank.current`; besides the process-wide switches of
:mod:`minifabric.process`, it is the one place of minifabric allowed module-level state.
"""
