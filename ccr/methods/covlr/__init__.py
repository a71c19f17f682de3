"""``covlr``: the method's LightningModule (``module``) and its private parts (``augment``,
``init_weights``, ``intra_modal``, ``meta``, ``patch_masking``, ``towers``)."""

from ccr.methods.covlr.module import CoVLR

__all__ = ["CoVLR"]
