import os
import zlib

import pytest
import torch
from fast_interpreter import patch_language_once_per_launch

GPU = torch.cuda.is_available()
patch_language_once_per_launch()  # (the interpreter's redundant work; kernels run as before)


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """Every torch.empty comes back NaN-filled: an output element a kernel forgets fails its check."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles as in a fresh process: torch.compile's caches emptied first. One
    process compiling every family's models would otherwise pass dynamo's recompile limit
    (8 per code object) in the functions the families share, and fullgraph fails there."""
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def seed_from_test_name(request):
    """Random inputs differ from test to test but not from run to run, whatever the order or
    selection of tests: a failure seen once is seen again."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device():
    """Where the small tests run: the GPU if there is one, else the CPU through the interpreter."""
    if GPU:
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: the Triton kernels cannot run")
    return "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs at real sizes in bfloat16 there)")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)


@pytest.fixture
def four_gpus(monkeypatch):
    """The distributed benchmark's parent sees a host of 4 GPUs (its ranks' work is faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
