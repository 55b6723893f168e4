"""Tiles claimed at run time by the CTAs of a persistent kernel.

Dealt round-robin (`warp_specialised.for_each_tile`), CTA c runs tiles c,
c + num_ctas, ... whatever they cost: where a few tiles carry long
reductions (one expert holding most tokens), the CTAs dealt them finish
long after the others, which sit idle. Claimed, each CTA takes the next
unclaimed tile from one counter in global memory (an atomic add) whenever
its producer is ready for one, so a CTA that drew short tiles takes more of
them while another runs a long one, and the CTAs in flight still hold
neighbouring tiles of the walk (their shared operands stay in L2).

The producer warpgroup claims; the consumers learn the tiles they run from
a queue in shared memory (`TileQueue`): the producer writes each tile's
number to the next slot and arrives on the slot's `ready` barrier before
issuing the tile's loads; every consumer reads the slot and arrives on its
`taken` barrier, after which the producer may reuse it. The producer ends
the queue with a number past the last tile.

In GPU interpret mode (no atomics) the claims follow the round-robin deal,
so the queue and its barriers are exercised and the result is the same.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend.configs import NUM_CONSUMERS
from pallas_gemm.mosaic_backend.warp_specialised import index

#: Queue slots beyond the ring's stages: the producer, at most `stages` ring
#: steps ahead, has at most that many tiles of at least one step in flight,
#: and a tile being claimed and the end mark need a slot each.
QUEUE_SLACK = 2


class TileQueue(NamedTuple):
  """The claimed tiles' counter and hand-over queue (`queue_smem` makes its
  shared memory). `counter` is a (1,) int32 ref in global memory, zero at
  launch; `on_device`: claim with an atomic add (compiled), else in the
  round-robin order (interpret mode)."""
  counter: Any
  claimed: Any
  tiles: Any
  ready: Any
  taken: Any
  on_device: bool

  @property
  def depth(self) -> int:
    return self.tiles.shape[0]

  def slot(self, turn):
    return lax.rem(index(turn), index(self.depth))


def queue_smem(stages: int) -> dict:
  """The queue's shared memory, as `pl.run_scoped` keyword arguments
  (`claimed_smem`, `queue_smem`, `tile_ready`, `tile_taken`) for a ring of
  `stages` stages."""
  depth = stages + QUEUE_SLACK
  return dict(claimed_smem=plgpu.SMEM((CLAIMS_IN_FLIGHT,), jnp.int32),
              queue_smem=plgpu.SMEM((depth,), jnp.int32),
              tile_ready=plgpu.Barrier(num_arrivals=1, num_barriers=depth),
              tile_taken=plgpu.Barrier(num_arrivals=NUM_CONSUMERS,
                                       num_barriers=depth))


#: Claims a producer has issued and not yet read: the next tile's claim is
#: issued as a tile starts and read once its loads are issued, so that the
#: atomic's round trip overlaps them. Each claim lands in a slot of its own.
CLAIMS_IN_FLIGHT = 2
#: The producer thread that issues the claims: the first of its warpgroup's
#: second warp, so that its wait for the atomic's result does not hold up
#: the first warp, which issues the TMA loads.
_CLAIMING_THREAD = 32


def _mosaic():
  """Mosaic GPU's own builders, used only when compiling."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  return ir, arith, memref, mgpu_utils


def _issue_claim(counter_gmem, claimed_smem):
  """One producer thread adds 1 to the counter and writes the value it held
  to `claimed_smem[0]`, without synchronising the warpgroup (`_read_claim`
  does)."""
  ir, arith, memref, mgpu_utils = _mosaic()

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fetch_add(_, counter, claimed):
    i32 = ir.IntegerType.get_signless(32)
    thread = arith.remui(mgpu_utils.thread_idx(),
                         mgpu_utils.c(mgpu_utils.WARPGROUP_SIZE, i32))
    claiming = arith.cmpi(arith.CmpIPredicate.eq, thread,
                          mgpu_utils.c(_CLAIMING_THREAD, i32))
    with mgpu_utils.when(claiming):
      held = mgpu_utils.inline_ptx(
          "atom.global.add.u32 $0, [$1], $2;",
          mgpu_utils.memref_ptr(counter), mgpu_utils.c(1, i32),
          result_types=i32, has_side_effects=True)
      memref.store(held, claimed, [mgpu_utils.c(0, ir.IndexType.get())])

  fetch_add(counter_gmem, claimed_smem)


