"""Images for vision encoders: bundled photos, augmentations, LFW subset, preprocessing.

Photos ship with installed packages and are found without importing them:
scikit-image's ``skimage/data/`` (astronaut, chelsea, coffee, rocket, motorcycle, hubble
deep field, retina, horse... public domain / CC0 per skimage's docstrings) and matplotlib's
``grace_hopper.jpg``. ``lfw_subset.npy`` holds 200 grey 25 x 25 crops from Labeled Faces in
the Wild; per skimage's ``lfw_subset`` docstring the first 100 are faces and the last 100
non-faces (background crops of the same photos).

Preprocessing is DINOv2's published one: resize the shortest edge to ``size * 256 / 224``
(bicubic), centre-crop ``size``, scale to [0, 1], normalise with the ImageNet mean / std.

Data specs (``images_for``): ``images:test`` = every photo once, then augmented copies;
``images:calib`` = augmented copies only, from a different seed stream, so calibration and
test never share a tensor. ``lfw:test`` / ``lfw:calib`` = the LFW crops (see
:func:`lfw_split`). Augmentations (flip, random crop of 60-100 % of each side, brightness /
contrast / saturation jitter of +-20 %) are deterministic given the seed.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prunelab.errors import ConfigError, DataError

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
                  "motorcycle_left.png", "hubble_deep_field.jpg", "retina.jpg", "horse.png",
                  "ihc.png", "brick.png", "grass.png", "gravel.png", "camera.png",
                  "coins.png", "moon.png", "page.png")


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def photo_paths() -> list[Path]:
    """Bundled photos (skimage's ``data/`` then matplotlib's Grace Hopper), sorted."""
    found = []
    sk = _package_dir("skimage")
    if sk is not None:
        found += [sk / "data" / n for n in SKIMAGE_PHOTOS if (sk / "data" / n).is_file()]
    mpl = _package_dir("matplotlib")
    if mpl is not None:
        gh = mpl / "mpl-data" / "sample_data" / "grace_hopper.jpg"
        if gh.is_file():
            found.append(gh)
    if not found:
        raise DataError("no bundled photos found: install scikit-image==0.26.0 "
                        "(pip install --no-deps) or matplotlib")
    return found


def load_photo(path: Path):
    """The photo as an RGB ``PIL.Image``."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def preprocess(image, size: int = 224) -> torch.Tensor:
    """``[3, size, size]`` float32: shortest edge to ``round(size * 256 / 224)`` (bicubic),
    centre crop, ImageNet normalisation (DINOv2's preprocessing)."""
    from PIL import Image

    short = round(size * 256 / 224)
    w, h = image.size
    scale = short / min(w, h)
    image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))),
                         Image.BICUBIC)
    w, h = image.size
    left, top = (w - size) // 2, (h - size) // 2
    image = image.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


def augment(image, rng: np.random.Generator):
    """A random flip, crop (60-100 % of each side) and colour jitter (+-20 %)."""
    from PIL import Image, ImageEnhance

    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    w, h = image.size
    cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    image = image.crop((x0, y0, x0 + cw, y0 + ch))
    for enh in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enh(image).enhance(float(rng.uniform(0.8, 1.2)))
    return image


def lfw_images() -> tuple[np.ndarray, np.ndarray]:
    """``(images [200, 25, 25] float in [0, 1], labels [200])``: 1 = face (first 100)."""
    sk = _package_dir("skimage")
    path = sk / "data" / "lfw_subset.npy" if sk is not None else None
    if path is None or not path.is_file():
        raise DataError("lfw_subset.npy not found: install scikit-image==0.26.0 "
                        "(pip install --no-deps)")
    images = np.load(path).astype(np.float32)
    labels = np.r_[np.ones(100), np.zeros(100)].astype(np.int64)
    return images, labels


def lfw_split(split: str) -> np.ndarray:
    """Fixed indices into the 200 LFW crops: ``calib`` (the probe-training split) = the
    even positions of each class, ``test`` = the odd ones (50 faces + 50 non-faces each)."""
    idx = np.arange(200)
    if split not in ("calib", "test"):
        raise ConfigError(f"lfw split must be calib or test, got {split!r}")
    return idx[idx % 2 == (0 if split == "calib" else 1)]


def lfw_tensor(indices, size: int = 224) -> torch.Tensor:
    """``[n, 3, size, size]``: the grey crops upscaled (bicubic), repeated to RGB, normalised."""
    images, _ = lfw_images()
    x = torch.from_numpy(images[np.asarray(indices)])[:, None]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic",
                                        align_corners=False).clamp(0, 1).repeat(1, 3, 1, 1)
    return (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


@dataclass(frozen=True)
class ImageBatches:
    """``input_ids``: pixel tensor ``[samples, 3, size, size]`` (named like token batches so
    every block-by-block consumer takes it unchanged) and how it was made."""

    input_ids: torch.Tensor = field(repr=False, compare=False)
    spec: str
    size: int
    samples: int
    seed: int | None
    mode: str
    sha256: str

    @property
    def tokens(self) -> int:
        return self.samples

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "mode": self.mode, "image_size": self.size,
                "samples": self.samples, "seed": self.seed, "sha256": self.sha256}


def _photo_tensors(samples: int, seed: int, originals: bool, size: int) -> torch.Tensor:
    photos = [load_photo(p) for p in photo_paths()]
    out = [preprocess(im, size) for im in photos[:samples]] if originals else []
    rng = np.random.default_rng(seed)
    k = 0
    while len(out) < samples:
        out.append(preprocess(augment(photos[k % len(photos)], rng), size))
        k += 1
    return torch.stack(out)


def images_for(spec: str, samples: int | None = None, seed: int = 0, size: int = 224,
               mode: str | None = None) -> ImageBatches:
    """Pixel batches for a data spec ``images:test|calib`` or ``lfw:test|calib`` (see the
    module docstring); ``samples`` defaults to 32 photos / the whole LFW split."""
    name, _, split = spec.partition(":")
    split = split or mode or "test"
    if name not in ("images", "lfw") or split not in ("test", "calib"):
        raise ConfigError(f"image data must be images:test, images:calib, lfw:test or "
                          f"lfw:calib, got {spec!r}")
    if samples is not None and samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 4096:
        raise ConfigError(f"image size must be an integer in [1, 4096] px, got {size!r}")
    if name == "lfw":
        idx = lfw_split(split)[:samples]
        pixels = lfw_tensor(idx, size)
    else:
        n = 32 if samples is None else samples
        stream = seed if split == "test" else seed + 1_000_003
        pixels = _photo_tensors(n, stream, originals=split == "test", size=size)
    digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
    return ImageBatches(input_ids=pixels, spec=f"{name}:{split}", size=size,
                        samples=len(pixels), seed=seed, mode=split, sha256=digest)
