"""``mclip``: the method's LightningModule (``module``) and its private parts (``distillation``,
``translation``)."""

from ccr.methods.mclip.module import MCLIP

__all__ = ["MCLIP"]
