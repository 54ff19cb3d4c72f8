"""vitlab training: recipes, data, models, the Accelerate loop, checkpoints and callbacks.

Entry point: ``accelerate launch -m train --recipe recipes/default.yaml [--set key=value ...] [--resume]``.
"""
