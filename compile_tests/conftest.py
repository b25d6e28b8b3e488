import os
import sys

# Registrations never change within a run, but a stale on-disk cache from an older build of
# the extension must not serve an old graph (docs/design.md, "torch.compile behaviour").
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test compiles from scratch, in a single process (no RANK/WORLD_SIZE)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
