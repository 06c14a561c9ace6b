"""One job on Ray: the driver that a RayJob or ``fp8rl run`` starts, and what it holds.

- ``driver``: the entry point (``rljob.run_dir.DRIVER_MODULE``): reads the spec, starts or joins
  Ray, runs the job, writes its end; ``supervisor`` restarts a driver that died;
- ``job_run``: :class:`JobRun`, one job's life from warm-up to the last checkpoint, metrics and
  the mismatch SLO each step;
- ``ray_cluster``: starting or joining Ray with token auth; ``ray_workers``: the trainer,
  generator and model-grader actors; ``actor_group``: the group of them the loop drives;
- ``grader_actors``: the graders' sandboxed processes on Ray actors, one per CPU;
- ``prom_exporter``: the job's metrics on Prometheus; ``numerics``: what a run's numbers depend on.

Imports go down to ``rl``, ``tasks``, ``models``, ``engines`` and below, never back up.
"""
