"""Blocks that two or more methods share: encoders, fusion, heads, contrastive losses, distributed
gathering, the optimiser. A block one method alone uses lives in that method's package
(``ccr.methods.<name>``), as timm keeps a model's private parts with the model.

Method modules import what they need from the submodules; nothing here registers a method.
"""
