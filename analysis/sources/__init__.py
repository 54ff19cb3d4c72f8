"""Where models and images come from: a run's checkpoint or a model from elsewhere (models.py), the real ViT-S/14
converted without a network (pretrained.py), and image folders and the bundled photos (images.py)."""
