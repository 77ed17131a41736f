"""A message as the channel sees it: its tensors, each declared a model, values or counts.

A method's :class:`~fedray.learning.boundary.Payload` and :class:`~fedray.learning.boundary.Upload` are dataclasses of
tensors, dicts and lists of tensors, nested dataclasses and scalars. Each field is declared (field metadata, see
:func:`~fedray.learning.boundary.model_field`) as

- a **model** against a payload field (an update the client computed from what it was sent: the stage may send
  ``tensor - reference``, the reference being that payload field as the client decoded it, same key below it),
- **values** (logits, generator outputs, scores: transformed as they are), or
- **counts** (label histograms, sample counts: never transformed).

An undeclared field is read by its tensors' dtype (floating: values, integer: counts), and a declaration holds for
everything below the field unless a nested dataclass declares its own. Integer and boolean tensors are never
transformed, whatever the declaration. Scalars (ints, floats) are the message's header: sent as they are.

:func:`split` takes a message apart into the :class:`Leaf` s the stages transform and a skeleton holding the rest;
:func:`join` puts them back. The walk is depth first in field, key and list order, the same on both sides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from fedray.learning.boundary import WIRE

Path = tuple[Any, ...]


class Hole:
    """Where a transformed tensor sits in a message's skeleton (it travels as a :class:`Leaf` beside it)."""

    def __repr__(self) -> str:
        return "<leaf>"


@dataclass
class Leaf:
    """One tensor of a message on its way through the stages. ``data``: the tensor, or a stage's encoding of it (a
    tensor or a tuple of tensors on the wire); ``dtype`` and ``shape``: the tensor's before any stage (the header
    the receiver decodes to); ``reference``: for a model leaf of an upload, the payload tensor it is an update
    against, as the client decoded it (None otherwise)."""

    path: Path
    kind: str  # "model" or "values"
    data: Any
    dtype: torch.dtype
    shape: tuple[int, ...]
    against: Path | None = None  # a model leaf's reference: its path in the payload
    reference: torch.Tensor | None = None
    relative: bool = False  # sent as the update against its reference (the receiver adds the reference back)

    def header(self) -> "Leaf":
        """A copy carrying what a receiver knows (its path, kind, dtype, shape, how it was sent) and the data."""
        return Leaf(self.path, self.kind, self.data, self.dtype, self.shape, self.against, None, self.relative)


def _declared(f: dataclasses.Field, inherited: tuple[str, str | None] | None) -> tuple[str, str | None] | None:
    return f.metadata.get(WIRE, inherited)


def _walk(obj: Any, path: Path, decl: tuple[str, str | None] | None, against_path: Path,
          scalars: bool = False) -> Iterator[tuple]:
    """(path, tensor, kind, against field, path below the declared field) of every tensor, depth first; with
    ``scalars`` the header's ints too."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            own = _declared(f, None)
            yield from _walk(getattr(obj, f.name), (*path, f.name), own or decl, () if own else (*against_path, f.name),
                             scalars)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, (*path, k), decl, (*against_path, k), scalars)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, (*path, i), decl, (*against_path, i), scalars)
    elif isinstance(obj, torch.Tensor) or (scalars and isinstance(obj, int) and not isinstance(obj, bool)):
        yield path, obj, decl, against_path


def _kind(tensor: torch.Tensor, decl: tuple[str, str | None] | None) -> tuple[str, str | None]:
    if not torch.is_floating_point(tensor):
        return "counts", None
    return decl if decl is not None else ("values", None)


def _lookup(obj: Any, path: Path) -> Any:
    for key in path:
        if obj is None:
            return None
        if dataclasses.is_dataclass(obj):
            obj = getattr(obj, key, None)
        elif isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, (list, tuple)):
            obj = obj[key] if isinstance(key, int) and key < len(obj) else None
        else:
            return None
    return obj


def reference(payload: Any, where: Path | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The payload's tensor at ``where`` when it has ``shape`` (a model leaf's reference), else None: such a leaf is
    then sent whole."""
    if payload is None or where is None:
        return None
    found = _lookup(payload, where)
    return found if isinstance(found, torch.Tensor) and tuple(found.shape) == tuple(shape) else None


def split(message: Any, payload: Any = None) -> tuple[Any, list[Leaf]]:
    """(skeleton, leaves): the message's model and values tensors as leaves, in walk order, and the message with
    each of them replaced by a :class:`Hole`. ``payload``: the decoded payload an upload's model leaves are
    updates against (their ``reference``)."""
    leaves: list[Leaf] = []
    holes: dict[Path, Hole] = {}
    for path, tensor, decl, below in _walk(message, (), None, ()):
        kind, against = _kind(tensor, decl)
        if kind == "counts":
            continue
        where = (against, *below) if kind == "model" and against is not None else None
        leaves.append(Leaf(path, kind, tensor, tensor.dtype, tuple(tensor.shape), where,
                           reference(payload, where, tuple(tensor.shape))))
        holes[path] = Hole()
    return _replace(message, (), holes), leaves


def _replace(obj: Any, path: Path, at: dict[Path, Any]) -> Any:
    if path in at:
        return at[path]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replace(getattr(obj, f.name), (*path, f.name), at)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _replace(v, (*path, k), at) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace(v, (*path, i), at) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_replace(v, (*path, i), at) for i, v in enumerate(obj))
    return obj


def declared_counts(message: Any) -> list[tuple[Path, Any]]:
    """(path, value) of every value of a field declared counts (:func:`~fedray.learning.boundary.counts_field`): its
    integer tensors (label histograms; not booleans) and the header's ints (sample counts), depth first."""
    return [(path, value) for path, value, decl, _ in _walk(message, (), None, (), scalars=True)
            if decl is not None and decl[0] == "counts"
            and not (isinstance(value, torch.Tensor) and (torch.is_floating_point(value) or value.dtype == torch.bool))]


def replaced(message: Any, values: dict[Path, Any]) -> Any:
    """``message`` with the value at each path of ``values`` replaced (the rest shared, not copied)."""
    return _replace(message, (), values)


def join(skeleton: Any, leaves: list[Leaf]) -> Any:
    """The message: the skeleton with each hole filled by its leaf's (decoded) tensor."""
    return _replace(skeleton, (), {leaf.path: leaf.data for leaf in leaves})


__all__ = ["Hole", "Leaf", "declared_counts", "join", "reference", "replaced", "split"]
