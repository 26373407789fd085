"""Shape and view mappings (frontend/torch_ops/shape.py, concat.py): each traced with a dynamic
batch and compared with torch eager at the example batch and at other batch sizes; symbolic
shape arithmetic (``x.view(x.size(0), -1)``, ``d // heads``) must survive in the graph."""
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402
from kiln.ir import evaluate  # noqa: E402

from frontend_helpers import check_traced, op_types  # noqa: E402

X = torch.randn(2, 3, 4)
OTHERS = [(torch.randn(1, 3, 4),), (torch.randn(5, 3, 4),)]


def dyn(fn, x=X, others=OTHERS):
    return check_traced(fn, (x,), dynamic_batch=True, other_inputs=others)


# ---------------------------------------------------------------------------- flatten / unflatten
@pytest.mark.parametrize("fn", [
    lambda x: x.flatten(1), lambda x: torch.flatten(x, 1), lambda x: torch.flatten(x),
    lambda x: x.flatten(0, 1), lambda x: x.flatten(-2), lambda x: x.flatten(1, 1), lambda x: x.flatten(0, -2),
    lambda x: torch.nn.Flatten()(x), lambda x: x.unflatten(2, (2, 2)), lambda x: torch.unflatten(x, -1, (-1, 2)),
    lambda x: x.unflatten(1, (3, 1)), lambda x: x.flatten(1).unflatten(1, (x.size(1), -1)),
])
def test_flatten_unflatten(fn):
    dyn(fn)


def test_flatten_keeps_the_batch_symbolic():
    g = dyn(lambda x: x.flatten(1))
    assert op_types(g).count("Flatten") == 1 and g.outputs[0].type.shape == ("batch", 12)
    g = dyn(lambda x: x.flatten(0, 1))
    assert "Shape" not in op_types(g)  # the batch is absorbed by -1, not read back


def test_flatten_of_a_scalar():
    check_traced(lambda x: x.sum().flatten(), (X,))


# ---------------------------------------------------------------------------- transposes
@pytest.mark.parametrize("fn", [
    lambda x: x.permute(2, 0, 1), lambda x: x.permute((0, 2, 1)), lambda x: torch.permute(x, (1, -1, 0)),
    lambda x: x.transpose(1, 2), lambda x: torch.transpose(x, 0, -1), lambda x: x.swapaxes(0, 1),
    lambda x: torch.swapdims(x, 1, 2), lambda x: x.clone().transpose_(0, 2), lambda x: x.clone().swapaxes_(1, 2),
    lambda x: x.mT, lambda x: x.mH, lambda x: x.adjoint(), lambda x: x.movedim(0, -1),
    lambda x: torch.movedim(x, (0, 1), (2, 0)), lambda x: x.moveaxis(-1, 0),
])
def test_permutations(fn):
    dyn(fn)


@pytest.mark.parametrize("fn", [
    lambda x: x.T, lambda x: x.t(), lambda x: torch.t(x), lambda x: x.clone().t_(), lambda x: x.H,
    lambda x: x[0].t(), lambda x: x[0, 0].t(),
])
def test_matrix_transposes(fn):
    check_traced(fn, (torch.randn(3, 4),), other_inputs=[(torch.randn(3, 4),)])


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
def test_T_reverses_every_dim():
    check_traced(lambda x: x.permute(2, 1, 0) + x.T * 0, (X,))


# ---------------------------------------------------------------------------- squeeze / unsqueeze
@pytest.mark.parametrize("fn", [
    lambda x: x[:, :1].squeeze(1), lambda x: x[:, :1, None].squeeze((1, 2)), lambda x: torch.squeeze(x[:, :1], -2),
    lambda x: x.squeeze(1), lambda x: x[:, :1].clone().squeeze_(1), lambda x: x.unsqueeze(0),
    lambda x: torch.unsqueeze(x, -1), lambda x: x.clone().unsqueeze_(2), lambda x: x.clone().unsqueeze_(-1),
    lambda x: x[:, :1, None].clone().squeeze_((1, -1)),
])
def test_squeeze_unsqueeze(fn):
    dyn(fn)


