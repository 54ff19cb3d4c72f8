"""Measurements, one file each: the file name is the measure name used in recipes and on the CLI (analysis/measure.py)."""
