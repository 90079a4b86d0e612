"""The machinery of ``kmp launch``: from options to the processes of a job.

* :mod:`kmp.launching.hosts`: ``-H``, hostfile and discovery-output parsing
  (``Host``, ``LaunchError``);
* :mod:`kmp.launching.job`: the job, planned by :func:`~kmp.launching.job.build_command`
  (pure) and run by :func:`~kmp.launching.job.execute` (the one that starts processes);
* :mod:`kmp.launching.engine_env`: ``--engine``, the variables each engine's processes get
  (``engine_env``, ``jax_env``, ``pick_port``, ...);
* :mod:`kmp.launching.elastic`: ``--elastic`` (``ElasticOptions``, ``elastic_args``);
* :mod:`kmp.launching.preflight`: the host checks before a multi-host job;
* :mod:`kmp.launching.processes`: running a command with signals passed on;
* :mod:`kmp.launching.local_run` and :mod:`kmp.launching.discover`: entry points that
  launch command lines run as ``python -m kmp.launching.local_run`` (the JAX engine's
  local launcher) and ``python -m kmp.launching.discover`` (``--elastic --hostfile``).

The command line itself is :mod:`kmp.commands.launch`. Importing this package
imports nothing: ``kmp launch`` stays fast.
"""
