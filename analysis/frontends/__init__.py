"""The ways in: the command line (cli.py, ``python -m analysis``), the notebook API (api.py), the training-time
callbacks (callbacks.py), the cached runner over a run's checkpoints (runner.py) and the measures' table for the docs
(measure_table.py)."""
