"""Indexing mappings (frontend/torch_ops/indexing.py, assign.py): ``x[...]`` reads, ``x[...] = v``
writes as SSA updates, gather/index_select/select, tril/triu, flip, roll; with dynamic dims
compared with torch eager at other sizes, and clear errors where the result's shape would
depend on tensor data."""
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402

from frontend_helpers import check_traced, op_types  # noqa: E402

X = torch.randn(2, 3, 4)
OTHERS = [(torch.randn(1, 3, 4),), (torch.randn(5, 3, 4),)]


def dyn(fn, x=X, others=OTHERS):
    return check_traced(fn, (x,), dynamic_batch=True, other_inputs=others)


# ---------------------------------------------------------------------------- reads
@pytest.mark.parametrize("fn", [
    lambda x: x[0], lambda x: x[-1], lambda x: x[:, 0], lambda x: x[:, -1, :], lambda x: x[..., -1],
    lambda x: x[..., None], lambda x: x[None], lambda x: x[:, None, 1], lambda x: x[None, ..., None, 2],
    lambda x: x[:, 1:], lambda x: x[:, :-1], lambda x: x[:, ::2], lambda x: x[..., 1:-1:2],
    lambda x: x[:, -5:10], lambda x: x[1:], lambda x: x[:, 2:1], lambda x: x[:, 1, 1:3],
    lambda x: x[...], lambda x: x[:], lambda x: x[:, :, :], lambda x: x[0, 0, 0],
    lambda x: x[:, x.size(1) - 1], lambda x: x[:, :x.size(0)], lambda x: x[x.size(0) - 1],
    lambda x: x[-x.size(0):], lambda x: x[:, [0, 2]], lambda x: x[..., [[1], [3]]],
    lambda x: x[:, torch.tensor([True, False, True])], lambda x: x[..., torch.ones(3, 4).bool()],
])
def test_getitem(fn):
    dyn(fn)


def test_slice_bound_from_another_input_stays_symbolic():
    def f(x, y):
        seq = y.size(1)
        return x[:, :seq], x[:, -seq:], x[:, seq - 1]

    check_traced(f, (torch.randn(2, 5, 4), torch.randn(2, 3)), dynamic={"x": {0: "b"}, "y": {0: "b", 1: "s"}},
                 other_inputs=[(torch.randn(3, 5, 4), torch.randn(3, 1)), (torch.randn(1, 5, 4), torch.randn(1, 5))])


@pytest.mark.parametrize("fn, idx", [
    (lambda x, i: x[i], torch.tensor([1, 0, -1])),
    (lambda x, i: x[:, i], torch.tensor([2, 0, -1])),
    (lambda x, i: x[..., i], torch.tensor([[3, 0], [-4, 1]])),
    (lambda x, i: x[:, i, None], torch.tensor([1, 2])),
    (lambda x, i: x[i, i], torch.tensor([1, 0, -1])),
    (lambda x, i: x[:, i, i], torch.tensor([1, 0, -1])),
    (lambda x, i: x[i, :, i], torch.tensor([1, 0])),
    (lambda x, i: x[0, :, i], torch.tensor([1, 0])),
    (lambda x, i: x[i.int()], torch.tensor([1, 0])),
    (lambda x, i: x[torch.arange(x.size(0)), i], torch.tensor([2, 0, 1])),
    (lambda x, i: x[i[0]], torch.tensor([1, 0])),
])
def test_getitem_with_tensors(fn, idx):
    x = torch.randn(3, 3, 4)
    check_traced(fn, (x, idx), other_inputs=[(torch.randn(3, 3, 4), idx.flip(0))])


def test_getitem_tensor_with_dynamic_sizes():
    check_traced(lambda x, i: x[:, i], (torch.randn(2, 5), torch.tensor([4, 0, -1])),
                 dynamic={"x": {0: "b"}, "i": {0: "n"}}, other_inputs=[(torch.randn(6, 5), torch.tensor([1, -2]))])


