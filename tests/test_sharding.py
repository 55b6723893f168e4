"""Multi-device partitioning of `pallas_gemm.matmul` on 8 simulated CPU devices.

The device count is fixed when JAX initialises its CPU backend, so the cases
run in a fresh interpreter: each test below starts this file as a script
(`python tests/test_sharding.py <group>`) with
`--xla_force_host_platform_device_count=8`, which prints one JSON record per
case; the test then asserts on those records. Pytest workers never change
their own device count.

Each sharded case checks, against the same function written with `jnp.dot`:
  * the result, against a float64 NumPy reference;
  * the compiled HLO: no more all-gathers than `jnp.dot` needs, and exactly
    the collective the layout calls for (none for batch/M/N, an all-reduce
    or a reduce-scatter for K);
  * the output sharding, which must be the one `jnp.dot` gets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8
GROUPS = ("one_axis", "two_axis", "layouts_and_epilogue", "transforms",
          "fallbacks")
_RESULT_MARKER = "SHARDING_CASES_JSON:"


# ------------------------------------------------------------ pytest side ---


def _run_group(group: str) -> list[dict]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={NUM_DEVICES}")
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), group], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(_RESULT_MARKER)]
  if proc.returncode != 0 or not lines:
    raise AssertionError(
        f"case group {group!r} exited with {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
  return json.loads(lines[-1][len(_RESULT_MARKER):])


@pytest.mark.parametrize("group", GROUPS)
def test_sharding_cases(group):
  records = _run_group(group)
  assert records, f"group {group!r} ran no cases"
  failures = [r for r in records if not r["ok"]]
  assert not failures, "\n".join(
      f"{r['name']}: {r['problems']}" for r in failures)


_GPU_PATTERNS = {  # name: (a spec, b spec, collectives expected)
    "M": (("x", None), (None, None), []),
    "N": ((None, None), (None, "x"), []),
    "K": ((None, "x"), ("x", None), ["all-reduce"]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", sorted(_GPU_PATTERNS))
def test_sharded_on_two_gpus(pattern):
  """The compiled kernels through the partitioner, on 2 real GPUs."""
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

  import pallas_gemm
  from pallas_gemm import numerics

  if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",),
              axis_types=(AxisType.Auto,))
  a_spec, b_spec, expected = _GPU_PATTERNS[pattern]
  m, n, k = 1024, 768, 512
  key_a, key_b = jax.random.split(numerics.fresh_key())
  a = numerics.random_normal(key_a, (m, k), "bfloat16")
  b = numerics.random_normal(key_b, (k, n), "bfloat16")
  compiled = jax.jit(
      pallas_gemm.matmul,
      in_shardings=(NamedSharding(mesh, PartitionSpec(*a_spec)),
                    NamedSharding(mesh, PartitionSpec(*b_spec)))
  ).lower(a, b).compile()
  out = compiled(a, b)
  err = numerics.relative_error(out, numerics.reference_matmul(a, b))
  assert err <= numerics.tolerance("bfloat16", "default", "bfloat16"), err
  assert _collectives(compiled.as_text()) == expected


def test_multi_gpu_script_cpu_smoke(tmp_path):
  """experiments/lab/multi_gpu.py end to end on simulated CPU devices."""
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "lab", "multi_gpu.py"),
       "--cpu_smoke", "--max_devices=2", "--iters=2",
       f"--output_dir={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  result = json.loads((tmp_path / "multi_gpu.json").read_text())
  rows = [r for r in result["rows"] if "impl" in r]
  assert {(r["devices"], r["impl"]) for r in rows} == {
      (1, "pallas_gemm"), (1, "jnp.dot"), (2, "pallas_gemm"), (2, "jnp.dot")}
  for row in rows:
    assert row["within_tolerance"], row
    assert row["collectives"] == [], row
  assert (tmp_path / "multi_gpu.md").exists()


# ------------------------------------------------------------ worker side ---
# Everything below runs only in the subprocess, after XLA_FLAGS is set.


def _collectives(hlo_text: str) -> list[str]:
  return re.findall(
      r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|"
      r"collective-permute)(?:-start)?\(", hlo_text)


class _Cases:
  """The cases, one method per group; each appends records to `self.records`."""

  def __init__(self):
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import pallas_gemm
    from pallas_gemm import numerics
    from pallas_gemm import shapes

    self.jax, self.jnp, self.pallas_gemm = jax, jnp, pallas_gemm
    self.numerics, self.shapes = numerics, shapes
    self.P, self.NamedSharding = PartitionSpec, NamedSharding
    auto = AxisType.Auto
    self.mesh_1d = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(auto,))
    self.mesh_2d = jax.make_mesh((2, 4), ("data", "model"),
                                 axis_types=(auto, auto))
    # jax.make_mesh's default: shardings are part of the array types.
    self.mesh_explicit = jax.make_mesh((NUM_DEVICES,), ("x",))
    self.records: list[dict] = []

  # ---- helpers ----

  def sharding(self, mesh, *spec):
    return self.NamedSharding(mesh, self.P(*spec))

  def operands(self, shape, *, dtype="float32", layout="NN", batch=None,
               with_c=False, with_bias=False):
    m, n, k = shape
    key = self.numerics.fresh_key()
    keys = self.jax.random.split(key, 4)
    lead = (batch,) if batch else ()
    a_shape = lead + ((k, m) if layout[0] == "T" else (m, k))
    b_shape = lead + ((n, k) if layout[1] == "T" else (k, n))
    rn = self.numerics.random_normal
    return (rn(keys[0], a_shape, dtype), rn(keys[1], b_shape, dtype),
            rn(keys[2], lead + (m, n), "float32") if with_c else None,
            rn(keys[3], (n,), "float32") if with_bias else None)

  def record(self, name, problems, **info):
    self.records.append(dict(name=name, ok=not problems, problems=problems,
                             **info))

  def check_sharded(self, name, mesh, shape, specs, *, kernel,
                    layout="NN", dtype="float32", batch=None, out_spec=None,
                    alpha=1.0, beta=0.0, activation=None, expect=()):
    """One sharded matmul against jnp.dot under the same jit shardings.

    `specs` gives the PartitionSpec of a, b and (when present) c and bias;
    `expect` is the multiset of collectives the layout calls for.
    """
    jax, jnp, numerics = self.jax, self.jnp, self.numerics
    with_c, with_bias = len(specs) > 2 and specs[2] is not None, len(specs) > 3
    a, b, c, bias = self.operands(shape, dtype=dtype, layout=layout,
                                  batch=batch, with_c=with_c,
                                  with_bias=with_bias)
    args = [x for x in (a, b, c, bias) if x is not None]
    in_shardings = tuple(self.sharding(mesh, *s) for s in specs
                         if s is not None)
    ta, tb = layout[0] == "T", layout[1] == "T"
    precision = "highest" if dtype == "float32" else None

    def ours(*xs):
      a, b, *rest = xs
      c = rest.pop(0) if with_c else None
      bias = rest.pop(0) if with_bias else None
      return self.pallas_gemm.matmul(
          a, b, kernel=kernel, precision=precision, transpose_a=ta,
          transpose_b=tb, alpha=alpha, beta=beta, c=c, bias=bias,
          activation=activation)

    def reference(*xs):
      a, b, *rest = xs
      c = rest.pop(0) if with_c else None
      bias = rest.pop(0) if with_bias else None
      op_a = jnp.swapaxes(a, -1, -2) if ta else a
      op_b = jnp.swapaxes(b, -1, -2) if tb else b
      acc = alpha * jnp.matmul(op_a, op_b, precision=precision,
                               preferred_element_type=jnp.float32)
      if c is not None:
        acc = acc + beta * c
      if bias is not None:
        acc = acc + bias
      if activation is not None:
        acc = self.pallas_gemm.ACTIVATIONS[activation](acc)
      return acc.astype(a.dtype)

    jit_kwargs = dict(in_shardings=in_shardings)
    if out_spec is not None:
      jit_kwargs["out_shardings"] = self.sharding(mesh, *out_spec)
    ours_compiled = jax.jit(ours, **jit_kwargs).lower(*args).compile()
    ref_compiled = jax.jit(reference, **jit_kwargs).lower(*args).compile()
    out = ours_compiled(*args)
    ref_out = ref_compiled(*args)
    ours_hlo = _collectives(ours_compiled.as_text())
    ref_hlo = _collectives(ref_compiled.as_text())

    epilogue = self.pallas_gemm.Epilogue(
        alpha=alpha, beta=beta, has_c=with_c and beta != 0.0,
        has_bias=with_bias, activation=activation)
    expected = numerics.reference_matmul(
        a, b, transpose_a=ta, transpose_b=tb, epilogue=epilogue, c=c,
        bias=bias)
    err = numerics.relative_error(out, expected)
    tol = numerics.tolerance(dtype, "ieee" if dtype == "float32" else
                             "default", dtype)
    problems = []
    if err > tol:
      problems.append(f"relative error {err:.3g} > {tol:.3g}")
    if ours_hlo.count("all-gather") > ref_hlo.count("all-gather"):
      problems.append(f"all-gathers {ours_hlo} where jnp.dot has {ref_hlo}")
    if sorted(ours_hlo) != sorted(expect):
      problems.append(f"collectives {ours_hlo}, expected {list(expect)}")
    if out.sharding.spec != ref_out.sharding.spec and out_spec is None:
      problems.append(f"output sharded {out.sharding.spec}, jnp.dot's "
                      f"{ref_out.sharding.spec}")
    self.record(name, problems, error=err, ours=ours_hlo, jnp_dot=ref_hlo,
                out_spec=str(out.sharding.spec))

  # ---- groups ----

  def one_axis(self):
    mesh, small = self.mesh_1d, self.shapes.CPU_SMALL[0]  # (64, 64, 64)
    for kernel in ("triton/02_k_loop", "xla"):
      self.check_sharded(f"{kernel} M", mesh, small,
                         [("x", None), (None, None)], kernel=kernel)
      self.check_sharded(f"{kernel} N", mesh, small,
                         [(None, None), (None, "x")], kernel=kernel)
      self.check_sharded(f"{kernel} K all-reduce", mesh, small,
                         [(None, "x"), ("x", None)], kernel=kernel,
                         expect=["all-reduce"])
    self.check_sharded("K reduce-scatter into M", mesh, small,
                       [(None, "x"), ("x", None)], kernel="triton/02_k_loop",
                       out_spec=("x", None), expect=["reduce-scatter"])
    self.check_sharded("bf16 K all-reduce", mesh, small,
                       [(None, "x"), ("x", None)], kernel="triton/02_k_loop",
                       dtype="bfloat16", expect=["all-reduce"])

  def two_axis(self):
    mesh, shape = self.mesh_2d, self.shapes.CPU_SMALL[2]  # (192, 160, 96)
    kernel = "triton/02_k_loop"
    self.check_sharded("data M x model N", mesh, shape,
                       [("data", None), (None, "model")], kernel=kernel)
    self.check_sharded("data M x model K (Megatron row-parallel)", mesh,
                       shape, [("data", "model"), ("model", None)],
                       kernel=kernel, expect=["all-reduce"])
    self.check_sharded("batch over data, N over model", mesh, (32, 40, 24),
                       [("data", None, None), ("data", None, "model")],
                       kernel=kernel, batch=4)
    self.check_sharded("batch over both axes", mesh, (16, 24, 32),
                       [(("data", "model"),), (("data", "model"),)],
                       kernel="xla", batch=8)

  def layouts_and_epilogue(self):
    mesh, shape = self.mesh_2d, self.shapes.CPU_SMALL[0]
    kernel = "triton/02_k_loop"
    # transpose_a: a is (k, m); transpose_b: b is (n, k).
    self.check_sharded("TN, M over data, N over model", mesh, shape,
                       [(None, "data"), (None, "model")], kernel=kernel,
                       layout="TN")
    self.check_sharded("NT, K over model", mesh, shape,
                       [("data", "model"), (None, "model")], kernel=kernel,
                       layout="NT", expect=["all-reduce"])
    self.check_sharded("TT, M over data, N over model", mesh, shape,
                       [(None, "data"), ("model", None)], kernel=kernel,
                       layout="TT")
    epilogue = dict(alpha=0.5, beta=-1.5, activation="gelu")
    self.check_sharded("epilogue, M and N sharded", mesh, shape,
                       [("data", None), (None, "model"), ("data", "model"),
                        ("model",)], kernel=kernel, **epilogue)
    # The epilogue must run once, after the K reduction: a bias or c added
    # per shard would be counted four times, and relu of partial sums is
    # not relu of the sum.
    self.check_sharded("epilogue after the K all-reduce", mesh, shape,
                       [("data", "model"), ("model", None), ("data", None),
                        (None,)], kernel=kernel, alpha=2.0, beta=0.5,
                       activation="relu", expect=["all-reduce"])
    self.check_sharded("epilogue after the K reduce-scatter", self.mesh_1d,
                       shape, [(None, "x"), ("x", None), ("x", None), (None,)],
                       kernel=kernel, beta=1.0, activation="tanh",
                       out_spec=("x", None), expect=["reduce-scatter"])
    self.check_sharded("batched epilogue", mesh, (16, 24, 32),
                       [("data", None, None), ("data", None, "model"),
                        ("data", None, "model"), ("model",)],
                       kernel=kernel, batch=4, beta=1.0, activation="silu")

  def transforms(self):
    jax, jnp, numerics = self.jax, self.jnp, self.numerics
    matmul, P = self.pallas_gemm.matmul, self.P
    kernel = "triton/02_k_loop"
    mesh = self.mesh_2d
    shape = self.shapes.CPU_SMALL[0]
    a, b, _, _ = self.operands(shape)
    tol = numerics.tolerance("float32", "ieee")

    def ours(a, b):
      return matmul(a, b, kernel=kernel, precision="highest")

    def ref(a, b):
      return jnp.matmul(a, b, precision="highest")

    def check(name, out, expected, extra=()):
      err = numerics.relative_error(out, expected)
      problems = list(extra)
      if err > tol:
        problems.append(f"relative error {err:.3g} > {tol:.3g}")
      self.record(name, problems, error=err)

    # vmap over a sharded leading axis, shared B sharded along K.
    av, _, _, _ = self.operands((16, 32, 64), batch=4)
    shardings = (self.sharding(mesh, "data", None, "model"),
                 self.sharding(mesh, "model", None))
    vm = jax.jit(jax.vmap(ours, in_axes=(0, None)), in_shardings=shardings)
    vm_ref = jax.jit(jax.vmap(ref, in_axes=(0, None)), in_shardings=shardings)
    hlo = _collectives(vm.lower(av, b).compile().as_text())
    hlo_ref = _collectives(vm_ref.lower(av, b).compile().as_text())
    check("vmap of a sharded matmul", vm(av, b),
          numerics.reference_matmul(av, b),
          [] if hlo.count("all-gather") <= hlo_ref.count("all-gather") else
          [f"all-gathers {hlo} where jnp has {hlo_ref}"])

    # grad: dA and dB are pallas_gemm products of sharded operands too.
    def loss(f):
      return lambda a, b: jnp.sum(jnp.tanh(f(a, b)))
    shardings = (self.sharding(mesh, "data", None),
                 self.sharding(mesh, None, "model"))
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1)),
                    in_shardings=shardings)(a, b)
    grads_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1)),
                        in_shardings=shardings)(a, b)
    for name, g, g_ref in zip(("dA", "dB"), grads, grads_ref):
      check(f"grad {name} of a sharded matmul", g, g_ref,
            [] if g.sharding.spec == g_ref.sharding.spec else
            [f"{name} sharded {g.sharding.spec}, jnp's {g_ref.sharding.spec}"])

    # shard_map: the kernel sees local blocks; vma checking stays on.
    mesh1 = self.mesh_1d
    a_m = jax.device_put(a, self.sharding(mesh1, "x", None))
    b_r = jax.device_put(b, self.sharding(mesh1))
    local = jax.jit(jax.shard_map(ours, mesh=mesh1, in_specs=(P("x"), P()),
                                  out_specs=P("x")))
    check("shard_map, rows per device", local(a_m, b_r),
          numerics.reference_matmul(a, b))
    a_k = jax.device_put(a, self.sharding(mesh1, None, "x"))
    b_k = jax.device_put(b, self.sharding(mesh1, "x", None))
    summed = jax.jit(jax.shard_map(
        lambda a, b: jax.lax.psum(ours(a, b), "x"), mesh=mesh1,
        in_specs=(P(None, "x"), P("x")), out_specs=P()))
    check("shard_map, K per device + psum", summed(a_k, b_k),
          numerics.reference_matmul(a, b))

    # grad inside shard_map of a loss over a replicated weight: the weight's
    # cotangent must be summed over devices, as jnp.dot's is.
    def global_loss(f):
      return lambda a, b: jax.lax.psum(jnp.sum(f(a, b) ** 2), "x")
    for check_vma in (True, False):
      grad_b = [jax.jit(jax.shard_map(
          jax.grad(global_loss(f), argnums=1), mesh=mesh1,
          in_specs=(P("x"), P()), out_specs=P(), check_vma=check_vma))(
              a_m, b_r) for f in (ours, ref)]
      check(f"grad in shard_map of a replicated weight, {check_vma=}",
            grad_b[0], grad_b[1])

    # Arrays committed to an explicit-axes mesh, jit without in_shardings:
    # the output type is sharded as jnp.dot's is, and nothing moves.
    emesh = self.mesh_explicit
    a_e = jax.device_put(a, self.sharding(emesh, "x", None))
    b_e = jax.device_put(b, self.sharding(emesh))
    committed = jax.jit(ours)
    out = committed(a_e, b_e)
    hlo = _collectives(committed.lower(a_e, b_e).compile().as_text())
    out_type = jax.make_jaxpr(ours)(a_e, b_e).out_avals[0].sharding.spec
    ref_type = jax.make_jaxpr(ref)(a_e, b_e).out_avals[0].sharding.spec
    check("explicit mesh, committed operands", out,
          numerics.reference_matmul(a, b),
          ([] if not hlo else [f"collectives {hlo}, expected none"]) +
          ([] if out_type == ref_type else
           [f"output type sharded {out_type}, jnp.dot's {ref_type}"]) +
          ([] if out.sharding.spec == out_type else
           [f"output sharded {out.sharding.spec}, its type {out_type}"]))

    # One device: one pallas_gemm equation, no partitioning custom call.
    jaxpr = jax.make_jaxpr(ours)(a, b)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    single_hlo = jax.jit(ours).lower(a, b).as_text()
    problems = []
    if names.count("pallas_gemm") != 1:
      problems.append(f"jaxpr equations {names}")
    if "CustomSPMDPartitioning" in single_hlo:
      problems.append("single-device HLO carries the partitioning call")
    self.record("single device untouched", problems)

  def fallbacks(self):
    jax, numerics = self.jax, self.numerics
    kernel = "triton/02_k_loop"
    tol = numerics.tolerance("float32", "ieee")
    ours = lambda a, b: self.pallas_gemm.matmul(a, b, kernel=kernel,
                                                precision="highest")

    def check_warns(name, fn, args, expected, fragment):
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
      messages = [str(w.message) for w in caught
                  if "pallas_gemm" in str(w.message)]
      err = numerics.relative_error(out, expected)
      problems = []
      if err > tol:
        problems.append(f"relative error {err:.3g} > {tol:.3g}")
      if not any(fragment in m for m in messages):
        problems.append(f"no warning containing {fragment!r}: {messages}")
      self.record(name, problems, error=err, warnings=messages)

    # M = 97 cannot be split 8 ways: replicated, with a warning.
    m, n, k = self.shapes.CPU_SMALL[3]  # (97, 61, 131)
    a, b, _, _ = self.operands((m, n, k))
    row_sharded = self.sharding(self.mesh_1d, "x", None)

    def uneven(a, b):
      return ours(jax.lax.with_sharding_constraint(a, row_sharded), b)
    check_warns("uneven M falls back to replicated", jax.jit(uneven), (a, b),
                numerics.reference_matmul(a, b), "not a multiple")

    # Shardings with no named mesh (GSPMD) run replicated, with a warning.
    from jax._src.sharding_impls import GSPMDSharding
    replicated = GSPMDSharding.get_replicated(jax.devices())
    a, b, _, _ = self.operands(self.shapes.CPU_SMALL[0])
    check_warns("unnamed shardings fall back to replicated",
                jax.jit(ours, in_shardings=(replicated, replicated)), (a, b),
                numerics.reference_matmul(a, b), "named mesh")

    # With Shardy off, GSPMD's propagation callbacks partition the same way.
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
      mesh = self.mesh_2d
      shardings = (self.sharding(mesh, "data", "model"),
                   self.sharding(mesh, "model", None))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = jax.jit(ours, in_shardings=shardings)
        out = f(a, b)
        hlo = _collectives(f.lower(a, b).compile().as_text())
      err = numerics.relative_error(out, numerics.reference_matmul(a, b))
      problems = [] if err <= tol else [f"relative error {err:.3g}"]
      if hlo != ["all-reduce"]:
        problems.append(f"collectives {hlo}, expected one all-reduce")
      self.record("GSPMD partitioner (Shardy off)", problems, error=err)
    finally:
      jax.config.update("jax_use_shardy_partitioner", True)


def _worker(group: str) -> None:
  if f"device_count={NUM_DEVICES}" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{NUM_DEVICES}")
  sys.path.insert(0, ROOT)
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  import jax
  if len(jax.devices()) != NUM_DEVICES:
    raise SystemExit(f"expected {NUM_DEVICES} devices, got {jax.devices()}")
  cases = _Cases()
  getattr(cases, group)()
  print(_RESULT_MARKER + json.dumps(cases.records), flush=True)


if __name__ == "__main__":
  if len(sys.argv) != 2 or sys.argv[1] not in GROUPS:
    raise SystemExit(f"usage: test_sharding.py {{{','.join(GROUPS)}}}")
  _worker(sys.argv[1])
