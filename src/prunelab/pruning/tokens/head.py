"""Multi-depth feature recovery and a lightweight gated task head (TAP-Path).

After depth and token pruning, the last block's features alone lose information that
earlier blocks still hold. TAP-Path recovers it by combining features of several depths in
the task head, weighted by a learned gate. Here every depth ``d`` gives the feature
``f_d = [CLS, mean of patch tokens]`` of its (final-normed) hidden state, standardised with
the training split's statistics; the head computes input-adaptive gate weights
``g = softmax(a + G x_bar)`` over the depths (``x_bar`` the mean of the depth features),
the mixed feature ``sum_d g_d f_d`` and a linear classifier on it. Trained full-batch with
Adam (fixed seed, fixed steps, weight decay) on the frozen features: deterministic.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.eval.vision import LFW_SIZE, LfwData


@torch.no_grad()
def depth_features(encoder, pixels: torch.Tensor, depths: tuple, batch_size: int = 8
                   ) -> torch.Tensor:
    """``[N, D, 2 d]`` float32 features ``[CLS, mean patch]`` at each of ``depths`` (0-based
    blocks) of a :class:`~prunelab.pruning.tokens.TokenPrunedEncoder`."""
    out = []
    for start in range(0, len(pixels), batch_size):
        _, feats = encoder(pixels[start:start + batch_size], depths=tuple(depths))
        out.append(torch.stack([torch.cat([h[:, 0], h[:, 1:].mean(1)], -1) for h in feats],
                               1).float())
    return torch.cat(out)


class GatedDepthHead(nn.Module):
    """Gate over ``depths`` feature vectors of size ``dim`` and a linear classifier."""

    def __init__(self, depths: int, dim: int, classes: int = 2):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(depths))
        self.gate = nn.Linear(dim, depths, bias=False)
        nn.init.zeros_(self.gate.weight)
        self.classifier = nn.Linear(dim, classes)
        self.register_buffer("mu", torch.zeros(depths, dim))
        self.register_buffer("sd", torch.ones(depths, dim))

    def weights(self, feats: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` gate weights of ``feats`` ``[N, D, dim]`` (raw features)."""
        x = (feats - self.mu) / self.sd
        return torch.softmax(self.bias + self.gate(x.mean(1)), dim=-1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = (feats - self.mu) / self.sd
        g = torch.softmax(self.bias + self.gate(x.mean(1)), dim=-1)
        return self.classifier((g[..., None] * x).sum(1))


def train_gated_head(feats: torch.Tensor, labels: torch.Tensor, classes: int = 2,
                     steps: int = 300, lr: float = 0.01, weight_decay: float = 0.01,
                     seed: int = 0) -> GatedDepthHead:
    """A :class:`GatedDepthHead` fitted to ``feats`` ``[N, D, dim]`` / ``labels`` ``[N]``
    by full-batch Adam on the cross-entropy (deterministic for ``seed``)."""
    torch.manual_seed(seed)
    head = GatedDepthHead(feats.shape[1], feats.shape[2], classes)
    head.mu.copy_(feats.mean(0))
    head.sd.copy_(feats.std(0).clamp_min(1e-6))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(feats), labels)
        loss.backward()
        opt.step()
    return head.eval()


def lfw_gated_accuracy(encoder, depths: tuple, size: int | None = None, batch_size: int = 8,
                       seed: int = 0) -> dict:
    """TAP-Path's head on the LFW subset: the gated head trained on the probe (``calib``)
    split's multi-depth features, accuracy on the ``test`` split, and the mean gate weight
    of each depth on the test images."""
    lfw = LfwData.make(size or LFW_SIZE)
    train = depth_features(encoder, lfw.train, depths, batch_size)
    test = depth_features(encoder, lfw.test, depths, batch_size)
    head = train_gated_head(train, lfw.train_y, seed=seed)
    with torch.no_grad():
        acc = float((head(test).argmax(-1) == lfw.test_y).double().mean())
        gates = head.weights(test).mean(0).tolist()
    return {"lfw_gated_accuracy": acc, "depths": list(depths), "gate_weights": gates}
