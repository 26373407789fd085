"""kiln.script's source rewriter (frontend/script.py), checked with plain-Python primitives.

The rewritten code must keep Python's meaning: each function here is run as written and as
rewritten, on ints, floats and eager torch tensors, with stand-in primitives that simply run the
taken branch / the loop in Python. A second set of stand-ins runs *both* branches of every ``if``
(as tracing a tensor condition does) to check that the branch closures cannot see each other's
assignments. Unsupported constructs must raise ScriptError naming file:line:col and the construct.
"""
import inspect
import traceback

import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln import ScriptError  # noqa: E402
from kiln.frontend.script import rewrite_function, rewritten_source, scripted_model  # noqa: E402


# ============================================================================ stand-in primitives
class PythonOps:
    """Run the taken branch / the loop in Python, and log which primitive ran."""
    UNDEFINED = object()

    def __init__(self):
        self.log = []

    def kiln_if(self, cond, then_fn, else_fn):
        self.log.append("if")
        return then_fn() if cond else else_fn()

    def kiln_while(self, cond_fn, body_fn, state):
        self.log.append("while")
        while cond_fn(*state):
            state = body_fn(*state)
            assert isinstance(state, tuple)
        return state

    def kiln_for_range(self, start, stop, step, body_fn, state):
        self.log.append(("for_range", start, stop, step))
        for i in range(start, stop, step):
            state = body_fn(i, *state)
        return state

    def kiln_for_iter(self, iterable, body_fn, state):
        self.log.append("for_iter")
        for item in iterable:
            state = body_fn(item, *state)
        return state

    def kiln_assert(self, cond, message):
        self.log.append("assert")
        assert cond, message


class BothBranchesOps(PythonOps):
    """Like tracing a tensor condition: both branches run, the taken one's result is returned,
    and neither branch's result may depend on the other having run. (The branch not taken may
    fail, e.g. on a name only the taken path binds: under tracing that is the user's error.)"""

    def kiln_if(self, cond, then_fn, else_fn):
        self.log.append("if")
        taken_fn, other_fn = (then_fn, else_fn) if cond else (else_fn, then_fn)
        first = taken_fn()
        try:
            other_fn()
        except (TypeError, NameError):
            pass
        assert _same(taken_fn(), first), "a branch's result changed after the other branch ran"
        return first


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a is b or a == b


# ============================================================================ functions to rewrite
def if_elif_else(x):
    if x > 3:
        y = x * 2
    elif x < -3:
        y = -x
    else:
        y = x + 100
    return y


def nested_if(x, n):
    z = 0
    if x > 0:
        if n > 2:
            z = x * n
        else:
            z = x - n
            w = 5
            z = z + w
    else:
        if n > 2:
            z = -n
    return z + x


def early_return(x):
    if x < 0:
        return -x
    y = x * 3
    if y > 10:
        return y - 10
    y = y + 1
    return y


def early_return_both_branches(x, n):
    if x > 0:
        if n > 1:
            return x * n
        return x
    else:
        return -x


def early_return_tuple(x):
    if x > 0:
        return x, x + 1
    return x - 1, x


def implicit_none(x):
    if x > 0:
        return x
    x = x * 2


def collatz_steps(n):
    steps = 0
    while n != 1:
        if n % 2 == 0:
            n = n // 2
        else:
            n = 3 * n + 1
        steps += 1
    return steps


def halve_until_small(x):
    while x.abs() > 1:
        x = x / 2
    return x


def for_range_forms(n):
    a = 0
    for i in range(n):
        a += i
    for j in range(2, n):
        a = a * 2 - j
    for k in range(n, 0, -2):
        a -= k
    return a, k if n > 0 else None


def break_continue_for(n):
    total = 0
    for i in range(n):
        if i % 3 == 0:
            continue
        total += i
        if total > 20:
            break
        total *= 2
    return total, i


def break_continue_while(n):
    i = 0
    acc = []
    while True:
        i += 1
        if i % 2:
            continue
        if i > n:
            break
        acc.append(i)
    return acc


def for_else(n, stop):
    found = -1
    for i in range(n):
        if i == stop:
            found = i
            break
    else:
        found = 100
    return found


def while_else(n):
    seen = 0
    while n > 0:
        n -= 1
        seen += 1
    else:
        seen += 1000
    return seen


