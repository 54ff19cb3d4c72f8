"""Weighted k-NN classification on backbone features (DINO's ``knn_classifier``, Caron et al. 2021 §4.1 / eval_knn.py;
Walmer et al. 2023 §6.1 apply it to every block). One definition, used by the trainer's monitor for objectives
without labels (``eval/knn_top1`` at every evaluation) and by the analysis measure ``knn`` (analysis/measures/knn.py).

With a memory bank of training features ``B`` [n, d] with labels ``y_B`` and a query ``q`` [d]:

    b_i  = B_i / ||B_i||,  q' = q / ||q||                     L2-normalised features
    s_i  = <q', b_i>                                          cosine similarity to every bank entry
    N(q) = the k entries with the largest s_i                 k = 20 (Walmer §6.1; DINO uses 20 for ImageNet)
    w_i  = exp(s_i / T)                                       T = 0.07 (DINO)
    S_c  = sum_{i in N(q), y_B[i] = c} w_i                     class score
    pred = argmax_c S_c                                       (ties: the lowest class index, torch.argmax)

When the bank has fewer than k entries, k is reduced to the bank size (all entries vote). float64 throughout.
"""

from __future__ import annotations

import torch
from torch import Tensor

K = 20
TEMPERATURE = 0.07
_CHUNK = 1024  # queries per similarity chunk


def knn_predict(
    bank: Tensor,
    bank_labels: Tensor,
    queries: Tensor,
    k: int = K,
    temperature: float = TEMPERATURE,
    num_classes: int | None = None,
) -> Tensor:
    """Weighted k-NN predictions [Q] of ``queries`` [Q, d] from ``bank`` [n, d] (definition in the module docstring),
    on ``queries``' device, in chunks of queries."""
    if bank.ndim != 2 or queries.ndim != 2 or bank.shape[1] != queries.shape[1]:
        raise ValueError(
            f"bank [n, d] and queries [Q, d] must share d, got {tuple(bank.shape)} and {tuple(queries.shape)}"
        )
    if bank.shape[0] == 0:
        raise ValueError("the memory bank is empty")
    if bank_labels.shape != (bank.shape[0],):
        raise ValueError(f"bank_labels must be [{bank.shape[0]}], got {tuple(bank_labels.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dev = queries.device
    labels = bank_labels.to(dev).long()
    c = int(num_classes) if num_classes else int(labels.max()) + 1
    k = min(int(k), bank.shape[0])
    b = torch.nn.functional.normalize(bank.to(dev, torch.float64), dim=1)
    out = []
    for q in queries.split(_CHUNK):
        q = torch.nn.functional.normalize(q.to(torch.float64), dim=1)
        sim, idx = (q @ b.T).topk(k, dim=1)
        scores = torch.zeros(q.shape[0], c, dtype=torch.float64, device=dev)
        scores.scatter_add_(1, labels[idx], (sim / temperature).exp())
        out.append(scores.argmax(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=dev)


def knn_accuracy(
    bank: Tensor,
    bank_labels: Tensor,
    queries: Tensor,
    query_labels: Tensor,
    k: int = K,
    temperature: float = TEMPERATURE,
    num_classes: int | None = None,
) -> float:
    """Top-1 accuracy (fraction in [0, 1]) of :func:`knn_predict` on ``queries`` with labels ``query_labels``."""
    if queries.shape[0] == 0:
        raise ValueError("no queries")
    pred = knn_predict(bank, bank_labels, queries, k, temperature, num_classes)
    return (pred.cpu() == query_labels.cpu().long()).double().mean().item()


@torch.no_grad()
def features(accelerator, backbone, loader, normalize) -> tuple[Tensor, Tensor]:
    """The backbone's output (its pooled features: the model has no classifier head) for every image of a prepared
    eval loader, gathered from all processes (padding dropped), with the labels."""
    was_training = backbone.training
    backbone.eval()
    feats, labels = [], []
    for x, y in loader:
        f, y = accelerator.gather_for_metrics((backbone(normalize(x)).float(), y))
        feats.append(f)
        labels.append(y)
    backbone.train(was_training)
    return torch.cat(feats), torch.cat(labels)


def knn_monitor(accelerator, backbone, bank_loader, query_loader, normalize, num_classes: int) -> dict:
    """The training-time monitor of an objective without labels: k-NN top-1 (k=20, T=0.07) of the eval split
    (queries) against the probe-train split (bank), on the backbone's pooled features. Every process gathers all
    features, so every process computes the same number."""
    bank, bank_y = features(accelerator, backbone, bank_loader, normalize)
    q, q_y = features(accelerator, backbone, query_loader, normalize)
    top1 = knn_accuracy(bank, bank_y, q, q_y, num_classes=num_classes)
    return {"top1": top1, "knn_top1": top1, "n": int(q.shape[0]), "n_bank": int(bank.shape[0])}
