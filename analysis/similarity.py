"""Representational similarity: the public place of the estimators and their permutation nulls.

    from analysis.similarity import cka, rbf_cka, mutual_knn, permutation_test

Scores of two representations X [n, ...] and Y [n, ...] of the same n examples (features flattened per example;
torch tensors or numpy arrays), each defined, sourced and costed in its module's docstring:

    cka(X, Y, unbiased=True)               linear CKA (Kornblith et al. 2019), unbiased HSIC_1 (Song et al. 2012)
    MinibatchCKA(unbiased=True)            all-pairs linear CKA summed over minibatches (Nguyen et al. 2021)
    represent(tokens, how)                 a layer's tokens -> one row per example (flatten, cls, mean_spatial)
    hsic_gram(X, unbiased)                 one minibatch's centred linear Gram and its HSIC scale
    rbf_cka(X, Y, threshold=1.0, unbiased=False)
                                           CKA with Kornblith et al. 2019's RBF kernel (median-distance bandwidth)
    mutual_knn(X, Y, k=10)                 mutual k-NN alignment (Huh et al. 2024)
    cknna(X, Y, k=10)                      CKNNA, as Huh et al. 2024's code defines it
    procrustes_distance(X, Y)              2 - 2 ||X^T Y||_* (Ding et al. 2021); smaller is more alike
    procrustes_angle(X, Y)                 arccos ||X^T Y||_* (Williams et al. 2021); smaller is more alike
    svcca(X, Y, keep=0.99)                 SVCCA (Raghu et al. 2017)
    pwcca(X, Y)                            projection-weighted CCA (Morcos et al. 2018)

Their permutation nulls (analysis/estimators/permutation.py):

    permutation_test(score, X, Y, n_perm=1000, seed=0, groups=None)  -> Permuted: score, null mean / SD, z, excess, p
    permutation_map(score, Xs, Ys, n_perm=1000, seed=0, groups=None) -> PermutedMap: layer x layer maps, p, FWER p
    group_permutations(groups, n_perm, seed)                          the null's draws when groups are the unit
    distinct_permutations(groups)                                     how many distinct ones there are
    PermutedMinibatchCKA(unbiased, n_perm, seed)                      minibatch CKA and its null in one pass
    score_map(score, Xs, Ys)                                          the layer x layer map alone

The exchangeable unit is the example (row), or with ``groups=`` (a label per row: the photo of each crop) the group:
whole groups are permuted, within their size class.

Options go by keyword through ``functools.partial``: ``permutation_test(partial(mutual_knn, k=5), X, Y)``.

As a measure (at checkpoints, offline, and between two models with ``--against``): ``similarity``,
analysis/measures/similarity.py.
"""

from analysis.estimators.cca import pwcca, svcca
from analysis.estimators.kernels import rbf_cka
from analysis.estimators.neighbours import cknna, mutual_knn
from analysis.estimators.permutation import (
    Permuted,
    PermutedMap,
    PermutedMinibatchCKA,
    distinct_permutations,
    fwer_adjusted,
    group_permutations,
    permutation_map,
    permutation_test,
    score_map,
)
from analysis.estimators.procrustes import procrustes_angle, procrustes_distance
from analysis.estimators.similarity import MinibatchCKA, cka, hsic_gram, represent

__all__ = [
    "MinibatchCKA",
    "Permuted",
    "PermutedMap",
    "PermutedMinibatchCKA",
    "cka",
    "cknna",
    "distinct_permutations",
    "fwer_adjusted",
    "group_permutations",
    "hsic_gram",
    "mutual_knn",
    "permutation_map",
    "permutation_test",
    "procrustes_angle",
    "procrustes_distance",
    "pwcca",
    "rbf_cka",
    "represent",
    "score_map",
    "svcca",
]
