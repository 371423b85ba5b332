"""Evaluation of vision encoders (DINOv2, ViT): fidelity to the dense model, a linear probe
on LFW faces, throughput.

* Embeddings of an image: the final (normed) hidden state's CLS token and the mean of its
  patch tokens (DINOv2's two linear-evaluation features; Oquab et al., 2023).
* Fidelity against a reference (the dense model) on the bundled photos and their
  augmentations (``images:test``): mean cosine of the CLS embeddings (``cls_cosine``) and
  of the mean-pooled ones (``mean_cosine``), and k-nearest-neighbour agreement
  (``knn_agreement``: for every image, the share of its ``k`` nearest other images by
  cosine of the concatenated [CLS, mean] embedding that the reference also ranks in its
  top ``k``, averaged).
* ``lfw_accuracy``: a closed-form ridge classifier (float64, features standardised with the
  training split's statistics, targets +-1, ``lambda`` = ``ridge`` x number of features)
  on [CLS, mean] features of the LFW subset's fixed ``calib`` split (50 faces + 50
  non-faces), accuracy on the ``test`` split: deterministic, no iterations.
* ``images_per_s``: batches of ``batch_size`` random images at ``size``, best of
  ``repeats`` timed runs after one warm-up.

Task metrics registered for searches (:mod:`prunelab.eval.task_metric`): ``embed-cos``
(mean of ``cls_cosine`` and ``mean_cosine``), ``knn-agree``, ``lfw-acc``.

Seeds: block redundancy in ViTs, e.g. DINOv2 with 20 % of blocks removed at 1.24x throughput
(similarity-based ViT block redundancy, "Is Attention Required for ViT?"); TAP-Path's
validation-driven block selection on a pathology ViT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from prunelab.data.images import images_for, lfw_images, lfw_split, lfw_tensor
from prunelab.eval.task_metric import TASK_METRICS, TaskMetric
from prunelab.models.adapters import pixel_options

PHOTO_SIZE = 224
LFW_SIZE = 112


@torch.no_grad()
def embed(model, pixels: torch.Tensor, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cls [N, d], mean [N, d])`` float64 from the final hidden states of ``model`` (a
    LoadedModel, a Hugging Face vision model, or any callable ``pixels -> [B, T, d]``)."""
    fn = _forward_fn(model)
    cls, mean = [], []
    for start in range(0, len(pixels), batch_size):
        h = fn(pixels[start:start + batch_size]).double()
        cls.append(h[:, 0].cpu())
        mean.append(h[:, 1:].mean(1).cpu())
    return torch.cat(cls), torch.cat(mean)


def _forward_fn(model):
    if hasattr(model, "adapter"):  # LoadedModel
        dev = next(model.model.parameters()).device
        dtype = next(model.model.parameters()).dtype
        return lambda x: model.adapter.base(
            **model.adapter.model_inputs(x.to(dev, dtype))).last_hidden_state
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        opts = pixel_options(model)
        return lambda x: model(pixel_values=x, **opts).last_hidden_state
    return model


def knn_agreement(ref: torch.Tensor, out: torch.Tensor, k: int = 5) -> float:
    """Mean share of each row's ``k`` nearest other rows (cosine) in ``out`` that are also
    among its ``k`` nearest in ``ref`` (1 = identical neighbourhoods)."""
    k = min(k, len(ref) - 1)
    if k < 1:
        return 1.0

    def top(x):
        x = torch.nn.functional.normalize(x.double(), dim=-1)
        sim = x @ x.T
        sim.fill_diagonal_(-float("inf"))
        return sim.topk(k, dim=-1).indices

    a, b = top(ref), top(out)
    hits = [len(set(a[i].tolist()) & set(b[i].tolist())) for i in range(len(ref))]
    return sum(hits) / (k * len(ref))