def nested_loops_inner_break(n):
    pairs = 0
    for i in range(n):
        for j in range(n):
            if j > i:
                break
            pairs += 1
        if pairs > 10:
            break
    return pairs


def tuple_unpacking(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    if a > 10:
        (a, b), c = (b, a), 7
    else:
        c = 0
    return a, b, c


def augmented(x):
    y = x
    y += 1
    y *= 3
    if y > 10:
        y -= 4
        y //= 2
    else:
        y **= 2
    return y


def loop_over_list(xs):
    best = None
    for i, (a, b) in enumerate(zip(xs, xs[1:])):
        d = b - a
        if best is None or d > best:
            best = d
    return best, i


def carried_from_previous_iteration(n):
    out = []
    for i in range(n):
        if i > 0:
            out.append(prev + i)  # noqa: F821 (bound by the previous iteration)
        prev = i * 10  # noqa: F841 (read by the next iteration: the scripter must refuse it)
    return out


def temp_only_in_loop(n):
    total = 0
    for i in range(n):
        t = i * i
        total += t
    return total


def dead_temp_in_branch(x):
    if x > 0:
        t = x * 2
        y = t + 1
    else:
        y = x
    return y


def one_sided_name(x, flag):
    if flag:
        extra = x * 10
    y = x + 1
    if flag:
        y = y + extra
    return y


def conditions(x, y):
    r = 0
    if x > 0 and y > 0:
        r += 1
    if x > 0 or y > 0:
        r += 10
    if not x > 0:
        r += 100
    if -2 < x < 2:
        r += 1000
    if x > 0 and y > 0 or not y < 5:
        r += 10000
    return r


def ternary(x):
    y = x * 2 if x > 0 else -x
    return y + (1 if y > 3 else 0)


def with_assert(x):
    assert x >= 0, "x must be non-negative"
    assert x < 100
    return x + 1


def raises_in_branch(x):
    if x < 0:
        raise ValueError("negative")
    return x * 2


def with_no_grad(x):
    with torch.no_grad():
        if x > 0:
            y = x * 2
        else:
            y = x * 3
    return y


def nested_def(x):
    def inner(v):
        if v > 0:
            return v * 2
        return -v

    return inner(x) + inner(-x)


def _helper(v):
    if v > 1:
        return v - 1
    return v + 1


def calls_helper(x):
    y = _helper(x)
    while y > 5:
        y = _helper(y) - 1
    return y


def range_shadowed(x):
    range = lambda n: [n, n]  # noqa: E731
    total = 0
    for v in range(x):
        total += v
    return total


CASES = [
    (if_elif_else, [(5,), (-5,), (0,), (3.5,), (-3.01,)]),
    (nested_if, [(1, 3), (1, 1), (-1, 3), (-1, 0), (2.5, 2)]),
    (early_return, [(-4,), (0,), (2,), (5,), (3.7,)]),
    (early_return_both_branches, [(2, 3), (2, 0), (-2, 3)]),
    (early_return_tuple, [(1,), (-1,)]),
    (implicit_none, [(1,), (-1,)]),
    (collatz_steps, [(1,), (6,), (27,)]),
    (for_range_forms, [(0,), (1,), (5,), (8,)]),
    (break_continue_for, [(1,), (4,), (10,), (30,)]),
    (break_continue_while, [(0,), (5,), (12,)]),
    (for_else, [(5, 2), (5, 9), (0, 0)]),
    (while_else, [(0,), (3,)]),
    (nested_loops_inner_break, [(0,), (3,), (8,)]),
    (tuple_unpacking, [(0,), (3,), (9,)]),
    (augmented, [(0,), (2,), (5,), (1.5,)]),
    (loop_over_list, [([1, 5, 2, 8],), ([3, 2],)]),
    (carried_from_previous_iteration, [(0,), (1,), (4,)]),
    (temp_only_in_loop, [(0,), (4,)]),
    (one_sided_name, [(1, True), (1, False)]),
    (dead_temp_in_branch, [(2,), (-2,)]),
    (conditions, [(x, y) for x in (-3, -1, 0, 1, 3) for y in (-1, 1, 7)]),
    (ternary, [(3,), (1,), (-5,), (0,)]),
    (with_assert, [(0,), (5,)]),
    (with_no_grad, [(1,), (-1,)]),
    (nested_def, [(2,), (-3,)]),
    (calls_helper, [(0,), (3,), (40,)]),
    (range_shadowed, [(3,)]),
]

TENSOR_CASES = [
    (if_elif_else, [(torch.tensor(5.0),), (torch.tensor(-5.0),), (torch.tensor(0.5),)]),
    (early_return, [(torch.tensor(-4.0),), (torch.tensor(2.0),), (torch.tensor(5.0),)]),
    (halve_until_small, [(torch.tensor(37.0),), (torch.tensor(-0.5),)]),
    (augmented, [(torch.tensor(2.0),), (torch.tensor(5.0),)]),
    (conditions, [(torch.tensor(x), torch.tensor(y)) for x in (-3.0, 0.5, 3.0) for y in (-1.0, 7.0)]),
    (ternary, [(torch.tensor(3.0),), (torch.tensor(-5.0),)]),
    (with_no_grad, [(torch.tensor(1.0),), (torch.tensor(-1.0),)]),
    (nested_if, [(torch.tensor(1.5), 3), (torch.tensor(-1.5), 3)]),
    (dead_temp_in_branch, [(torch.tensor(2.0),), (torch.tensor(-2.0),)]),
]


def _ids(cases):
    return [fn.__name__ for fn, _ in cases]


# Branches that mutate a list: running both (BothBranchesOps) appends twice. Under tracing such a
# branch only runs alone when its condition is a Python value, as it is in these.
MUTATING = {break_continue_while, carried_from_previous_iteration}


@pytest.mark.parametrize("fn,inputs", CASES + TENSOR_CASES, ids=_ids(CASES + TENSOR_CASES))
@pytest.mark.parametrize("ops_cls", [PythonOps, BothBranchesOps], ids=["python", "both-branches"])
def test_rewrite_keeps_python_semantics(fn, inputs, ops_cls):
    if ops_cls is BothBranchesOps and fn in MUTATING:
        pytest.skip("the branches append to a list")
    ops = ops_cls()
    new = rewrite_function(fn, ops)
    assert new is not fn and new.__code__.co_filename == fn.__code__.co_filename
    for args in inputs:
        assert _same(new(*args), fn(*args)), (fn.__name__, args, new(*args), fn(*args))
    if "if" in inspect.getsource(fn):
        assert "if" in ops.log  # the control flow really went through the primitives


@pytest.mark.parametrize("ops_cls", [PythonOps, BothBranchesOps], ids=["python", "both-branches"])
def test_branch_that_raises(ops_cls):
    new = rewrite_function(raises_in_branch, ops_cls())
    if ops_cls is PythonOps:
        assert new(3) == 6
        with pytest.raises(ValueError, match="negative"):
            new(-1)
    else:  # tracing runs both branches: a raise in either is the user's error at trace time
        with pytest.raises(ValueError, match="negative"):
            new(3)


def test_assert_goes_through_kiln_assert_with_the_message():
    ops = PythonOps()
    new = rewrite_function(with_assert, ops)
    assert new(3) == 4 and ops.log.count("assert") == 2
    with pytest.raises(AssertionError, match="x must be non-negative"):
        new(-1)
    with pytest.raises(AssertionError, match=r"assertion failed: x < 100"):
        new(200)


def test_which_primitive_each_loop_becomes():
    ops = PythonOps()
    rewrite_function(for_range_forms, ops)(5)
    assert [e for e in ops.log if isinstance(e, tuple)] == [("for_range", 0, 5, 1), ("for_range", 2, 5, 1),
                                                             ("for_range", 5, 0, -2)]
    ops = PythonOps()
    rewrite_function(loop_over_list, ops)([1, 2, 3])
    assert "for_iter" in ops.log and not any(isinstance(e, tuple) for e in ops.log)
    ops = PythonOps()
    rewrite_function(range_shadowed, ops)(3)  # a local 'range' is not the builtin
    assert "for_iter" in ops.log
    ops = PythonOps()
    rewrite_function(collatz_steps, ops)(6)
    assert ops.log.count("while") == 1


def test_loop_state_is_only_what_is_carried():
    src = rewritten_source(temp_only_in_loop)
    # 't' is recomputed each iteration and unused after the loop: not loop-carried.
    assert "kiln_for_range(0, n, 1, __kiln_body_1, (total,))" in src.replace("__kiln__.", "")
    src = rewritten_source(carried_from_previous_iteration)
    assert "prev" in src.split("kiln_for_range")[1].split("\n")[0]  # read before bound: carried
    src = rewritten_source(dead_temp_in_branch)
    # 't' is bound in one branch only and not read after the if: not an output of the if.
    assert "y, = __kiln__.kiln_if(" in src


def test_early_return_becomes_one_return():
    tree_src = rewritten_source(early_return)
    body = tree_src.split("def early_return(x):")[1]
    assert body.count("return __kiln_ret") == 1
    assert "return -x" not in body


def test_helper_functions_are_rewritten_in_their_globals():
    ops = PythonOps()
    new = rewrite_function(calls_helper, ops)
    assert new(40) == calls_helper(40)
    assert ops.log.count("if") > 2  # _helper's own if ran through the primitives
    assert globals()["_helper"] is _helper  # the module's globals are untouched
    assert "__kiln__" not in globals()


def test_line_numbers_point_at_the_original_source():
    new = rewrite_function(raises_in_branch, PythonOps())
    with pytest.raises(ValueError) as info:
        new(-1)
    frame = traceback.extract_tb(info.tb)[-1]
    lines, first = inspect.getsourcelines(raises_in_branch)
    expected = first + next(i for i, line in enumerate(lines) if "raise ValueError" in line)
    assert frame.filename == __file__ and frame.lineno == expected
    assert "raise ValueError" in frame.line


# ============================================================================ modules
def _scale(v, k):
    if k > 1:
        return v * k
    return v


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.__threshold = 0.0  # a private (mangled) name
        self.steps = 2

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > self.__threshold:
            h = self.refine(h)
        else:
            h = -h
        return _scale(h, self.steps)

    def refine(self, h):
        for _ in range(self.steps):
            h = h * 0.5
            if h.abs().max() < 0.01:
                break
        return h


class SubGate(Gate):
    def forward(self, x):
        y = super().forward(x)
        if y.mean() > 0:
            return y + 1
        return y


def test_module_is_scripted_through_a_proxy():
    torch.manual_seed(0)
    m = Gate().eval()
    ops = PythonOps()
    proxy = scripted_model(m, ops)
    assert proxy is not m and "forward" not in m.__dict__ and "refine" not in m.__dict__
    assert proxy.fc is m.fc and proxy.fc.weight is m.fc.weight
    assert dict(proxy.named_parameters()).keys() == dict(m.named_parameters()).keys()
    for _ in range(6):
        x = torch.randn(2, 3)
        assert torch.equal(proxy(x), m(x))
    assert "for_range" in [e[0] if isinstance(e, tuple) else e for e in ops.log]  # refine was rewritten


def test_subclass_super_call():
    torch.manual_seed(1)
    m = SubGate().eval()
    proxy = scripted_model(m, PythonOps())
    for _ in range(4):
        x = torch.randn(2, 3)
        assert torch.equal(proxy(x), m(x))


def _make_closure(k):
    def f(x):
        if x > k:
            return x - k
        return x + k
    return f


def test_closures_keep_their_values():
    f = _make_closure(3)
    new = rewrite_function(f, PythonOps())
    assert [new(v) for v in (0, 5)] == [f(0), f(5)] == [3, 2]


def test_not_a_module_or_function():
    with pytest.raises(ScriptError, match="Module or a Python function"):
        scripted_model(42, PythonOps())


def test_lambda_is_rejected():
    with pytest.raises(ScriptError, match="lambda"):
        rewrite_function(lambda x: x, PythonOps())


def test_missing_source():
    ns = {}
    exec("def f(x):\n    return x\n", ns)
    with pytest.raises(ScriptError, match="cannot read the source"):
        rewrite_function(ns["f"], PythonOps())


# ============================================================================ unsupported constructs
def uses_try(x):
    try:  # <- error
        y = x + 1
    except TypeError:
        y = 0
    return y


def uses_with(x):
    with open(x) as fh:  # <- error
        return fh.read()


def uses_yield(x):
    for i in range(x):
        yield i  # <- error


def uses_global(x):
    global CASES  # noqa: F824  # <- error
    return x


def uses_nonlocal(x):
    def inner():
        nonlocal x  # <- error
        x = 1
    inner()
    return x


def uses_del(x):
    y = x
    del y  # <- error
    return x


def returns_in_loop(x):
    for i in range(x):
        if i > 3:
            return i  # <- error
    return 0


def defines_class(x):
    class Local:  # <- error
        pass
    return x


def uses_match(x):
    match x:  # <- error
        case 1:
            return 1
    return 0


def walrus_in_while(x):
    while (y := x - 1) > 0:  # <- error
        x = y
    return x


def nested_async(x):
    async def inner():  # <- error
        return x
    return inner


@pytest.mark.parametrize("fn,construct", [
    (uses_try, "try/except"), (uses_with, "a with-statement"), (uses_yield, "yield"),
    (uses_global, "global declaration"), (uses_nonlocal, "nonlocal declaration"), (uses_del, "del"),
    (returns_in_loop, "return inside a loop"), (defines_class, "class definition"),
    (uses_match, "match statement"), (walrus_in_while, "assignment expression (:=) in a while condition"),
    (nested_async, "async def"),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_unsupported_construct_names_line_and_construct(fn, construct):
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if "# <- error" in line)
    line_text = lines[offset].rstrip("\n")
    col = len(line_text) - len(line_text.lstrip())
    if fn is walrus_in_while:
        col = line_text.index("y :=")
    with pytest.raises(ScriptError) as info:
        rewrite_function(fn, PythonOps())
    msg = str(info.value)
    assert f"{__file__}:{first + offset}:{col + 1}: " in msg
    assert construct in msg and "not supported by kiln.script" in msg
    shown = msg.splitlines()
    i = next(k for k, s in enumerate(shown) if s.strip() == line_text.strip())
    assert shown[i + 1] == " " * 4 + " " * col + "^"  # the caret sits under the construct
    assert len(shown) > i + 2 and shown[i + 2].strip()  # and advice follows


def test_error_in_a_method_is_reported_at_the_method():
    class Bad(torch.nn.Module):
        def forward(self, x):
            return self.helper(x)

        def helper(self, x):
            del x  # <- here
            return 0

    lines, first = inspect.getsourcelines(Bad.helper)
    with pytest.raises(ScriptError, match=rf":{first + 1}:13: del is not supported"):
        scripted_model(Bad(), PythonOps())


# ============================================================================ kiln.script end to end
def _script_ops_available():
    try:
        import kiln.frontend.script_ops  # noqa: F401
    except ImportError:
        return False
    return True


class Classic(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        else:
            return x * -1


needs_ops = pytest.mark.skipif(not _script_ops_available(), reason="frontend/script_ops.py not written yet")


def _run(graph, **inputs):
    return kiln.load(graph).run({k: v.numpy() for k, v in inputs.items()}, as_list=True)


@needs_ops
def test_kiln_script_keeps_the_data_dependent_branch():
    m = Classic()
    g = kiln.script(m, torch.ones(2, 3))
    assert any(n.op == "If" for n in g.nodes)
    for sign in (1.0, -1.0):
        x = torch.rand(2, 3) * sign
        (out,) = _run(g, x=x)
        assert torch.allclose(torch.as_tensor(out), m(x))
    assert "forward" not in m.__dict__  # the user's module is left as it was


class Halve(torch.nn.Module):
    def forward(self, x):
        while x.norm() > 1:
            x = x / 2
        return x


class RNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ih, self.hh = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.zeros(x.size(0), 8)
        for t in range(x.size(1)):
            h = self.step(x[:, t], h)
        return h

    def step(self, xt, h):
        return torch.tanh(self.ih(xt) + self.hh(h))


@needs_ops
def test_kiln_script_loops():
    g = kiln.script(Halve(), torch.full((3,), 10.0))
    assert any(n.op == "Loop" for n in g.nodes)
    for scale in (0.1, 5.0, 300.0):
        x = torch.randn(3) * scale
        assert torch.allclose(torch.as_tensor(_run(g, x=x)[0]), Halve()(x))
    torch.manual_seed(0)
    rnn = RNN().eval()
    g = kiln.script(rnn, torch.randn(2, 5, 4), dynamic={"x": {1: "seq"}})
    assert any(n.op == "Loop" for n in g.nodes)
    for seq in (3, 9):
        x = torch.randn(2, seq, 4)
        assert torch.allclose(torch.as_tensor(_run(g, x=x)[0]), rnn(x), atol=1e-5)
