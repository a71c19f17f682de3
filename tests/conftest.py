"""Test-session settings: one torch thread per test process.

``make test`` runs two pytest workers on a 2-core machine; two OpenMP threads each would
oversubscribe the cores and make small-tensor tests several times slower.
"""

import torch

torch.set_num_threads(1)
