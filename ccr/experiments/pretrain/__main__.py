"""``make pretrain``: ``python -m ccr.experiments.pretrain [overrides]``."""

from ccr.experiments.pretrain.backbones import main

main()
