"""CCR Suite: cross-lingual cross-modal retrieval with PyTorch Lightning.

``ccr.methods`` (one package per method, the contract in ``ccr.methods.base``, the blocks two or
more methods share in ``ccr.methods.layers``), ``ccr.datamodules``, ``ccr.metrics``,
``ccr.experiments`` (the entry points and their YAML configs) and ``ccr.demo``.
"""
