"""``model.init``: start the global model (and every client model of the same architecture) from given weights
instead of a seeded random draw, as FedD3A starts every model from ImageNet-pretrained weights (Sec. 4).

- A path: a state dict saved with ``torch.save`` (a fedray run's ``model.pt`` of that model is one). Every key
  of the model must be there with the model's shape for the run's data, and no other key: a checkpoint of
  another architecture, input shape or class count is refused by name before any work.
- ``torchvision:<weights>`` (e.g. ``torchvision:ResNet18_Weights.IMAGENET1K_V1``): torchvision's pretrained
  weights (downloaded into torch's cache on first use) for the zoo models built on torchvision's (resnet18,
  resnet50). Their names are torchvision's except ``fc`` = ``head``; the stem (3x3 on the dataset's channels
  instead of ImageNet's 7x7) and the head (the run's classes) are adapted, so those keep their seeded draw when
  their shapes differ. Any other key of another shape is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fedray.errors import ConfigError

TORCHVISION = "torchvision:"
ADAPTED = ("conv1.", "head.")  # the zoo's torchvision models: their own stem and head


def _mismatches(own: dict[str, torch.Tensor], given: dict[str, torch.Tensor], skip=()) -> list[str]:
    return [f"{k}: {tuple(given[k].shape)} given, {tuple(own[k].shape)} wanted" for k in given
            if k in own and given[k].shape != own[k].shape and not k.startswith(skip)]


def _listed(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


@functools.lru_cache(maxsize=4)
def initial_weights(init: str, name: str, input_shape: tuple[int, int, int], num_classes: int
                    ) -> dict[str, torch.Tensor]:
    """The full state dict model ``name`` starts from for data of ``input_shape`` / ``num_classes``, with the
    tensors ``init`` names; :class:`ConfigError` on ``model.init`` naming what does not fit."""
    from fedray.models import build_model

    own = build_model(name, input_shape, num_classes).state_dict()
    if init.startswith(TORCHVISION):
        given = _torchvision(init[len(TORCHVISION):])
        wrong = _mismatches(own, given, skip=ADAPTED)
        missing = [k for k in own if k not in given]
        if wrong or missing or not any(k in own for k in given):
            raise ConfigError("model.init", f"{init} does not fit model.name={name}: "
                              + _listed(wrong or [f"{k} missing" for k in missing] or ["no key in common"])
                              + "; give the weights of the model's torchvision architecture")
        return {**own, **{k: v for k, v in given.items() if k in own and v.shape == own[k].shape}}
    path = Path(init).expanduser()
    if not path.is_file():
        raise ConfigError("model.init", f"{init} does not exist; give a state dict saved with torch.save (a "
                          "fedray run's model.pt) or torchvision:<weights name>")
    try:
        given = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or pickled objects other than tensors
        raise ConfigError("model.init", f"{init} is not a state dict torch.load can read safely "
                          f"({type(e).__name__}); save one with torch.save(model.state_dict(), path)") from None
    if not isinstance(given, dict) or not all(isinstance(v, torch.Tensor) for v in given.values()):
        raise ConfigError("model.init", f"{init} is not one model's state dict (a personalised run's model.pt "
                          "holds every client's: save one of them)")
    wrong = _mismatches(own, given)
    if wrong:
        raise ConfigError("model.init", f"{init} does not fit model.name={name} on this data: {_listed(wrong)}")
    missing, extra = [k for k in own if k not in given], [k for k in given if k not in own]
    if missing or extra:
        raise ConfigError("model.init", f"{init} is not a state dict of model.name={name}: "
                          + _listed([f"{k} missing" for k in missing] + [f"{k} unexpected" for k in extra]))
    return {k: given[k].to(own[k].dtype) for k in own}


def _torchvision(weights_name: str) -> dict[str, torch.Tensor]:
    from torchvision.models import get_weight

    try:
        weights = get_weight(weights_name)
    except (ValueError, KeyError, AttributeError):
        raise ConfigError("model.init", f"torchvision has no weights {weights_name!r}; e.g. "
                          "torchvision:ResNet18_Weights.IMAGENET1K_V1") from None
    try:
        state = weights.get_state_dict(progress=False)
    except Exception as e:  # offline: the download fails
        raise ConfigError("model.init", f"cannot fetch {weights_name} ({type(e).__name__}); on a machine without "
                          f"internet put {weights.url.rsplit('/', 1)[-1]} in torch's hub cache "
                          "(~/.cache/torch/hub/checkpoints) or give a path") from None
    return {("head." + k[3:] if k.startswith("fc.") else k): v for k, v in state.items()}


def apply_init(model: torch.nn.Module, init: str | None, name: str, input_shape, num_classes: int) -> None:
    """Load ``model.init``'s weights into ``model`` (of architecture ``name``) in place; nothing without one."""
    if init:
        model.load_state_dict(initial_weights(init, name, tuple(input_shape), num_classes))
