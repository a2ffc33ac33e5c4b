"""One corpus directory per multi-rank layout test module."""

import pytest


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))
