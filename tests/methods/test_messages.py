"""What every registered method's messages carry, declared for the channel (``fedray.learning.boundary``'s
``model_field`` / ``values_field`` / ``counts_field``): a model field is an update against a payload field that
exists and holds the same kind of model, every field holding a model's weights is declared, and every field is
something a channel stage can transform or pass on (tensors, weights, numbers, a string header)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing

import pytest

from fedray.learning.boundary import WIRE
from fedray.methods import ALGORITHMS
from fedray.methods.api import Payload, Upload
from tests.conftest import built_in_methods

# what a field's annotation may be, None aside: a channel stage transforms the tensors and passes the rest on
TRANSFORMABLE = {"Weights", "torch.Tensor", "int", "float", "bool", "str"}


def _annotation(cls: type, f: dataclasses.Field) -> str:
    """The field's annotation as written, ``X | None`` read as X."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return text.replace(" | None", "").replace("None | ", "").strip()


def _messages(method: type) -> tuple[type, list[type]]:
    """The payload class ``broadcast`` returns, and every upload class of the modules the method is made of."""
    payload = typing.get_type_hints(method.broadcast)["return"]
    modules = {sys.modules[c.__module__] for c in method.__mro__ if c.__module__.startswith("fedray.methods.")}
    modules.add(sys.modules[payload.__module__])
    uploads = {c for m in modules for _, c in inspect.getmembers(m, inspect.isclass)
               if issubclass(c, Upload) and c is not Upload and c.__module__ == m.__name__}
    return payload, sorted(uploads, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("name", built_in_methods())
def test_a_model_field_is_an_update_against_a_payload_field_of_its_kind(name):
    payload, uploads = _messages(ALGORITHMS[name])
    assert issubclass(payload, Payload) and uploads, (payload, uploads)
    sent = {f.name: _annotation(payload, f) for f in dataclasses.fields(payload)}
    for upload in uploads:
        for f in dataclasses.fields(upload):
            kind, against = f.metadata.get(WIRE, (None, None))
            if kind == "model" and against is not None:
                assert against in sent, f"{upload.__qualname__}.{f.name} is declared against {against!r}, which " \
                                        f"{payload.__qualname__} has not (its fields: {', '.join(sent)})"
                assert sent[against] == _annotation(upload, f), (upload, f.name, sent[against])


@pytest.mark.parametrize("name", built_in_methods())
def test_every_field_is_declared_where_it_holds_weights_and_can_be_transformed(name):
    payload, uploads = _messages(ALGORITHMS[name])
    for message in (payload, *uploads):
        for f in dataclasses.fields(message):
            written = _annotation(message, f)
            assert written in TRANSFORMABLE, f"{message.__qualname__}.{f.name}: {written} (a channel stage " \
                                             "transforms tensors and passes numbers on)"
            if written == "Weights":
                assert WIRE in f.metadata, f"{message.__qualname__}.{f.name} holds weights: declare it with " \
                                           "model_field(against=...) or values_field()"


def test_fedavgs_upload_is_declared_against_its_payload():
    from fedray.methods.fedavg import ModelPayload, ModelUpload

    (weights,) = [f for f in dataclasses.fields(ModelUpload) if f.name == "weights"]
    assert weights.metadata[WIRE] == ("model", "weights")
    assert [f.name for f in dataclasses.fields(ModelPayload)] == ["weights"]
