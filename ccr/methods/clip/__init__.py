"""``clip``: the method's LightningModule (``module``)."""

from ccr.methods.clip.module import CLIPModule

__all__ = ["CLIPModule"]
