"""Run storage beyond one machine's disk: object stores (S3 and S3-compatible, GCS, any
filesystem ``pyarrow.fs`` resolves) as a run directory's durable home.

- :mod:`.remote`: a URL opened as a remote directory, with deadlines, retries and a probe
  that turns bad settings into one line;
- :mod:`.mirror`: the background upload of what a process writes in its local run
  directory, checkpoints atomic (manifest last), never in a step's way;
- :mod:`.fetch`: a remote run read back into a fresh local directory, for ``--resume``,
  ``export`` and ``report``, with the newest checkpoint the remote journal reaches.

The run directory's layout stays :mod:`erlay.actors.rundir`'s; this room only moves files.

May import: erlay.supervisor.
"""
