"""`pallas_gemm.dot_general` on every dimension-number form.

`FORMS` lists each form the tests and the examples use; the table in
docs/dot_general.md (linked from the README) is rendered from it
(`python tests/test_dot_general.py` prints it) and
`test_docs_table_lists_every_form` keeps the two equal.
"""

from __future__ import annotations

import logging
import os
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import api, dimension_numbers, numerics, primitive

HI = jax.lax.Precision.HIGHEST
TOL = numerics.tolerance("float32", "ieee")

# (what it is, lhs shape, rhs shape, dimension numbers). Shapes are tiny:
# every case runs a Pallas kernel in interpret mode on a CPU.
FORMS = [
    ("matmul", (6, 5), (5, 4), (((1,), (0,)), ((), ()))),
    ("A^T B: contracting dim 0", (5, 6), (5, 4), (((0,), (0,)), ((), ()))),
    ("A B^T", (6, 5), (4, 5), (((1,), (1,)), ((), ()))),
    ("A^T B^T", (5, 6), (4, 5), (((0,), (1,)), ((), ()))),
    ("nnx.Linear / Dense 'btd,dh->bth'", (2, 3, 8), (8, 5),
     (((2,), (0,)), ((), ()))),
    ("nnx.LinearGeneral, two contracting axes (axis=(-2, -1))", (2, 4, 3, 5),
     (3, 5, 6), (((2, 3), (0, 1)), ((), ()))),
    ("nnx.LinearGeneral, out_features tuple 'btd,dnh->btnh'", (2, 3, 8),
     (8, 2, 4), (((2,), (0,)), ((), ()))),
    ("nnx.LinearGeneral, in_features tuple 'btnh,nhd->btd'", (2, 3, 2, 4),
     (2, 4, 8), (((2, 3), (0, 1)), ((), ()))),
    ("nnx.LinearGeneral, batch_axis 'bd,bdh->bh'", (3, 8), (3, 8, 5),
     (((1,), (1,)), ((0,), (0,)))),
    ("nnx.Einsum 'btd,dnh->btnh'", (2, 3, 8), (8, 2, 4),
     (((2,), (0,)), ((), ()))),
    ("nnx.Einsum 'btd,dnh->bnth' (as jnp.einsum issues it: 'dnh,btd->nhbt')",
     (8, 2, 4), (2, 3, 8), (((0,), (2,)), ((), ()))),
    ("attention logits 'btnh,bsnh->bnts'", (2, 3, 2, 4), (2, 5, 2, 4),
     (((3,), (3,)), ((0, 2), (0, 2)))),
    ("attention values 'bnts,bsnh->bnth'", (2, 2, 3, 5), (2, 5, 2, 4),
     (((3,), (1,)), ((0, 1), (0, 2)))),
    ("attention values as jnp.einsum issues 'bnts,bsnh->btnh'", (2, 5, 2, 4),
     (2, 2, 3, 5), (((1,), (3,)), ((0, 2), (0, 1)))),
    ("attention logits, heads first 'bnth,bnsh->bnts'", (2, 2, 3, 4),
     (2, 2, 5, 4), (((3,), (3,)), ((0, 1), (0, 1)))),
    ("attention values, heads first 'bnts,bnsh->bnth'", (2, 2, 3, 5),
     (2, 2, 5, 4), (((3,), (2,)), ((0, 1), (0, 1)))),
    ("batched matmul", (3, 5, 7), (3, 7, 4), (((2,), (1,)), ((0,), (0,)))),
    ("batch dims in the middle", (4, 3, 5), (5, 3, 4),
     (((0,), (2,)), ((1,), (1,)))),
    ("batch dims trailing", (5, 6, 3), (6, 4, 3),
     (((1,), (0,)), ((2,), (2,)))),
    ("batch dims in swapped order", (2, 3, 5, 6), (3, 2, 6, 4),
     (((3,), (2,)), ((0, 1), (1, 0)))),
    ("two contracting dims in opposite orders", (3, 4, 5), (5, 4, 2),
     (((1, 2), (1, 0)), ((), ()))),
    ("contracting dims apart, free in between", (4, 3, 5), (4, 5, 2),
     (((0, 2), (0, 1)), ((), ()))),
    ("3-D rhs, free dims on both sides", (3, 4, 6), (6, 2, 5),
     (((2,), (0,)), ((), ()))),
    ("outer product (no contracting dim)", (4, 3), (5,),
     (((), ()), ((), ()))),
    ("vector dot", (7,), (7,), (((0,), (0,)), ((), ()))),
]

