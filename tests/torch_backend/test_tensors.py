"""Tensors lent to collectives (ringcomm.torch.tensors), in one process: what is shared,
what is copied, and what comes back."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs PyTorch")

from ringcomm.torch.tensors import check_op, lend  # noqa: E402

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int32, torch.int64, torch.bool])
def test_contiguous_tensors_are_lent_without_a_copy(dtype):
    t = torch.zeros(6, dtype=dtype)
    loan = lend([t], reducing=True)
    assert isinstance(loan.array, np.ndarray) and loan.array.dtype == t.numpy().dtype
    assert loan.array.__array_interface__["data"][0] == t.data_ptr()
    loan.array[2] = 1
    assert t[2].item() == 1  # the collective writes straight into the tensor


def test_bfloat16_moves_as_bits_and_reduces_as_float32():
    t = torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16)
    moved = lend([t])
    assert moved.array.dtype == np.int16 and moved.array.__array_interface__["data"][0] == t.data_ptr()
    reduced = lend([t], reducing=True)
    assert reduced.array.dtype == np.float32
    assert reduced.array.tolist() == [1.5, -2.25, t[2].float().item()]  # exact
    reduced.array[:] = [1.0 + 2 ** -9, 2.0, 3.0]  # 1 + 2^-9 is a tie: rounds to even, once
    reduced.finish()
    assert t.tolist() == [1.0, 2.0, 3.0]


def test_complex_travels_as_pairs_of_reals_and_refuses_max():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    loan = lend([z], reducing=True)
    assert loan.array.tolist() == [1.0, 2.0, 3.0, -4.0]
    loan.array *= 2
    loan.finish()
    assert z.tolist() == [2 + 4j, 6 - 8j]
    check_op([z], "sum")
    with pytest.raises(ValueError, match="complex"):
        check_op([z], "max")


def test_non_contiguous_outputs_are_copied_back_and_inputs_left_alone():
    m = torch.arange(12.0).reshape(3, 4)
    column = m[:, 1]
    loan = lend([column])
    assert loan.array.tolist() == [1.0, 5.0, 9.0]
    loan.array[:] = -1
    assert m[0, 1].item() == 1.0  # a copy until finish()
    loan.finish()
    assert m[:, 1].tolist() == [-1.0] * 3 and m[:, 0].tolist() == [0.0, 4.0, 8.0]
    source = lend([m.t()], output=False)
    source.array[:] = 0
    source.finish()
    assert m.sum().item() != 0  # an input is never written back


def test_a_list_is_one_buffer_in_order():
    outs = [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    loan = lend(outs, copy_in=False)
    assert loan.array.size == 5
    loan.array[:] = np.arange(5)
    loan.finish()
    assert [o.tolist() for o in outs] == [[0, 1], [2, 3, 4]]
    assert [(a, b) for _, a, b in loan.bounds] == [(0, 2), (2, 5)]
    ins = lend([torch.ones(2), torch.full((1,), 7.0)], output=False)
    assert ins.array.tolist() == [1.0, 1.0, 7.0]


def test_refusals():
    with pytest.raises(ValueError, match="several dtypes"):
        lend([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    from types import SimpleNamespace

    from ringcomm.torch.tensors import _device
    with pytest.raises(ValueError, match="runs on the CPU"):
        _device([SimpleNamespace(is_cuda=True, layout=torch.strided)], gpu=False)
    with pytest.raises(ValueError, match="mixed"):
        _device([SimpleNamespace(is_cuda=True, layout=torch.strided),
                 SimpleNamespace(is_cuda=False, layout=torch.strided)], gpu=True)
    on = [SimpleNamespace(is_cuda=True, layout=torch.strided, device=SimpleNamespace(index=i)) for i in (1, 0)]
    assert _device(on[:1], gpu=True, device_index=1)  # the rank's own GPU
    with pytest.raises(ValueError, match="a tensor on cuda:0, but this rank's communicator runs on cuda:1"):
        _device(on, gpu=True, device_index=1)
    with pytest.raises(ValueError, match="sparse_coo tensors are not supported"):
        lend([torch.eye(3).to_sparse()], reducing=True)
