"""kmp.callbacks._ranks: the shared rank helpers and the public verbosity()."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp.distributed
from kmp import callbacks as kcb
from kmp.callbacks import _ranks
from tests.callbacks._helpers import make_model

# --------------------------------------------------------------------------- verbosity


def test_verbosity_chief_and_other_rank(monkeypatch):
    assert kcb.verbosity() == "auto"
    assert kcb.verbosity(2) == 2
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
    assert kcb.verbosity() == 0
    assert kcb.verbosity(1) == 0


@pytest.mark.parametrize("bad", [3, -1, "loud"])
def test_verbosity_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="verbose"):
        kcb.verbosity(bad)


@pytest.mark.parametrize("bad", [True, 1.0, None])
def test_verbosity_rejects_bad_types(bad):
    with pytest.raises(TypeError, match=r"verbosity\(chief\).*verbose"):
        kcb.verbosity(bad)


# --------------------------------------------------------------------------- helpers


def test_rank_helpers_read_kmp_distributed_at_call_time(monkeypatch, capsys):
    assert (_ranks.this_rank(), _ranks.world_size(), _ranks.is_chief()) == (0, 1, True)
    _ranks.chief_print("from the chief")
    assert capsys.readouterr().out == "from the chief\n"
    monkeypatch.setattr(kmp.distributed, "rank", lambda: 3)
    monkeypatch.setattr(kmp.distributed, "size", lambda: 4)
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
    assert (_ranks.this_rank(), _ranks.world_size(), _ranks.is_chief()) == (3, 4, False)
    _ranks.chief_print("from rank 3")
    assert capsys.readouterr().out == ""


def test_to_float_accepts_variables_tensors_and_scalars():
    assert _ranks.to_float(keras.Variable(0.5)) == 0.5
    assert _ranks.to_float(keras.ops.convert_to_tensor(2.0)) == 2.0
    assert _ranks.to_float(np.float16(1.5)) == 1.5
    assert _ranks.to_float(3) == 3.0


def test_model_optimizer_and_innermost():
    inner = keras.optimizers.SGD(0.1)
    cb = keras.callbacks.Callback()
    cb.set_model(make_model(keras.optimizers.LossScaleOptimizer(inner)))
    optimizer = _ranks.model_optimizer(cb, "Test")
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert _ranks.innermost_optimizer(optimizer) is inner
    assert _ranks.innermost_optimizer(inner) is inner
    cb.set_model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))  # not compiled
    with pytest.raises(ValueError, match=r"Test needs a compiled model.*model\.compile"):
        _ranks.model_optimizer(cb, "Test")