LAX_FORMS = [
    ("int32 operands", (4, 5), (5, 3), (((1,), (0,)), ((), ())),
     "lax (the kernels take float32, bfloat16, float16)"),
]


def _letters(lhs_ndim, rhs_ndim, dims):
  """einsum subscripts for dot_general dimension numbers (lax's out order)."""
  (lc, rc), (lb, rb) = dims
  pool = iter(string.ascii_letters)
  lhs = [next(pool) for _ in range(lhs_ndim)]
  rhs = [next(pool) for _ in range(rhs_ndim)]
  for l, r in list(zip(lc, rc)) + list(zip(lb, rb)):
    rhs[r] = lhs[l]
  out = ([lhs[d] for d in lb]
         + [lhs[d] for d in range(lhs_ndim) if d not in lc + lb]
         + [rhs[d] for d in range(rhs_ndim) if d not in rc + rb])
  return "".join(lhs), "".join(rhs), "".join(out)


def _f64(x):
  return np.asarray(x, np.float64)


def reference(lhs, rhs, dims):
  l, r, o = _letters(lhs.ndim, rhs.ndim, dims)
  return np.einsum(f"{l},{r}->{o}", _f64(lhs), _f64(rhs))


_RNG = np.random.default_rng(0)


def rand(shape, dtype=jnp.float32):
  # NumPy's generator: jax.random compiles anew for every shape, which
  # costs more than the tiny GEMMs tested here.
  return jnp.asarray(_RNG.standard_normal(shape, np.float32), dtype)


def random_form(seed):
  """A random valid form: batch, contracting and free dims of both operands
  placed at random positions."""
  rng = np.random.default_rng(seed)
  nb, nc = rng.integers(0, 3), rng.integers(0, 3)
  nlf, nrf = rng.integers(0, 3), rng.integers(0, 3)
  sizes = lambda n: [int(s) for s in rng.integers(1, 5, n)]
  batch, contract = sizes(nb), sizes(nc)
  lhs_axes = ([("b", i) for i in range(nb)] + [("c", i) for i in range(nc)]
              + [("f", s) for s in sizes(nlf)])
  rhs_axes = ([("b", i) for i in range(nb)] + [("c", i) for i in range(nc)]
              + [("f", s) for s in sizes(nrf)])
  rng.shuffle(lhs_axes)
  rng.shuffle(rhs_axes)

  def size(axis):
    kind, value = axis
    return batch[value] if kind == "b" else contract[value] if kind == "c" \
        else value

  def where(axes, kind, i):
    return axes.index((kind, i))

  order = rng.permutation(nc)
  dims = ((tuple(where(lhs_axes, "c", i) for i in order),
           tuple(where(rhs_axes, "c", i) for i in order)),
          (tuple(where(lhs_axes, "b", i) for i in range(nb)),
           tuple(where(rhs_axes, "b", i) for i in range(nb))))
  return (tuple(size(a) for a in lhs_axes), tuple(size(a) for a in rhs_axes),
          dims)


RANDOM_FORMS = [(f"random form {seed}",) + random_form(seed)
                for seed in range(12)]
ALL_FORMS = FORMS + RANDOM_FORMS


@pytest.fixture
def xla_body(monkeypatch):
  """Lowers each `pallas_gemm` equation to XLA's dot instead of the chosen
  kernel's interpret-mode body. The jaxpr, the dispatch's choices and the
  grad/vmap rules are unchanged: this keeps the many-form tests fast, while
  the kernels' own numerics are tested in test_api.py and test_triton.py
  (and the named FORMS above run on the real kernels)."""
  real = primitive._run_kernel

  def on_xla(*operands, **params):
    return real(*operands, **dict(params, kernel="xla", config=None))
  monkeypatch.setattr(primitive, "_run_kernel", on_xla)


