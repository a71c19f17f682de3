"""The consistency report: which instances rank differently across languages (``make report``).

``build_report(folders, out, top)`` writes ``report.html`` (per-language recall, the distribution
of per-image rank spread that MRV averages, the images whose ranks disagree most, two runs side by
side) and ``ranks.csv`` (every image's rank per language and direction). See docs/report.md.
"""
