"""Fixtures of the rollout tests: the tiny model taught the tool format once per session (both engine end-to-end
modules start from it; it only reads it)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tool_format_model(tiny_model_dir, tmp_path_factory):
    from tests.helpers.rollout_run import teach_tool_format

    return teach_tool_format(tiny_model_dir, tmp_path_factory.mktemp("tool-format") / "sft")
