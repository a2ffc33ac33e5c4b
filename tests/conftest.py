import os
import sys

# tools/ holds entry-point scripts, not a package: let tests import them by name.
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # The slow modules first (stable otherwise): tools/run_tests.sh hands whole modules to its workers
    # in this order, so the longest ones start early and the workers finish together
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))

ROOT = os.path.dirname(TOOLS)
if ROOT not in sys.path:  # so tests can import their shared helpers as tests.distributed
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request):
    """Each GPU test compiles from a reset dynamo: the GPU runs put many compiled models in one process,
    and one that met dynamo's recompile limit would run partly eager, so a test comparing two compiled
    runs bit for bit failed there and passed alone (session 39, tests/core/test_cuda_graph.py). The CPU
    suite keeps its warm caches (its processes start warm on purpose, tools/run_tests.sh)."""
    if request.node.get_closest_marker("gpu") is not None:
        torch._dynamo.reset()
    yield
