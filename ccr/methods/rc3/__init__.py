"""``rc3``: the method's LightningModule (``module``) and its private parts
(``euclidean_contrastive``, ``first_stage``, ``regions``, ``seq2seq``)."""

from ccr.methods.rc3.module import RC3

__all__ = ["RC3"]