def test_squeeze_all_static():
    check_traced(lambda x: x.squeeze(), (torch.randn(1, 3, 1, 4),))
    check_traced(lambda x: x.clone().squeeze_(), (torch.randn(1, 3, 1, 4),))
    # torch would also drop a symbolic dim of size 1; the graph squeezes the static ones only
    check_traced(lambda x: x[:, :1, :1].squeeze(), (X,), dynamic_batch=True, other_inputs=[(torch.randn(5, 3, 4),)])


def test_squeezing_a_symbolic_dim_traced_at_1_is_refused():
    with pytest.raises(UnsupportedOpError, match=r"'squeeze' squeezes dim 0, which is symbolic \(batch\)"):
        kiln.trace(lambda x: x.squeeze(0), torch.randn(1, 3), dynamic_batch=True, check=False)
    with pytest.raises(UnsupportedOpError, match="symbolic"):
        kiln.trace(lambda x: x.squeeze(), torch.randn(1, 3), dynamic_batch=True, check=False)


def test_squeeze_after_a_symbolic_view_knows_the_static_one():
    dyn(lambda x: x.view(x.size(0), 1, -1).squeeze(1))


# ---------------------------------------------------------------------------- expand / repeat / tile
@pytest.mark.parametrize("fn", [
    lambda x: x[:, :1].expand(-1, 5, -1), lambda x: x[:, :1].expand((-1, 3, 4)), lambda x: x.expand(2, -1, -1, -1),
    lambda x: x[:, :1].expand_as(x), lambda x: torch.broadcast_to(x[:, :1], (x.size(0), 3, 4)),
    lambda x: x[:1].expand(x.size(0) * 2, 3, 4), lambda x: x.repeat(1, 2, 1), lambda x: x.repeat(2, 1, 1, 2),
    lambda x: x.repeat((1, 1, 3)), lambda x: torch.tile(x, (2,)), lambda x: x.tile(2, 1, 1, 1),
])
def test_expand_repeat(fn):
    dyn(fn)


@pytest.mark.parametrize("fn", [
    lambda x: x.repeat_interleave(2, dim=1), lambda x: torch.repeat_interleave(x, 3, dim=-1),
    lambda x: torch.repeat_interleave(x, 2, 0), lambda x: x.repeat_interleave(x.size(0), dim=2),
    lambda x: torch.repeat_interleave(x, 2), lambda x: x.repeat_interleave(torch.tensor([1, 0, 2]), dim=1),
    lambda x: x.repeat_interleave(torch.tensor(2), dim=2),
    lambda x: x + torch.repeat_interleave(torch.tensor([0, 2, 1, 1]))[None, None, :],
])
def test_repeat_interleave(fn):
    dyn(fn)


def test_repeat_interleave_by_counts_from_the_inputs_is_refused():
    with pytest.raises(UnsupportedOpError, match="depends on their values"):
        kiln.trace(lambda x, n: x.repeat_interleave(n, dim=0), (torch.randn(3, 2), torch.tensor([1, 2, 1])))


def test_numpy_keyword_names():
    """torch also takes NumPy's keyword names (axis, keepdims); torch.cat(xs, axis=1) is in transformers'
    Funnel, torch.multiply in ConvBERT."""
    dyn(lambda x: torch.cat([x, x], axis=1))
    dyn(lambda x: x.sum(axis=2, keepdims=True) + torch.mean(x, axis=1, keepdims=True))
    dyn(lambda x: torch.multiply(x, 2.0) - torch.subtract(x, x.flip(1)))


def test_expand_minus_one_reads_no_shape():
    g = dyn(lambda x: x[:, :1].expand(-1, 5, -1))
    assert "Shape" not in op_types(g) and g.outputs[0].type.shape == ("batch", 5, 4)


