"""The synthetic world's pretrained backbones (a tiny XLM-R, ViT and mBART): how they are trained
(``text``, ``image``, ``seq2seq``) and built into their cache from the data's handle
(``backbones``); ``python -m ccr.experiments.pretrain`` is ``make pretrain``."""
