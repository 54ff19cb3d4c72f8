"""Run folders and results: reading a run folder (folders.py, runs.py), saving and caching results (storage.py), sending
them to TensorBoard and drawing their figures (publish.py, figures.py)."""
