"""The in-process runtime's device (``runtime.device``, ``runtime.num_gpus_per_worker``) with and without a visible GPU:
what is chosen, and the one-line refusal of a GPU that is not there."""

from __future__ import annotations

import pytest
import torch

from fedray.errors import ResourceError
from fedray.runtime.base import local_device
from tests.conftest import tiny_config


@pytest.mark.parametrize("device, gpus, cuda, chosen", [
    ("auto", 0, False, "cpu"), ("auto", 0, True, "cuda"), ("cpu", 0, True, "cpu"), ("cuda", 0, True, "cuda"),
    ("auto", 0.5, True, "cuda"),  # a share of a GPU a worker: on the GPU
])
def test_the_device_is_the_gpu_where_one_is_asked_for_or_auto_finds_one(monkeypatch, device, gpus, cuda, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = tiny_config(runtime__device=device, runtime__num_gpus_per_worker=gpus)
    assert local_device(cfg) == torch.device(chosen)


@pytest.mark.parametrize("device, gpus, key", [("cuda", 0, "runtime.device"), ("auto", 1, "runtime.num_gpus_per_worker")])
def test_a_gpu_asked_for_where_none_is_visible_is_refused_naming_the_key(monkeypatch, device, gpus, key):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ResourceError) as e:
        local_device(tiny_config(runtime__device=device, runtime__num_gpus_per_worker=gpus))
    assert (e.value.key, e.value.message) == (key, "asks for a GPU but none is visible here; use runtime.device=cpu and "
                                                   "runtime.num_gpus_per_worker=0, or run on a GPU machine")
