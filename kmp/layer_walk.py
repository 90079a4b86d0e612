"""The one walk over a model's layers, and the one way their paths are named.

:func:`walk` meets every layer below a model (or any layer) once, depth first, each
before the layers inside it: a model's ``layers``, then every layer's tracked sublayers
(``_flatten_layers``), so nested models, a ``MultiHeadAttention``'s projections and a
KerasHub backbone's attention and norms inside each transformer block are met. A layer
that cannot be asked for its sublayers has none: the walk never fails on a layer.

A layer's path is the names from below the root down to it, joined by ``/``:
``block0_attention/softmax``, or ``gpt/block0_attention/softmax`` in a model that nests
``gpt``. ``kmp.audit`` shows these paths, ``kmp.probe`` reports them and
``kmp.keep_float32`` returns and selects them, so a path one of them gives is one the
others take.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras

__all__ = ["Visit", "calls_replaced", "sublayers", "walk"]


@dataclasses.dataclass(frozen=True)
class Visit:
    """A layer met by the walk: its path and what surrounds it.

    Attributes:
        path: Its path (the module docstring says how it is named).
        layer: The layer.
        siblings: The layers of its container, itself included, in order.
        parents: The enclosing layers that are not models, outermost first.
        children: Its own layers (:func:`sublayers`), which the walk meets next.
    """

    path: str
    layer: Any
    siblings: tuple[Any, ...]
    parents: tuple[Any, ...]
    children: tuple[Any, ...]

    @property
    def is_nested_model(self) -> bool:
        """A model inside the root that holds layers (the audit shows those, not it)."""
        return isinstance(self.layer, keras.Model) and bool(self.children)


def sublayers(layer: Any) -> list[Any]:
    """The layers directly inside ``layer``: a model's ``layers``, then its tracked ones.

    Tracked ``InputLayer`` objects are left out (a model's own inputs stay in its
    ``layers``); whatever cannot be read counts as no layer.
    """
    found: list[Any] = []
    if isinstance(layer, keras.Model):
        with contextlib.suppress(Exception):  # else the tracked sublayers below
            found.extend(layer.layers)
    try:
        tracked = list(layer._flatten_layers(include_self=False, recursive=False))
    except Exception:
        tracked = []
    ids = {id(x) for x in found}
    found.extend(
        x for x in tracked if id(x) not in ids and not isinstance(x, keras.layers.InputLayer)
    )
    return found


def walk(root: Any, *, inputs: bool = True) -> Iterator[Visit]:
    """Yield every layer below ``root`` once, depth first, each before its own layers.

    Args:
        root: A Keras model or layer; it is not visited itself.
        inputs: Whether ``InputLayer`` objects are yielded (the audit shows them; they
            compute nothing, so the probe and ``keep_float32`` leave them out).
    """
    seen: set[int] = {id(root)}

    def visit(children: list, prefix: str, parents: tuple) -> Iterator[Visit]:
        siblings = tuple(children)
        for layer in children:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            path = f"{prefix}{getattr(layer, 'name', '?')}"
            subs = sublayers(layer)
            if inputs or not isinstance(layer, keras.layers.InputLayer):
                yield Visit(path, layer, siblings, parents, tuple(subs))
            if subs:
                inner = parents if isinstance(layer, keras.Model) else (*parents, layer)
                yield from visit(subs, f"{path}/", inner)

    yield from visit(sublayers(root), "", ())


@contextlib.contextmanager
def calls_replaced(
    layers: Iterable[keras.layers.Layer], replace: Callable[[keras.layers.Layer], Callable]
) -> Iterator[None]:
    """Give each layer the ``call`` that ``replace(layer)`` returns, on the instance, for a while.

    How the probe and ``kmp.quantize`` see every call of chosen layers inside one run of a
    model: the replacement (which usually calls the layer's own ``call``) is set on the
    instance, and on exit each layer gets back exactly what it had (its class's ``call``,
    or a ``call`` set on the instance before).

    Args:
        layers: The layers.
        replace: Given a layer, the callable to use as its ``call``.
    """
    replaced: list[tuple[keras.layers.Layer, Any]] = []
    try:
        for layer in layers:
            own = layer.__dict__.get("call")
            object.__setattr__(layer, "call", replace(layer))
            replaced.append((layer, own))
        yield
    finally:
        for layer, own in replaced:
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)
