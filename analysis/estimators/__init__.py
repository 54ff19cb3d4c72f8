"""Estimators the measures share: linear CKA and its minibatch HSIC (similarity.py), the other similarity scores
(kernels.py: RBF CKA and the float64 Grams; neighbours.py: mutual k-NN and CKNNA; procrustes.py: Procrustes distance
and angle; cca.py: SVCCA and PWCCA) and their permutation nulls (permutation.py), all public from
``analysis.similarity``; linear probes (probing.py), pooled features (features.py), attention-map reductions
(attention_maps.py) and noise floors (baselines.py)."""
