"""The machinery of ``kmp cluster``: a multi-host cluster on one Linux machine.

* :mod:`kmp.cluster.blueprint`: the pure decisions, the plan (names, addresses, namespaces,
  configurations);
* :mod:`kmp.cluster.ops`: acting on the plan (``up``, ``down``, ``status``, ``exec_on``);
* :mod:`kmp.cluster.state`: errors, system commands, the recorded state and its lock.

The command line itself is :mod:`kmp.commands.cluster`.
"""
