"""Measurements, one file each: the file name is the measure name used in recipes and on the CLI
(analysis/engine/measure.py).

``head_subsets.py`` measures across two models (a ViT's heads against a ResNet's layers, ``--against``), so it is
a function, :func:`analysis.measures.head_subsets.head_subset_cka`, rather than a registered single-model Measure.
"""
