"""New Keras variables that stay on this process: Keras's distribution lifted for a block.

Under a ``keras.distribution`` (the JAX engine's ``DataParallel``) every new Keras
variable is laid out over the devices of every process, which every process must do
together. Work one process does alone (the chief saving a checkpoint, rank 0 printing
``kmp.audit``, whose measured checks build throw-away layers) must not create
variables that way, or the processes' collectives stop matching. The one home of that
rule: :func:`kmp.distributed.alone` and :func:`kmp.audit` use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["local_variables"]


@contextlib.contextmanager
def local_variables() -> Iterator[None]:
    """Lift Keras's distribution inside the block (new variables stay on this process).

    Nothing happens where no distribution is set; the distribution is restored on exit,
    also when the block raises.
    """
    import keras

    current = keras.distribution.distribution()
    if current is None:
        yield
        return
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(current)
