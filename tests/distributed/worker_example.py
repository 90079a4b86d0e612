"""Worker: run an example's ``main()`` on this rank and report it (tests/test_examples.py).

``python worker_example.py examples/NAME.py`` under horovodrun. ``hvd.init`` is wrapped to
count its calls (the example's own and any kmp would make), then the example's ``main()``
runs; its result, the count and the engine kmp holds go to ``$KMP_TEST_OUT/rank{R}.json``.
"""

import os
import runpy
import sys

import horovod.tensorflow as hvd

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp

calls = []
_init = hvd.init


def counting_init(*args, **kwargs):
    calls.append(1)
    return _init(*args, **kwargs)


hvd.init = counting_init
example = runpy.run_path(sys.argv[1])  # defines main() (its __name__ is not "__main__")
result = example["main"]()
running = kmp.distributed.engine()
result.update(
    hvd_init_calls=len(calls),
    engine=running.name,
    engine_is_the_scripts=getattr(running, "hvd", None) is hvd,
    kmp_world=[kmp.distributed.rank(), kmp.distributed.size()],
)
write_result(result["rank"], result)