def _warpgroup_sync(queue: TileQueue):
  """Every thread of the warpgroup waits for the others (their shared-memory
  writes and reads before it are done). Compiled, a plain warpgroup barrier;
  interpreted, `commit_smem`, which includes one."""
  if not queue.on_device:
    plgpu.commit_smem()
    return
  _, _, _, mgpu_utils = _mosaic()
  plgpu.inline_mgpu()(lambda _: mgpu_utils.warpgroup_barrier())()


def _claimed_slot(queue: TileQueue, claims, act):
  """`act(ref)` on the (1,) slot of `claimed` that claim number `claims`
  lands in (static slices: a traced parity picks one of them)."""
  for slot in range(CLAIMS_IN_FLIGHT):
    @pl.when(lax.rem(index(claims), index(CLAIMS_IN_FLIGHT)) == slot)
    def _act():
      act(queue.claimed.at[pl.ds(slot, 1)])


def issue_claim(queue: TileQueue, claims):
  """Starts this CTA's producer's claim number `claims` (on the device; in
  interpret mode claims are computed when read)."""
  if queue.on_device:
    _claimed_slot(queue, claims,
                  lambda ref: _issue_claim(queue.counter, ref))


def read_claim(queue: TileQueue, claims):
  """The tile of claim number `claims` (issued before, `issue_claim`): a
  number at or past the tile count when none is left."""
  if not queue.on_device:
    cta, num_ctas = index(lax.axis_index("sm")), index(lax.axis_size("sm"))
    return cta + index(claims) * num_ctas
  # The claiming thread's write is done, and every thread has read the
  # claim before last, whose slot the next claim takes.
  _warpgroup_sync(queue)
  return index(queue.claimed[lax.rem(index(claims),
                                     index(CLAIMS_IN_FLIGHT))])


def _hand_over(queue: TileQueue, turn, linear):
  """The producer puts tile `linear` in the queue as the CTA's consumer
  turn number `turn`, once the slot's previous tile was taken."""
  slot = queue.slot(turn)

  @pl.when(turn >= queue.depth)
  def _wait_taken():
    plgpu.barrier_wait(queue.taken.at[slot])

  queue.tiles[slot] = linear
  _warpgroup_sync(queue)  # every thread's write lands before the arrival
  plgpu.barrier_arrive(queue.ready.at[slot])


def producer_walk(queue: TileQueue, num_tiles, body, carry, *, handed):
  """The producer's walk over the tiles it claims: `body(linear, turn,
  carry)` for each, `turn` the number of tiles handed to the consumers
  before it; a tile for which `handed(linear)` holds is handed over first.
  Ends the queue, awaits the slots not yet taken, and returns the carry."""
  num_tiles = index(num_tiles)

  def more(state):
    return state[0] < num_tiles

  def next_tile(state):
    # `claims`: the number of the claim that gave `linear`.
    linear, claims, turn, carry = state
    issue_claim(queue, claims + 1)  # in flight while this tile's loads go
    hand = handed(linear)

    @pl.when(hand)
    def _hand():
      _hand_over(queue, turn, linear)

    carry = body(linear, turn, carry)
    return (read_claim(queue, claims + 1), claims + 1,
            turn + hand.astype(jnp.int32), carry)

  issue_claim(queue, 0)
  _, _, turns, carry = lax.while_loop(
      more, next_tile, (read_claim(queue, 0), index(0), index(0), carry))
  _hand_over(queue, turns, num_tiles)

  def await_taken(turn, _):
    plgpu.barrier_wait(queue.taken.at[queue.slot(turn)])

  lax.fori_loop(jnp.maximum(turns + 1 - queue.depth, 0), turns + 1,
                await_taken, None)
  return carry


def _take(queue: TileQueue, turn):
  """A consumer reads the tile of turn `turn` from the queue."""
  slot = queue.slot(turn)
  plgpu.barrier_wait(queue.ready.at[slot])
  linear = index(queue.tiles[slot])
  _warpgroup_sync(queue)  # every thread has read the slot before the release
  plgpu.barrier_arrive(queue.taken.at[slot])
  return linear


def consumer_walk(queue: TileQueue, num_tiles, body, carry):
  """A consumer's walk over the tiles its producer hands over, in turn
  order: `body(linear, turn, carry)`; returns the carry."""
  num_tiles = index(num_tiles)

  def more(state):
    return state[0] < num_tiles

  def next_tile(state):
    linear, turn, carry = state
    carry = body(linear, turn, carry)
    return _take(queue, turn + 1), turn + 1, carry

  return lax.while_loop(more, next_tile,
                        (_take(queue, 0), index(0), carry))[-1]
