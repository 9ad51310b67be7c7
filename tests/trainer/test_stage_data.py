"""Both kinds of a trainer stage's data implement the whole StageData protocol, so the loop needs no kind check."""
from __future__ import annotations

import inspect

import pytest

from rstar_hpc.trainer.rl import RLStageData
from rstar_hpc.trainer.sft import SFTStageData
from rstar_hpc.trainer.stage_data import StageData

METHODS = [n for n, v in vars(StageData).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_protocol_names_what_the_loop_calls():
    assert set(METHODS) == {"next", "train", "now_holds", "state_dict", "load_state_dict", "commit", "describe"}
    assert "initial_state" in StageData.__annotations__


@pytest.mark.parametrize("cls", [SFTStageData, RLStageData])
def test_each_kind_defines_every_method_with_the_protocols_parameters(cls):
    for name in METHODS:
        assert name in vars(cls), f"{cls.__name__} lacks {name}"   # its own, not the protocol's empty body
        assert list(inspect.signature(getattr(cls, name)).parameters) == \
            list(inspect.signature(getattr(StageData, name)).parameters), f"{cls.__name__}.{name}"
    assert "initial_state" in inspect.getsource(cls.__init__)


def test_sft_data_is_settled_by_its_checkpoint_alone():
    """SFT's now_holds and commit are no-ops, and it adds nothing to the log line (no instance state is read)."""
    data = object.__new__(SFTStageData)
    assert data.now_holds(3) is None and data.commit("step-1", {}) is None and data.describe({}) == ""
