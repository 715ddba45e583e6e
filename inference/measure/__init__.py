"""Measurement: ``bench`` (running, resume, report), ``bench-tree``, ``tune`` and the baselines they compare against."""