def test_one_int_and_one_slice_make_one_gather_and_one_slice():
    g = dyn(lambda x: x[:, 0, 1:])
    assert sorted(op_types(g)) == ["Gather", "Identity", "Slice"]


def test_data_dependent_bool_mask_is_refused():
    with pytest.raises(UnsupportedOpError, match="bool mask computed from the inputs has a data-dependent length"):
        kiln.trace(lambda x: x[x > 0], X, check=False)
    with pytest.raises(UnsupportedOpError, match="'masked_select' returns as many elements"):
        kiln.trace(lambda x: x.masked_select(x > 0), X, check=False)
    with pytest.raises(UnsupportedOpError, match="slice bound read from a tensor"):
        kiln.trace(lambda x: x[:, :torch.tensor(2)], X, check=False)


# ---------------------------------------------------------------------------- writes
def _write(index, value):
    def f(x):
        y = x.clone()
        y[index] = value
        return y

    return f


@pytest.mark.parametrize("fn", [
    _write((slice(None), 0), 1.0), _write((Ellipsis, slice(None, 2)), -1.0), _write((slice(None), -1, 1), 5),
    _write((slice(None), slice(1, None, 2)), 0.5), _write(0, 2.0), _write(-1, 3.0), _write(Ellipsis, 7.0),
    _write((slice(None), slice(None), [0, -1]), 9.0), _write((slice(None), 1), torch.arange(4.0)),
    _write((slice(None), slice(None), 0), torch.ones(3, dtype=torch.int64)),
])
def test_setitem(fn):
    dyn(fn)


def test_setitem_with_traced_values_and_symbolic_bounds():
    def f(x):
        y = x.clone()
        y[:, 0] = x[:, 1] * 2  # value with the batch dim
        y[..., :2] = y[..., 2:]  # value read from the tensor being written
        y[:, :, x.size(0) - 1:] += 1  # read-modify-write through __getitem__ + __iadd__ + __setitem__
        y[:, 1:, :] = x[:, None, 0] + 0  # value broadcast over the selection, with a leading 1
        return y

    dyn(f)


def test_setitem_with_a_bool_mask_is_a_where():
    def f(x):
        y = x.clone()
        y[y > 0] = 0.0
        y[x[..., 0] < -1] = torch.full((4,), 3.0)
        return y

    g = dyn(f)
    assert "Where" in op_types(g) and "ScatterND" not in op_types(g)


def test_setitem_on_a_created_mask():
    def f(x):
        mask = torch.zeros(x.size(0), x.size(1), dtype=torch.bool)
        mask[:, 0] = True
        return x.masked_fill(mask[..., None], -1.0)

    dyn(f)


def test_index_put():
    def f(x, i):
        y = x.index_put((i,), torch.tensor(1.0))
        z = x.clone()
        z.index_put_((i,), torch.tensor(2.0), accumulate=True)
        return y, z

    check_traced(f, (X, torch.tensor([1, 0])), other_inputs=[(torch.randn(2, 3, 4), torch.tensor([0, 0]))])


def test_writing_through_a_view_is_written_back_to_the_base():
    def f(x, b):
        y = x.clone()
        y[0][1] = 5.0  # eager torch changes y through the view y[0]
        y[:, 0].add_(b[0])  # in place on a view, with a value from the inputs
        y[1:].mul_(2)
        z = y[:, 1:][0]  # a view of a view, written: both bases follow
        z.fill_(3.0)
        w = y[0]
        w += 1  # then stored back with y[0] = w, as ``y[0] += 1`` does
        y[0] = w
        return x * b.sum() + y

    check_traced(f, (X, torch.randn(3)), other_inputs=[(torch.randn(2, 3, 4), torch.randn(3))])


def test_a_view_written_after_its_base_was_written_stays_stale():
    def f(x):
        y = x.clone()
        row = y[0]
        y.add_(1.0)  # row is stale now
        row.zero_()
        return y

    with pytest.raises(UnsupportedOpError, match="shares memory with a tensor written in place"):
        kiln.trace(f, X, check=False)


