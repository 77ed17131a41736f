import numpy as np
import pytest
import torch

from fedray.runtime.tensor_wire import _from_wire, _to_wire, register


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(3, 4, generator=g).requires_grad_()
    return {
        "float32": torch.randn(6, 5, generator=g),
        "transposed view": torch.randn(6, 5, generator=g).t(),
        "0-dim": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "int64": torch.arange(10),
        "bool": torch.tensor([True, False, True]),
        "float16": torch.randn(4, generator=g).half(),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "conjugated complex": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "requires grad": leaf,
        "bfloat16 (no numpy dtype)": torch.randn(5, generator=g).bfloat16(),
        "sparse": torch.eye(3).to_sparse(),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_a_tensor_arrives_with_its_values_dtype_shape_and_grad_flag(name):
    tensor = _cases()[name]
    wire = _to_wire(tensor)
    # What numpy can hold goes as an array (out of band in Ray's pickle 5); the rest as torch pickles it.
    assert isinstance(wire[0], np.ndarray) == (name not in ("bfloat16 (no numpy dtype)", "sparse"))
    back = _from_wire(wire)
    assert type(back) is torch.Tensor and back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.requires_grad == tensor.requires_grad and back.layout == tensor.layout
    assert torch.equal(back.to_dense(), tensor.detach().to_dense().resolve_conj())


def test_the_received_tensor_owns_writable_memory():
    # Ray hands back read-only arrays that live in the object store: the tensor must be a copy.
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    array.setflags(write=False)
    tensor = _from_wire((array, False))
    tensor.add_(1.0)  # would fail or write into the store if it were a view
    assert array[0, 0] == 0.0 and tensor[0, 0] == 1.0


@pytest.fixture
def registered():
    import ray

    dispatch = ray.cloudpickle.CloudPickler.dispatch
    before = dispatch.get(torch.Tensor)
    register()
    yield
    if before is None:  # as found: registration is process-wide
        dispatch.pop(torch.Tensor, None)
    else:
        dispatch[torch.Tensor] = before


def test_registered_ray_pickling_sends_tensors_and_parameters_data_as_numpy(registered):
    import ray

    weights = {"w": torch.nn.Parameter(torch.randn(4, 3)), "b": torch.arange(3.0), "n": 5}
    blob = ray.cloudpickle.dumps(weights)
    assert b"_from_wire" in blob and b"_load_from_bytes" not in blob  # not torch's storage pickling
    back = ray.cloudpickle.loads(blob)
    assert type(back["w"]) is torch.nn.Parameter and back["w"].requires_grad
    assert torch.equal(back["w"], weights["w"]) and torch.equal(back["b"], weights["b"]) and back["n"] == 5
