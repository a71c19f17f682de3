"""Blocks shared by every method: the base LightningModule, encoders, fusion, heads, losses,
distributed gathering and the optimiser, each once (as timm keeps ``layers/`` beside ``models/``).

Method files import what they need from the submodules; nothing here registers a method.
"""