# ---------------------------------------------------------------------------- narrow / *_as / numel
@pytest.mark.parametrize("fn", [
    lambda x: x.narrow(2, 1, 2), lambda x: torch.narrow(x, -1, -3, 2), lambda x: x.narrow(0, 0, 1),
    lambda x: x.narrow(0, 1, x.size(0) - 1), lambda x: x.narrow_copy(1, 1, 1),
    lambda x: x.flatten(1).view_as(x), lambda x: x.flatten(1).reshape_as(x),
    lambda x: x.view(x.numel() // 12, 12), lambda x: x.reshape(-1, x.nelement() // x.size(0)),
    lambda x: x.view(torch.numel(x)), lambda x: x.view(x.size(0), x.dim(), x.ndim + 1),
])
def test_narrow_as_numel(fn):
    dyn(fn)


def test_numel_is_symbolic_only_when_a_dim_is():
    seen = []

    def f(x):
        seen.append(x.numel())
        return x + 1

    kiln.trace(f, X, dynamic_batch=True, check=False)
    kiln.trace(f, X, check=False)
    assert type(seen[0]).__name__ == "SymInt" and type(seen[1]) is int


# ---------------------------------------------------------------------------- cat / stack
@pytest.mark.parametrize("fn", [
    lambda x: torch.cat([x, x * 2], 1), lambda x: torch.cat((x, x), -1), lambda x: torch.concat([x, x]),
    lambda x: torch.concatenate([x, x], axis=2), lambda x: torch.cat([x], 1), lambda x: torch.cat([x, x.int()], 1),
    lambda x: torch.cat([x, torch.zeros(0)], 1), lambda x: torch.stack([x, x * 2]),
    lambda x: torch.stack([x, x], -1), lambda x: torch.stack((x[:, 0], x[:, 1]), 1),
])
def test_cat_stack(fn):
    dyn(fn)


def test_cat_promotes_dtypes():
    g = check_traced(lambda x, i: torch.cat([x, i], 0), (torch.randn(2, 3), torch.ones(1, 3, dtype=torch.int64)))
    assert str(g.outputs[0].type.dtype).lower().endswith("float32")


# ---------------------------------------------------------------------------- split family
@pytest.mark.parametrize("fn", [
    lambda x: x.split(3, -1), lambda x: torch.split(x, 2, 1), lambda x: torch.split(x, [1, 2], 1),
    lambda x: x.split([3, 1], dim=2), lambda x: x.split_with_sizes([2, 2], 2), lambda x: x.split(4, 2),
    lambda x: x.chunk(2, -1), lambda x: torch.chunk(x, 2, 1), lambda x: x.chunk(3, 2), lambda x: x.chunk(1, 0),
    lambda x: x.unbind(1), lambda x: torch.unbind(x, -1), lambda x: x[:, :1].unbind(1),
    lambda x: x.tensor_split(3, 2), lambda x: torch.tensor_split(x, [1, 2], 1), lambda x: x.hsplit(3),
    lambda x: torch.dsplit(x, [1]), lambda x: x.unsafe_split(2, 2), lambda x: x.unsafe_chunk(2, 2),
    lambda x: x.split([x.size(1) - 1, 1], 1),
    # the keyword spellings of tensor_split's overloads (torchvision's MViT: indices=(1,))
    lambda x: torch.tensor_split(x, indices=(1,), dim=2), lambda x: x.tensor_split(sections=2, dim=1),
])
def test_split_family(fn):
    dyn(fn)


@pytest.mark.parametrize("fn", [lambda x: x.chunk(2, 0), lambda x: x.split([x.size(0) // 2, x.size(0) // 2]),
                                lambda x: torch.tensor_split(x, indices=(1,), dim=0),
                                lambda x: x.tensor_split([1, -1, x.size(0)], 0)])
def test_split_a_symbolic_dim(fn):
    others = [(torch.randn(6, 3),), (torch.randn(2, 3),)]
    check_traced(fn, (torch.randn(4, 3),), dynamic_batch=True, other_inputs=others)


@pytest.mark.parametrize("fn, batch, match", [
    (lambda x: x.split(2, 0), 6, "'split' of dim 0, which is symbolic \\('batch'\\)"),
    (lambda x: x.unbind(0), 6, "'unbind' of dim 0, which is symbolic \\('batch'\\)"),
    # a list of images iterated in Python (detection models): the message says how to export (issue 24)
    (lambda x: torch.stack([r * 2 for r in x.unbind(0)]), 6,
     "A Python loop over that dim runs once per item of the example.*export with that dim fixed"),
    (lambda x: x.chunk(4, 0), 5, "into 4 gives 3 pieces"),
    (lambda x: torch.vsplit(x, 2), 6, "'vsplit' of dim 0"),
])
def test_splits_that_depend_on_a_symbolic_size_are_refused(fn, batch, match):
    with pytest.raises(UnsupportedOpError, match=match):
        kiln.trace(fn, torch.randn(batch, 3), dynamic_batch=True, check=False)


# ---------------------------------------------------------------------------- symbolic arithmetic end to end
class Heads(torch.nn.Module):
    heads = 2

    def forward(self, x):
        b, s, d = x.shape
        q = x.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # (b, heads, s, d/heads)
        per_head = x.shape[2] // self.heads
        scores = q @ q.transpose(-1, -2) / per_head
        pos = torch.arange(x.size(1))
        out = scores.softmax(-1) @ q
        out = out.transpose(1, 2).reshape(b, s, d) + pos[None, :, None]
        return out.view(out.size(0), -1), x.new_zeros(x.shape[0], 4)


def test_symbolic_shape_arithmetic_runs_at_other_sizes():
    g = check_traced(Heads(), (torch.randn(2, 3, 4),), dynamic={"x": {0: "batch", 1: "seq"}},
                     other_inputs=[(torch.randn(5, 7, 4),), (torch.randn(1, 1, 4),)])
    assert g.inputs[0].type.shape == ("batch", "seq", 4)
    assert g.outputs[1].type.shape == ("batch", 4)


def test_view_of_size_keeps_the_batch_symbol():
    g = dyn(lambda x: x.view(x.size(0), -1))
    assert g.outputs[0].type.shape == ("batch", 12)
    (out,) = evaluate(g, {"x": torch.randn(7, 3, 4).numpy()})
    assert out.shape == (7, 12)


def test_view_with_a_computed_leading_size_keeps_the_static_dims():
    """timm's Hiera: the batch is multiplied into B (B *= 4) and viewed as [B, 14, 2, 14, 2, 96];
    the static sizes must stay static, or a later unbind of one of them is refused."""
    def f(x):
        b = x.shape[0]
        y = x.view(b, 2, 2, 6, 4).flatten(0, 2)
        b *= 4
        z = y.view([b, 3, 2, 2, 2]).permute(0, 2, 4, 1, 3)
        p, q = z.unbind(1)
        return p - q

    g = check_traced(f, (torch.randn(2, 2, 2, 6, 4),), dynamic_batch=True,
                     other_inputs=[(torch.randn(3, 2, 2, 6, 4),)])
    assert g.outputs[0].type.shape[1:] == (2, 3, 2)


def test_sizes_given_as_tensors_stay_symbolic():
    """transformers' MobileViT (its torch.jit.is_tracing() branch): a size computed as a 0-dim tensor,
    multiplied by the symbolic batch, must not be baked into the Reshape."""
    def f(x):
        b, c, h, w = x.shape
        nh = (torch.ceil(torch.tensor(h / 2)) * 2).to(torch.int64)
        return x.reshape(b * c * (nh // 2), 2, w // 2, 2).sum(dim=(1, 2, 3))

    check_traced(f, (torch.randn(2, 3, 8, 8),), dynamic_batch=True, other_inputs=[(torch.randn(3, 3, 8, 8),)])

