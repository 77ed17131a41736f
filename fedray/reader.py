"""The fixed reader: an independent classifier that scores a generator's samples (simulation-only ``diag/*``).

A method's own classifier or teacher reading a generated sample as class y says what that model believes, and it is
trained alongside the generator. The reader is an outside judge: a LeNet-5 (ResNet-8 for images below 12x12) trained
once per dataset on its whole training split, with a fixed budget and seed, cached on disk, frozen, and handed to no
method (it lives in the :class:`~fedray.learning.boundary.DiagnosticProbe`). For generated images in the model's
input space (normalised as the real ones) and, for a conditional generator, the classes they were asked for:

- ``diag/reader_agreement``: the share the reader reads as the asked class (do the samples carry their label?);
- ``diag/reader_class_entropy``: the normalised entropy of the histogram of the classes it reads (1: every class as
  often; near 0: the samples collapse onto few classes);
- ``diag/reader_fid``: the Frechet distance between the generated and the real test images in the reader's feature
  space (its penultimate layer), as FID does with Inception features:
  ||mu_g - mu_r||^2 + Tr(S_g + S_r - 2 (S_g S_r)^(1/2));
- ``diag/reader_test_acc``: the reader's own accuracy on the test set, the ceiling of any agreement.

Cache: ``<cache folder>/reader-<key>.pt`` (the decoded-dataset cache's folder, :mod:`fedray.data.cache`), the key
a digest of the training split's bytes, the architecture and this module's budget, so another dataset, split or
budget trains its own; written under a temporary name and renamed into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedray.data.cache import default_cache_dir
from fedray.data.federated import FederatedData, to_float
from fedray.models import FedModel, build_model

log = logging.getLogger("fedray")

VERSION = 1  #: bumped when the budget or the recipe changes: older cache entries then miss
#: Adam on LeNet-5: 1.6 epochs of Fashion-MNIST, 86.0 % test accuracy, 11 s on one CPU thread
STEPS, BATCH, LR, SEED = 1500, 64, 1e-3, 0


@dataclass
class Reader:
    """The trained, frozen reader and the real test images' feature statistics."""

    model: FedModel
    test_accuracy: float
    real_mean: torch.Tensor  # (D,) float64, the test images' features
    real_cov: torch.Tensor  # (D, D) float64

    def read(self, x: torch.Tensor, asked: torch.Tensor | None) -> dict[str, float]:
        """The ``diag/reader_*`` figures of images ``x`` (N, C, H, W), normalised, asked to be classes ``asked``."""
        feats, read = features_and_classes(self.model, x)
        classes = self.model.num_classes
        hist = torch.bincount(read, minlength=classes).double() / len(read)
        entropy = -(hist[hist > 0] * hist[hist > 0].log()).sum() / np.log(classes)
        out = {"diag/reader_class_entropy": float(entropy), "diag/reader_test_acc": self.test_accuracy,
               "diag/reader_fid": frechet_distance(feats.double(), self.real_mean, self.real_cov)}
        if asked is not None:
            out["diag/reader_agreement"] = float((read == asked.to(read.device)).double().mean())
        return out


@torch.no_grad()
def features_and_classes(model: FedModel, x: torch.Tensor, batch: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader's features (N, D) and read classes (N,) of images ``x``, in batches on the model's device."""
    device = next(model.parameters()).device
    feats = torch.cat([model.features(x[i : i + batch].to(device).float()) for i in range(0, len(x), batch)])
    return feats, model.head(feats).argmax(1)


def frechet_distance(feats: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> float:
    """||mu - mean||^2 + Tr(S + cov - 2 (S cov)^(1/2)) with mu, S the mean and covariance of ``feats`` (N, D)."""
    from scipy import linalg  # loaded here: only a run that reads generated samples pays for it

    mu, s = feats.mean(0), torch.cov(feats.T).cpu().numpy()
    c = cov.cpu().numpy()
    with warnings.catch_warnings():  # ReLU features that never fire make both covariances singular: expected
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        root = linalg.sqrtm(s @ c)
        if not np.isfinite(root).all():  # as pytorch-fid does: a small ridge on both
            ridge = np.eye(len(s)) * 1e-6
            root = linalg.sqrtm((s + ridge) @ (c + ridge))
    root = np.real(root)  # rounding leaves an imaginary part of the order of the float error
    diff = (mu - mean).cpu().numpy()
    return float(diff @ diff + np.trace(s) + np.trace(c) - 2 * np.trace(root))


def architecture(shape: tuple[int, int, int]) -> str:
    return "lenet5" if min(shape[1:]) >= 12 else "resnet8"


def cache_key(data: FederatedData) -> str:
    digest = hashlib.sha256()
    for part in (f"v{VERSION}|{data.dataset}|{STEPS}|{BATCH}|{LR}|{SEED}|{data.num_classes}".encode(),
                 np.ascontiguousarray(data.train_x).tobytes(), np.ascontiguousarray(data.train_y).tobytes()):
        digest.update(part)
    return digest.hexdigest()[:24]


def train_reader(data: FederatedData, device: torch.device) -> FedModel:
    """The reader trained from its seed on the whole training split (``STEPS`` Adam steps of ``BATCH``)."""
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    torch.manual_seed(SEED)  # the initial weights (the global RNG, as build_model documents); restored below
    model = build_model(architecture(shape), shape, data.num_classes).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    rng = np.random.default_rng(SEED)
    model.train()
    for _ in range(STEPS):
        idx = np.sort(rng.choice(len(data.train_y), size=min(BATCH, len(data.train_y)), replace=False))
        x = to_float(torch.from_numpy(np.array(data.train_x[idx])).to(device), data.mean, data.std)
        loss = F.cross_entropy(model(x), torch.from_numpy(np.array(data.train_y[idx])).long().to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def load_reader(data: FederatedData, device: torch.device, cache_dir: str | Path | None = None) -> Reader:
    """The dataset's reader: from the cache, else trained and cached (the run's own RNG state left as it was)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"reader-{cache_key(data)}.pt"
    shape = tuple(int(v) for v in data.train_x.shape[1:])
    model = None
    if path.is_file():
        try:
            model = build_model(architecture(shape), shape, data.num_classes).to(device)
            model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
            model.eval()
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("the cached reader %s could not be read (%s); training it again", path, e)
            model = None
    if model is None:
        state = torch.random.get_rng_state()
        try:
            model = train_reader(data, device)
        finally:
            torch.random.set_rng_state(state)
        _save(model, path)
    for p in model.parameters():
        p.requires_grad_(False)
    test_x = to_float(torch.from_numpy(np.array(data.test_x)).to(device), data.mean, data.std)
    feats, read = features_and_classes(model, test_x)
    accuracy = float((read.cpu() == torch.from_numpy(np.array(data.test_y)).long()).double().mean())
    return Reader(model, accuracy, feats.double().mean(0), torch.cov(feats.double().T))


def _save(model: FedModel, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".reader-", suffix=".tmp")
        os.close(fd)
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
    except OSError as e:  # a cache that cannot be written costs a retraining next time, nothing else
        log.warning("could not cache the reader in %s (%s): the next run trains it again", path.parent, e)
