"""Estimators the measures share: linear CKA and its minibatch HSIC (similarity.py), linear probes (probing.py), pooled
features (features.py), attention-map reductions (attention_maps.py) and noise floors (baselines.py)."""
