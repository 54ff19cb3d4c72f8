"""Raghu et al. 2021, "Do Vision Transformers See Like Convolutional Neural Networks?" (NeurIPS), at small scale, with
Walmer et al. 2023's offset heads: the study plug-in of recipes/studies/raghu2021.yaml and its variants.

Sections before the claims: the pilot runs (which regime can show local heads), the positive control of the locality
detectors, and which configuration the locality claims read (pilots.py). The claims, each with its
passage, rule and the code that computes it: claims.py; the numbers of one model: numbers.py; the CKA floors: floors.py.
"""

from analysis.studies.claims import Paper
from analysis.studies.raghu2021 import ablation  # noqa: F401  (declares the test-time ablation claim)
from analysis.studies.raghu2021.claims import CLAIMS
from analysis.studies.raghu2021.pilots import PILOT, control_section, locality_section, pilot_section

PAPER = Paper(
    name="raghu2021",
    title="Reproduction",
    claims=CLAIMS,
    sections=(pilot_section, control_section, locality_section),
    applies=lambda configs: {"vit_cls", "resnet"} <= set(configs),
    defaults={"seeds": [0, 1, 2]},
    source="analysis/studies/raghu2021/",
    pilot=PILOT,
)
