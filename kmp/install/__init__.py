"""Installing and checking the stack: Horovod's build and ``kmp doctor``'s facts.

* :mod:`kmp.install.plan`: what to install (pure; standard library only, because
  ``launch/setup.sh`` runs it before anything is installed);
* :mod:`kmp.install.build`: building, caching, installing and verifying Horovod's wheel;
* :mod:`kmp.install.progress`: a long build step's log file and progress lines;
* :mod:`kmp.install.cuda`: the CUDA toolkit and NCCL for a GPU build;
* :mod:`kmp.install.record`: a Python environment's facts and the build record;
* :mod:`kmp.install.stack_report`: the facts ``kmp doctor`` reports;
* :mod:`kmp.install.checks`: ``kmp doctor``'s warnings, pure checks of those facts.

The command lines are :mod:`kmp.commands.install_horovod` and :mod:`kmp.commands.doctor`.
Importing this package imports nothing.
"""
