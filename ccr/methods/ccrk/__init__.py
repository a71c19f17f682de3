"""``ccrk``: the method's LightningModule (``module``) and its private parts (``fusion_init``,
``hard_sampling``, ``one_to_k``)."""

from ccr.methods.ccrk.module import CCRk

__all__ = ["CCRk"]
