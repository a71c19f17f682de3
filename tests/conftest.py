"""Test-session settings: one torch thread per test process.

``make test`` runs two pytest workers on a 2-core machine; two OpenMP threads each would
oversubscribe the cores and make small-tensor tests several times slower. A test that trains
through ``ccr.experiments.train`` applies its config's thread count (rc3's preset: 2); the fixture
below puts one thread back after every test.
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread():
    yield
    torch.set_num_threads(1)
