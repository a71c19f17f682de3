"""A retrieval demo over a run's evaluation split: ``python -m ccr.demo ckpt=PATH`` (``make demo``).

``ccr.demo.index`` encodes the split once and ranks with the suite's rank engine (no Gradio needed);
``ccr.demo.app`` only displays what the index computes, so the demo shows the numbers the metrics use.
"""