def test_writing_the_base_makes_views_stale():
    def f(x):
        y = x.clone()
        row = y[0]
        y[0] = 1.0
        return row

    with pytest.raises(UnsupportedOpError, match=r"\.clone\(\) the tensor before writing"):
        kiln.trace(f, X, check=False)


def test_setitem_through_several_index_tensors():
    """transformers' wav2vec2: mask[(torch.arange(b), lengths - 1)] = 1, with lengths from the inputs."""
    def f(x, lengths):
        mask = torch.zeros(x.size(0), x.size(2), dtype=x.dtype)
        mask[(torch.arange(x.size(0)), lengths - 1)] = 1
        y = x.clone()
        y[:, torch.tensor([[0], [2]]), torch.tensor([1, 3])] = -5.0  # broadcast 2x1 with 2: four places each
        y[:, torch.tensor([1, 2]), torch.tensor([3, -1])] += 1.0  # accumulated, a negative index
        z = x.clone()
        z[torch.arange(x.size(0)), 1] = x[:, 0] * 2  # an int beside a tensor, a tensor value on the leading axes
        z[1, :, torch.tensor([0, 3])] = x[0, :, 1:3] - 1  # torch drops the int first: the (3, 2) selection
        z[:, torch.tensor([[2], [0]]), :] = x[:, 1:3, None, :] * 3  # one 2-D index tensor, in the middle
        w = x.clone().index_put((torch.tensor([0, 0]), torch.tensor([1, 1])), torch.tensor(1.0), accumulate=True)
        return mask.flip(-1).cumsum(-1).flip(-1) * x[:, 0], y, z, w

    check_traced(f, (X, torch.tensor([4, 1])), dynamic_batch=True,
                 other_inputs=[(torch.randn(3, 3, 4), torch.tensor([2, 3, 1])), (torch.randn(2, 3, 4), torch.tensor([1, 1]))])


@pytest.mark.parametrize("fn, match", [
    (_write((torch.tensor([0, 1]), slice(1, 3), torch.tensor([1, 2])), 1.0), "combined with a partial slice"),

    (_write((None, 0), 1.0), "index with None"),
    (_write(X > 0, torch.ones(int((X > 0).sum()))), "one row per True element"),
])
def test_unsupported_writes(fn, match):
    with pytest.raises(UnsupportedOpError, match=match):
        kiln.trace(fn, X, check=False)


# ---------------------------------------------------------------------------- named ops
@pytest.mark.parametrize("fn", [
    lambda x: x.index_select(1, torch.tensor([2, 0])), lambda x: torch.index_select(x, -1, torch.tensor(1)),
    lambda x: x.select(1, -1), lambda x: torch.select(x, 2, 0), lambda x: x.select(0, x.size(0) - 1),
    lambda x: x.tril(), lambda x: torch.triu(x, 1), lambda x: x.tril(-1), lambda x: x.clone().triu_(),
    lambda x: x.clone().tril_(2), lambda x: torch.tril(x, x.size(0) - 3),
    lambda x: x.flip(0), lambda x: torch.flip(x, (1, 2)), lambda x: x.flip(-1), lambda x: x.fliplr(),
    lambda x: torch.flipud(x),
    lambda x: x.roll(1, 0), lambda x: x.roll(-2, 2), lambda x: torch.roll(x, 5), lambda x: x.roll(-7),
    lambda x: x.roll((1, 9), (0, 1)), lambda x: x.roll(4, -1), lambda x: x.roll(-3, 0),
])
def test_named_indexing_ops(fn):
    dyn(fn)


@pytest.mark.parametrize("fn", [
    lambda x, i: torch.gather(x, 2, i), lambda x, i: x.gather(-1, i), lambda x, i: x.gather(1, i[:, :2] % 3),
    lambda x, i: torch.gather(x, 0, i[:1, :2, :3] % 2),
])
def test_gather(fn):
    i = torch.randint(0, 4, (2, 3, 2))
    check_traced(fn, (X, i), other_inputs=[(torch.randn(2, 3, 4), torch.randint(0, 4, (2, 3, 2)))])
