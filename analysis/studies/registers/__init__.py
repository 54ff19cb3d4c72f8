"""Darcet et al. 2024, "Vision Transformers Need Registers" (ICLR): high-norm outlier tokens and the register tokens
that remove them, at small scale -- the study plug-in of recipes/studies/registers.yaml (the default ViT with 0 and
with 4 registers, three seeds each, token_norms at every checkpoint).

Darcet et al. report the outliers in large, long-trained ViTs (ViT-L and larger, after about a third of training); a
6-block ViT after 4 epochs may show none. "Outliers appear" is judged on the study's model and, on a model smaller
than ViT-L, reported as outside the paper's regime (the verdict says what that model does). The register
claims need outliers in the register-free runs, whatever the size: without them there is nothing for registers to
remove, and those claims are "not testable at this budget" with the numbers.
"""

from analysis.studies.claims import Paper
from analysis.studies.registers.claims import CLAIMS, outliers_section
from analysis.studies.registers.control import control_section

PAPER = Paper(
    name="registers",
    title="Registers and high-norm tokens",
    claims=CLAIMS,
    sections=(outliers_section, control_section),
    applies=lambda configs: {"vit_reg0", "vit_reg4"} <= set(configs),
    defaults={"seeds": [0, 1, 2]},
    source="analysis/studies/registers/",
)
