"""The ``kmp`` command-line commands, one module each.

Each module is split as parser / command / main:

* ``configure(parser)`` adds the command's arguments to an ``argparse`` parser;
* ``run(args) -> int`` does the work and returns the exit status;
* ``main(argv=None) -> int`` parses ``argv`` and calls ``run`` (``python -m kmp.commands.X``).

:mod:`kmp.cli` collects them under one ``kmp`` program; a command's module is its
name with ``-`` spelled ``_`` (``install-horovod``: :mod:`kmp.commands.install_horovod`).
"""

COMMANDS: dict[str, str] = {
    "doctor": "Show versions, Horovod build facts, hardware and the policy 'auto' picks.",
    "audit": "Audit a saved Keras model's layer dtypes; exit 1 when it is not ok.",
    "launch": "Run a training script on N processes under horovodrun.",
    "bench": "Run kmp's benchmarks and write bench/results/.",
    "cluster": "Make a multi-host cluster on this Linux machine (network namespaces, sshd).",
    "install-horovod": (
        "Build Horovod 0.28.1 against this environment's TensorFlow (NCCL on GPUs), cached "
        "and verified."
    ),
}