def ridge_fit_predict(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor,
                      ridge: float = 1.0) -> torch.Tensor:
    """Closed-form ridge classifier: standardise with the training statistics, solve
    ``(X^T X + lambda I) w = X^T t`` with ``t = +-1`` and a free bias (not penalised),
    ``lambda = ridge * d``; returns the predicted 0/1 labels of ``x_test``."""
    x_train, x_test = x_train.double(), x_test.double()
    mu, sd = x_train.mean(0), x_train.std(0).clamp_min(1e-8)
    a, b = (x_train - mu) / sd, (x_test - mu) / sd
    t = y_train.double() * 2 - 1
    d = a.shape[1]
    w = torch.linalg.solve(a.T @ a + ridge * d * torch.eye(d, dtype=a.dtype), a.T @ (t - t.mean()))
    return ((b @ w + t.mean()) > 0).long()


@dataclass
class LfwData:
    """LFW pixels of both fixed splits at one size, and their labels."""

    train: torch.Tensor
    train_y: torch.Tensor
    test: torch.Tensor
    test_y: torch.Tensor

    @classmethod
    def make(cls, size: int = LFW_SIZE) -> LfwData:
        _, labels = lfw_images()
        tr, te = lfw_split("calib"), lfw_split("test")
        return cls(lfw_tensor(tr, size), torch.from_numpy(labels[tr]),
                   lfw_tensor(te, size), torch.from_numpy(labels[te]))


def lfw_accuracy(model, lfw: LfwData | None = None, batch_size: int = 8,
                 ridge: float = 1.0) -> float:
    """Linear-probe (ridge) face / non-face accuracy on LFW's test split."""
    lfw = lfw or LfwData.make()
    feats = [torch.cat(embed(model, x, batch_size), dim=1) for x in (lfw.train, lfw.test)]
    pred = ridge_fit_predict(feats[0], lfw.train_y, feats[1], ridge)
    return float((pred == lfw.test_y).double().mean())


def fidelity(ref: tuple[torch.Tensor, torch.Tensor], out: tuple[torch.Tensor, torch.Tensor],
             k: int = 5) -> dict[str, float]:
    """``cls_cosine``, ``mean_cosine`` and ``knn_agreement`` of embeddings ``out`` against
    ``ref`` (both ``(cls, mean)`` pairs from :func:`embed`)."""
    cos = [float(torch.cosine_similarity(r, o, dim=-1).mean()) for r, o in zip(ref, out,
                                                                               strict=True)]
    return {"cls_cosine": cos[0], "mean_cosine": cos[1],
            "knn_agreement": knn_agreement(torch.cat(ref, 1), torch.cat(out, 1), k)}


@torch.no_grad()
def images_per_second(model, size: int = PHOTO_SIZE, batch_size: int = 8,
                      repeats: int = 3, clock: str = "wall") -> float:
    """Best-of-``repeats`` throughput of full forwards on random ``[batch, 3, size, size]``.
    ``clock="cpu"`` divides by the process's CPU time instead of the wall time: on a
    shared machine with one torch thread it is the uncontended time (images per
    CPU-second)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be wall or cpu, got {clock!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    fn = _forward_fn(model)
    x = torch.randn(batch_size, 3, size, size, generator=torch.Generator().manual_seed(0))
    fn(x[:1])
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        fn(x)
        best = min(best, timer() - start)
    return batch_size / max(best, 1e-9)


def evaluate_vision(lm, data: str | None = None, reference=None, samples: int | None = 32,
                    batch_size: int = 8, speed: bool = True, size: int = PHOTO_SIZE,
                    lfw_size: int = LFW_SIZE, reference_cache: dict | None = None) -> dict:
    """Every vision metric of ``lm`` (see module docstring): ``lfw_accuracy``, with a
    ``reference`` (default: ``lm`` itself, giving the trivial 1.0s) ``cls_cosine``,
    ``mean_cosine``, ``knn_agreement`` on ``data`` (default ``images:test``), and with
    ``speed`` ``images_per_s``. ``reference_cache`` keeps the reference's embeddings."""
    photos = images_for(data or "images:test", samples=samples, size=size)
    cache = reference_cache if reference_cache is not None else {}
    key = (photos.sha256, batch_size)
    if key not in cache:
        cache[key] = embed(reference if reference is not None else lm, photos.input_ids,
                           batch_size)
    result = fidelity(cache[key], embed(lm, photos.input_ids, batch_size))
    result["lfw_accuracy"] = lfw_accuracy(lm, LfwData.make(lfw_size), batch_size)
    if speed:
        result["images_per_s"] = images_per_second(lm, size, batch_size)
    result.update({"data": photos.to_dict(), "samples": photos.samples, "image_size": size,
                   "lfw_image_size": lfw_size, "model": getattr(lm, "spec", "")})
    if reference is not None:
        result["reference"] = getattr(reference, "spec", "")
    return result


