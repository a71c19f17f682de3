"""``make pretrain``: ``python -m experiments.pretrain [overrides]``."""

from experiments.pretrain.backbones import main

main()
