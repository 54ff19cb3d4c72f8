"""Images to analyse that are not a recipe's data set: a folder of your own photos, or the photos that ship in
scikit-image and scikit-learn, prepared the way the model was trained to see them.

- :func:`preprocessing` is a model's own input pipeline from timm's pretrained configuration
  (``timm.data.resolve_data_config`` + ``create_transform``): its resize (shorter side to ``size / crop_pct``, the
  configuration's interpolation), centre crop, mean and std; the input size is the size the model was built at
  (a DINOv2 built at 224 has a pretrained configuration of 518).
- :func:`folder_images` reads every image file under a folder (sorted paths; PIL: JPEG, PNG, WebP, BMP, TIFF, ...)
  through that pipeline. Labels come from the ImageFolder layout (one subfolder per class, every image in one);
  a flat folder is unlabeled (label -1): the measures that need no labels run, the others say so.
- :func:`bundled_photos` is a fixed real image set that needs no network: the 17 photographs that ship with
  scikit-image (``skimage.data``: astronaut, chelsea, coffee, rocket, hubble_deep_field, immunohistochemistry, retina,
  camera, moon, coins, clock, brick, grass, gravel, cell, page, text; greyscale ones repeated to 3 channels) and
  scikit-learn (``china.jpg``, ``flower.jpg``) -- 19 photos. Each gives its whole-image view (the model's own resize
  and centre crop) and seeded random crops: area 8-60% of the photo, aspect ratio 3/4-4/3 (log-uniform), a random
  horizontal flip, resized to the model's input size with the configuration's interpolation (what
  torchvision's ``RandomResizedCrop`` draws, from a ``numpy.random.default_rng(seed)`` of its own, so the views are
  the same on every machine). The label of a view is its photo: k-NN, probes and clustering then ask whether a
  layer tells crops of different photos apart (an easy, real task; not ImageNet classes). The crops of one photo are
  not independent images: :attr:`ImageSet.groups` keeps each analysis view's photo, so that a bootstrap resamples the
  19 photos (a folder's images are each their own group).

:class:`ImageSet` is what the suite needs of a data bundle (analysis and probe-train images, labels, normalisation),
so these images go through the same suite, cache, figures and reports as a run's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from train.splits import TensorBatches

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"}
SKIMAGE_PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "camera",
    "moon",
    "coins",
    "clock",
    "brick",
    "grass",
    "gravel",
    "cell",
    "page",
    "text",
)
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")
BUNDLED = "photos"  # the name of the bundled set on the command line (--images photos) and in the API
CROP_AREA = (0.08, 0.6)
CROP_RATIO = (3 / 4, 4 / 3)


class ImageError(ValueError):
    """Images that cannot be read or used; the message is one sentence for the user."""


@dataclass
class ImageSet:
    """Analysis and probe-train images (uint8 [N, 3, S, S], already resized and cropped) with their normalisation.

    ``groups`` [N]: the independent unit each analysis image belongs to, what a bootstrap over the images resamples
    (analysis/studies/stats.py ``groups=``): the bundled photos' views carry their photo's index (16 crops of one photo
    are not 16 independent images), a folder's images are each their own (None: each image its own).
    ``population`` says in words what an interval over those units is about ("the 19 photos", "these 40 images").
    ``probe_groups`` [M]: the same units of the probe-train images when they share them (the bundled photos' probe
    crops: their photo's index), else None."""

    analysis: TensorBatches
    probe_train: TensorBatches
    num_classes: int
    class_names: list
    mean: torch.Tensor
    std: torch.Tensor
    meta: dict = field(default_factory=dict)
    groups: np.ndarray | None = None
    population: str = ""
    probe_groups: np.ndarray | None = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mean.to(x.device).view(1, -1, 1, 1)
        s = self.std.to(x.device).view(1, -1, 1, 1)
        return (x.float() / 255.0 - m) / s

    @property
    def labelled(self) -> bool:
        return bool(len(self.analysis.labels)) and int(self.analysis.labels.min()) >= 0


def preprocessing(model: torch.nn.Module, img_size: int | None = None) -> dict:
    """The preprocessing of ``model``'s family (analysis/families/: timm's data configuration, a transformers image
    processor's, open_clip's) at the size it was built for (or ``img_size``): input_size, interpolation, mean, std,
    crop_pct, crop_mode, as timm's eval transform takes them."""
    from analysis.families import family_of

    cfg = dict(family_of(model).preprocessing(model))
    size = img_size or cfg["input_size"][-1]
    cfg["input_size"] = (3, int(size), int(size))
    return cfg


def _pil_steps(cfg: dict):
    """timm's eval transform for ``cfg`` without its ToTensor / Normalize (the images are kept as uint8)."""
    from timm.data import create_transform

    t = create_transform(**cfg, is_training=False)
    return [s for s in t.transforms if type(s).__name__ not in ("MaybeToTensor", "ToTensor", "Normalize")]


def _to_uint8(img) -> torch.Tensor:
    a = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(a.copy()).permute(2, 0, 1)


def _apply(steps, img):
    for s in steps:
        img = s(img)
    return img


def folder_images(path: str | Path, cfg: dict) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(uint8 images [N, 3, S, S], labels [N] (-1: unlabeled), class names) from every image file under ``path``."""
    from PIL import Image, UnidentifiedImageError

    root = Path(path).expanduser()
    if not root.is_dir():
        raise ImageError(
            f"image folder '{path}' does not exist: pass a folder of image files (or '{BUNDLED}' for the bundled "
            "photos)."
        )
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
    )
    if not files:
        raise ImageError(
            f"no image files under '{path}' (looked for {', '.join(sorted(IMAGE_SUFFIXES))}): put your images there."
        )
    rel = [f.relative_to(root) for f in files]
    labelled = all(len(r.parts) == 2 for r in rel) and len({r.parts[0] for r in rel}) >= 2
    names = sorted({r.parts[0] for r in rel}) if labelled else []
    steps = _pil_steps(cfg)
    xs = []
    for f in files:
        try:
            with Image.open(f) as im:
                xs.append(_to_uint8(_apply(steps, im.convert("RGB"))))
        except (UnidentifiedImageError, OSError) as e:
            raise ImageError(
                f"'{f}' is not an image PIL can read ({type(e).__name__}): remove it or convert it."
            ) from None
    labels = torch.tensor([names.index(r.parts[0]) for r in rel] if labelled else [-1] * len(files), dtype=torch.long)
    return torch.stack(xs), labels, names


def _bundled_pil() -> list[tuple[str, object]]:
    """The bundled photos as (name, PIL RGB image)."""
    from PIL import Image

    try:
        import skimage.data as skd
        from sklearn.datasets import load_sample_image
    except ImportError:
        raise ImageError(
            f"the bundled photos ('{BUNDLED}') come with scikit-image and scikit-learn: run 'pip install scikit-image "
            "scikit-learn' (or install vitlab's dev extra, pip install -e '.[dev]')."
        ) from None
    out = []
    for n in SKIMAGE_PHOTOS:
        a = np.asarray(getattr(skd, n)())
        a = np.repeat(a[..., None], 3, axis=2) if a.ndim == 2 else a[..., :3]
        out.append((n, Image.fromarray(a.astype(np.uint8))))
    for n in SKLEARN_PHOTOS:
        out.append((Path(n).stem, Image.fromarray(load_sample_image(n))))
    return out


def _crop_box(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A random-resized-crop box (left, top, right, bottom): area CROP_AREA of the photo, aspect ratio CROP_RATIO
    (log-uniform), as torchvision's RandomResizedCrop draws it (10 tries, then the centre crop of the whole image)."""
    area = w * h
    for _ in range(10):
        a = area * rng.uniform(*CROP_AREA)
        r = float(np.exp(rng.uniform(np.log(CROP_RATIO[0]), np.log(CROP_RATIO[1]))))
        cw, ch = int(round(np.sqrt(a * r))), int(round(np.sqrt(a / r)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x0, y0, x0 + cw, y0 + ch
    s = min(w, h)
    return (w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s


def bundled_photos(
    cfg: dict, views: int = 16, seed: int = 0, whole: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``views`` views of each bundled photo (the whole-image view first when ``whole``, then seeded random crops):
    uint8 [19 * views, 3, S, S], labels = the photo's index, the photo names."""
    from PIL import Image
    from timm.data.transforms import str_to_pil_interp

    size = int(cfg["input_size"][-1])
    interp = str_to_pil_interp(cfg.get("interpolation", "bicubic"))
    steps = _pil_steps(cfg)
    rng = np.random.default_rng(seed)
    xs, ys, names = [], [], []
    for k, (name, im) in enumerate(_bundled_pil()):
        names.append(name)
        for v in range(views):
            if whole and v == 0:
                view = _apply(steps, im)
            else:
                view = im.crop(_crop_box(*im.size, rng)).resize((size, size), interp)
                if rng.random() < 0.5:
                    view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            xs.append(_to_uint8(view))
            ys.append(k)
    return torch.stack(xs), torch.tensor(ys, dtype=torch.long), names


def image_set(
    images,
    model: torch.nn.Module,
    probe_images=None,
    img_size: int | None = None,
    views: int = 16,
    probe_views: int = 24,
    seed: int = 0,
) -> ImageSet:
    """The :class:`ImageSet` for ``images`` (a folder path, or :data:`BUNDLED`) as ``model`` sees them.

    The bundled photos give ``views`` analysis views per photo (seed ``seed``) and ``probe_views`` other crops per
    photo to train probes and k-NN on (seed ``seed + 1``). A folder gives the analysis images; ``probe_images`` (a
    folder with the same class subfolders) the probe-train images, else there are none."""
    cfg = preprocessing(model, img_size)
    mean, std = torch.tensor(cfg["mean"], dtype=torch.float32), torch.tensor(cfg["std"], dtype=torch.float32)
    if str(images) == BUNDLED:
        x, y, names = bundled_photos(cfg, views, seed)
        px, py, _ = bundled_photos(cfg, probe_views, seed + 1, whole=False)
        source = (
            f"bundled photos: {len(names)} photos x {views} views (seed {seed}); probe-train {probe_views} crops each "
            f"(seed {seed + 1})"
        )
        groups, population = y.numpy().copy(), f"the {len(names)} photos"  # a view's label is its photo's index
        probe_groups = py.numpy().copy()
        probe = f"other crops (seed {seed + 1}) of the same {len(names)} photos"
    else:
        x, y, names = folder_images(images, cfg)
        source = f"{len(x)} images from {images}"
        groups, population, probe_groups = np.arange(len(x)), f"these {len(x)} images", None
        probe = f"the images of {probe_images}" if probe_images is not None else "no probe images"
        if probe_images is not None:
            px, py, pnames = folder_images(probe_images, cfg)
            if pnames != names:
                raise ImageError(
                    f"the probe images' class folders ({', '.join(pnames) or 'none'}) differ from the analysis images' "
                    f"({', '.join(names) or 'none'}): give both folders the same class subfolders."
                )
        else:
            px, py = x[:0], y[:0]
    meta = {
        "source": source,
        "preprocessing": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "hash": hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16],
        "population": population,
        "groups": len(np.unique(groups)),
        "probe": probe,
    }
    return ImageSet(
        TensorBatches(x, y),
        TensorBatches(px, py),
        max(len(names), 1),
        names,
        mean,
        std,
        meta,
        groups,
        population,
        probe_groups,
    )
