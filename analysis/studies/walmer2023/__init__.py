"""Walmer et al. 2023, "Teaching Matters: Investigating the Role of Supervision in Vision Transformers" (CVPR), at
small scale: the same ViT on the same data taught three ways (configurations ``supervised``, ``dino``, ``mae``), the
study plug-in of recipes/studies/walmer2023.yaml and its GPU variant.

Sections before the claims (sections.py): DINO read by its teacher, the objectives at the study budget with their
k-NN share of supervised against Walmer's Table 1, the controls of the semantic claims (a random-initialised network
and the raw pixels: controls.py), and the figures several claims share. The claims, each with its passage, rule and
the code that computes it: claims.py; the numbers of one model: numbers.py; what they read: reads.py.
"""

from analysis.studies.claims import Paper
from analysis.studies.walmer2023.claims import CLAIMS
from analysis.studies.walmer2023.numbers import OBJECTIVES
from analysis.studies.walmer2023.sections import SECTIONS


def applies(configs: dict) -> bool:
    """Whether a study compares objectives: at least two of its configurations are named after one."""
    return len(set(configs) & set(OBJECTIVES)) >= 2


PAPER = Paper(
    name="walmer2023",
    title="Teaching matters: the training objective",
    claims=CLAIMS,
    sections=SECTIONS,
    applies=applies,
    defaults={"seeds": [0, 1, 2]},
    source="analysis/studies/walmer2023/",
)