def _primitives(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return [e.primitive.name for e in closed.jaxpr.eqns]


@pytest.mark.parametrize("name, lhs_shape, rhs_shape, dims", FORMS,
                         ids=[f[0] for f in FORMS])
def test_form_matches_float64_and_runs_on_pallas_gemm(name, lhs_shape,
                                                      rhs_shape, dims):
  _check_form(lhs_shape, rhs_shape, dims)


@pytest.mark.parametrize("name, lhs_shape, rhs_shape, dims", RANDOM_FORMS,
                         ids=[f[0] for f in RANDOM_FORMS])
def test_random_form(name, lhs_shape, rhs_shape, dims, xla_body):
  _check_form(lhs_shape, rhs_shape, dims)


def _check_form(lhs_shape, rhs_shape, dims):
  lhs, rhs = rand(lhs_shape), rand(rhs_shape)
  expected = jax.lax.dot_general(lhs, rhs, dims, precision=HI)
  out = pallas_gemm.dot_general(lhs, rhs, dims, precision=HI)
  assert out.shape == expected.shape and out.dtype == expected.dtype
  err = numerics.relative_error(out, reference(lhs, rhs, dims))
  assert err <= TOL, f"relative error {err:.3g} > {TOL:.3g}"

  names = _primitives(lambda a, b: pallas_gemm.dot_general(a, b, dims),
                      lhs, rhs)
  plan = dimension_numbers.plan(lhs_shape, rhs_shape, dims)
  if plan.copies and api._resolve_planned(plan, lhs, rhs, None,
                                          None).kernel == "xla":
    # The dispatch gives this GEMM to XLA (e.g. a GPU table's tiny-shape
    # buckets): lax runs it without the copy.
    assert names == ["dot_general"], names
    return
  assert "pallas_gemm" in names and "dot_general" not in names, names
  assert ("transpose" in names) == bool(plan.copies), (names, plan)


@pytest.mark.parametrize("name, lhs_shape, rhs_shape, dims", ALL_FORMS,
                         ids=[f[0] for f in ALL_FORMS])
def test_form_grad_and_vmap(name, lhs_shape, rhs_shape, dims, xla_body):
  lhs, rhs = rand(lhs_shape), rand(rhs_shape)
  out_shape = jax.eval_shape(
      lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs).shape
  w = rand(out_shape)
  ours = jax.jit(jax.grad(lambda a, b: jnp.sum(
      pallas_gemm.dot_general(a, b, dims, precision=HI) * w), (0, 1)))
  l, r, o = _letters(lhs.ndim, rhs.ndim, dims)
  grads_f64 = (np.einsum(f"{o},{r}->{l}", _f64(w), _f64(rhs)),
               np.einsum(f"{l},{o}->{r}", _f64(lhs), _f64(w)))
  for got, want in zip(ours(lhs, rhs), grads_f64):
    assert numerics.relative_error(got, want) <= TOL

  # vmap over a new leading axis of the lhs only, then of both operands.
  lhs_stack = rand((2,) + lhs_shape)
  out = jax.vmap(lambda a: pallas_gemm.dot_general(a, rhs, dims,
                                                   precision=HI))(lhs_stack)
  expected = np.stack([reference(x, rhs, dims) for x in lhs_stack])
  assert numerics.relative_error(out, expected) <= TOL
  rhs_stack = rand((2,) + rhs_shape)
  out = jax.vmap(lambda a, b: pallas_gemm.dot_general(a, b, dims,
                                                      precision=HI))(
      lhs_stack, rhs_stack)
  expected = np.stack([reference(x, y, dims)
                       for x, y in zip(lhs_stack, rhs_stack)])
  assert numerics.relative_error(out, expected) <= TOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_and_preferred_element_type(dtype):
  name, lhs_shape, rhs_shape, dims = FORMS[5]  # two contracting dims
  lhs, rhs = rand(lhs_shape, dtype), rand(rhs_shape, dtype)
  for preferred in (None, jnp.float32):
    out = pallas_gemm.dot_general(lhs, rhs, dims,
                                  preferred_element_type=preferred)
    expected = jax.lax.dot_general(lhs, rhs, dims,
                                   preferred_element_type=preferred)
    assert out.dtype == expected.dtype
    tol = numerics.tolerance(jnp.dtype(dtype).name, "default",
                             jnp.dtype(out.dtype).name)
    assert numerics.relative_error(out, reference(lhs, rhs, dims)) <= tol


def test_lax_forms_stay_on_lax_and_are_explained(caplog):
  for name, lhs_shape, rhs_shape, dims, _ in LAX_FORMS:
    ints = jnp.arange(np.prod(lhs_shape), dtype=jnp.int32).reshape(lhs_shape)
    other = jnp.ones(rhs_shape, jnp.int32)
    out = pallas_gemm.dot_general(ints, other, dims)
    np.testing.assert_array_equal(out, jax.lax.dot_general(ints, other, dims))
    explanation = pallas_gemm.explain(ints, other, fn=pallas_gemm.dot_general,
                                      dimension_numbers=dims)
    assert not explanation.calls
    assert any("int32 operands" in why for why in explanation.lax)


def test_copy_left_to_lax_where_the_dispatch_picks_xla(caplog, monkeypatch):
  """A form that needs a copy (its batch dim in the middle), where the
  dispatch gives the GEMM to XLA (on a CPU, a problem past interpret mode's
  budget, as here; on a GPU, where XLA measured faster): the operands are not
  copied for XLA's sake, lax.dot_general takes them as they are, logged
  once."""
  lhs = jax.ShapeDtypeStruct((512, 8, 1024), jnp.float32)
  rhs = jax.ShapeDtypeStruct((1024, 8, 512), jnp.float32)
  dims = (((2,), (0,)), ((1,), (1,)))
  xla = pallas_gemm.Resolution("xla", None, "order", "none",
                               "XLA wins this bucket")
  monkeypatch.setattr(api.dispatch, "resolve", lambda *args: xla)
  assert dimension_numbers.plan(lhs.shape, rhs.shape, dims).copies
  fn = lambda a, b: pallas_gemm.dot_general(a, b, dims)
  api._LOGGED_REASONS.clear()
  with caplog.at_level(logging.DEBUG, logger="pallas_gemm.api"):
    names = _primitives(fn, lhs, rhs)
    _primitives(fn, lhs, rhs)
  assert names.count("dot_general") == 1 and "transpose" not in names
  logged = [r for r in caplog.records if "transpose copy" in r.getMessage()]
  assert len(logged) == 1
  explanation = pallas_gemm.explain(lhs, rhs, fn=pallas_gemm.dot_general,
                                    dimension_numbers=dims)
  assert "XLA" in "".join(explanation.lax) and not explanation.calls


def test_free_forms_explain_a_gemm_and_nothing_on_lax():
  name, lhs_shape, rhs_shape, dims = FORMS[6]
  explanation = pallas_gemm.explain(rand(lhs_shape), rand(rhs_shape),
                                    fn=pallas_gemm.dot_general,
                                    dimension_numbers=dims)
  assert len(explanation.calls) == 1 and not explanation.lax
  problem = explanation.calls[0][0]
  assert (problem.m, problem.n, problem.k) == (6, 8, 8)


@pytest.mark.parametrize("dims, error", [
    ((((1,), (1,)), ((), ())), TypeError),     # sizes differ
    ((((3,), (0,)), ((), ())), TypeError),     # out of range
    ((((1,), (0, 1)), ((), ())), TypeError),   # unpaired
])
def test_invalid_dimension_numbers_raise_as_lax_does(dims, error):
  lhs, rhs = rand((4, 5)), rand((5, 3))
  with pytest.raises(error):
    jax.lax.dot_general(lhs, rhs, dims)
  with pytest.raises(error):
    pallas_gemm.dot_general(lhs, rhs, dims)


def test_unknown_keyword_is_refused():
  with pytest.raises(TypeError, match="unexpected"):
    pallas_gemm.dot_general(rand((4, 5)), rand((5, 3)),
                            (((1,), (0,)), ((), ())), bogus=1)


def test_size_one_axes_move_for_free():
  # The batch axis is in the middle, but it has size 1: no copy.
  dims = (((0,), (2,)), ((1,), (1,)))
  plan = dimension_numbers.plan((4, 1, 5), (5, 1, 4), dims)
  assert not plan.copies


# -------------------------------------------------------- the docs table ---


def _route(lhs_shape, rhs_shape, dims):
  plan = dimension_numbers.plan(lhs_shape, rhs_shape, dims)
  if not plan.copies:
    return "pallas_gemm"
  return (f"pallas_gemm after a transpose of {' and '.join(plan.copies)} "
          "(lax where the dispatch picks XLA for the GEMM)")


def _dims_text(dims):
  (lc, rc), (lb, rb) = dims
  return f"`{tuple(lc)}, {tuple(rc)}` / `{tuple(lb)}, {tuple(rb)}`"


def forms_table() -> str:
  rows = ["| form | contracting / batch dims | runs on |",
          "|---|---|---|"]
  for name, lhs_shape, rhs_shape, dims in FORMS:
    rows.append(f"| {name} | {_dims_text(dims)} | "
                f"{_route(lhs_shape, rhs_shape, dims)} |")
  for name, _, _, dims, route in LAX_FORMS:
    rows.append(f"| {name} | {_dims_text(dims)} | {route} |")
  return "\n".join(rows)


@pytest.mark.parametrize("page", ["README.md", "docs/dot_general.md"])
def test_docs_table_lists_every_form(page):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, page), encoding="utf-8") as f:
    text = f.read()
  assert forms_table() in text, (
      f"{page}'s table is out of date; print it with "
      "`python tests/test_dot_general.py`")
  # Every Flax form runs on pallas_gemm with no copy.
  for name, lhs_shape, rhs_shape, dims in FORMS:
    if name.startswith("nnx.") or "Dense" in name:
      assert _route(lhs_shape, rhs_shape, dims) == "pallas_gemm", name


if __name__ == "__main__":
  print(forms_table())