def display_rows(res: dict) -> list[tuple[str, str]]:
    """``(label, value)`` rows of an :func:`evaluate_vision` result for the CLI table."""
    ref = res.get("reference") or "itself"
    rows = [("photos (size)", f"{res['samples']} ({res['image_size']} px)"),
            (f"CLS cosine to {ref}", f"{res['cls_cosine']:.5f}"),
            (f"mean-pooled cosine to {ref}", f"{res['mean_cosine']:.5f}"),
            (f"kNN agreement with {ref}", f"{res['knn_agreement']:.4f}"),
            (f"LFW probe accuracy ({res['lfw_image_size']} px)", f"{res['lfw_accuracy']:.4f}"),
            ("parameters", f"{res.get('params', 0):,}")]
    if "images_per_s" in res:
        rows.append(("images/s", f"{res['images_per_s']:.2f}"))
    return rows


# ---------------------------------------------------------------- task metrics

def _photo_metric(name: str, pick, lm, data: str = "images:calib", samples: int = 16,
                  size: int = PHOTO_SIZE, batch_size: int = 8, k: int = 5,
                  seed: int = 0) -> TaskMetric:
    """``seed``: the photos' augmentation stream (``images:calib`` with ``seed=0`` are the
    default calibration photos; another seed gives photos held out from them)."""
    photos = images_for(data, samples=samples, seed=seed, size=size).input_ids
    ref = embed(lm, photos, batch_size)
    return TaskMetric(name, lambda m: pick(fidelity(ref, embed(m, photos, batch_size), k)),
                      higher_is_better=True)


@TASK_METRICS.register(
    "embed-cos", description="mean cosine of CLS and mean-pooled embeddings to the dense "
                             "model on photos (vision)")
def _embed_cos(lm, **options) -> TaskMetric:
    return _photo_metric("embed-cos", lambda f: (f["cls_cosine"] + f["mean_cosine"]) / 2,
                         lm, **options)


@TASK_METRICS.register(
    "knn-agree", description="k-nearest-neighbour agreement with the dense model on photos "
                             "(vision)")
def _knn_agree(lm, **options) -> TaskMetric:
    return _photo_metric("knn-agree", lambda f: f["knn_agreement"], lm, **options)


@TASK_METRICS.register(
    "lfw-acc", description="LFW face / non-face ridge-probe accuracy (vision); default "
                           "split=calib: fit on half the probe split, score the other half "
                           "(split=test: fit on the probe split, score the test split)")
def _lfw_acc(lm, size: int = LFW_SIZE, batch_size: int = 8, ridge: float = 1.0,
             split: str = "calib") -> TaskMetric:
    lfw = LfwData.make(size)
    if split == "calib":  # validation inside the probe split: fit on one half, score other
        half = torch.arange(len(lfw.train)) % 4 < 2  # keeps 25 faces + 25 non-faces each
        lfw = LfwData(lfw.train[half], lfw.train_y[half], lfw.train[~half],
                      lfw.train_y[~half])
    return TaskMetric("lfw-acc", lambda m: lfw_accuracy(m, lfw, batch_size, ridge),
                      higher_is_better=True)
