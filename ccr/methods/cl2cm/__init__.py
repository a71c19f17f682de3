"""``cl2cm``: the method's LightningModule (``module``) and its private parts (``cross_lingual``,
``optimal_transport``)."""

from ccr.methods.cl2cm.module import CL2CM

__all__ = ["CL2CM"]
