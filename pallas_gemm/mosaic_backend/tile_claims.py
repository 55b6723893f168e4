"""Tiles claimed at run time by the CTAs of a persistent kernel.

Dealt round-robin (`warp_specialised.for_each_tile`), CTA c runs tiles c,
c + num_ctas, ... whatever they cost: where a few tiles carry long
reductions (one expert holding most tokens), the CTAs dealt them finish
long after the others, which sit idle. Claimed, each CTA takes the next
unclaimed tile from one counter in global memory (an atomic add) whenever
its producer is ready for one, so a CTA that drew short tiles takes more of
them while another runs a long one, and the CTAs in flight still hold
neighbouring tiles of the walk (their shared operands stay in L2).

A second counter serves work the producer does itself between its loads
(`claim_work`): the zero tiles of empty groups, claimed a few boxes at a
time.

The producer warpgroup claims; the consumers learn the tiles they run from
a queue in shared memory (`TileQueue`): the producer writes each tile's
number to the next slot and arrives on the slot's `ready` barrier before
issuing the tile's loads; every consumer reads the slot and arrives on its
`taken` barrier, after which the producer may reuse it. The producer ends
the queue with END.

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
from pallas_gemm.mosaic_backend.warp_specialised import SideWork, index

#: Queue slots beyond the ring's stages: the producer, at most `stages` ring
#: steps ahead, has at most that many tiles of at least one step in flight,
#: and a tile being claimed and the end mark need a slot each.
QUEUE_SLACK = 2


#: The queue's end mark: no tile number is negative.
END = -1
#: The counters of a kernel's claims (`TileQueue.counter`): its tiles, and
#: the producer's own work between loads (`claim_work`).
TILES, SIDE_WORK = range(2)
COUNTERS = 2


class TileQueue(NamedTuple):
  """The claimed tiles' counters and hand-over queue (`queue_smem` makes its
  shared memory). `counter` is a (COUNTERS,) int32 ref in global memory,
  zero at launch; `on_device`: claim with an atomic add (compiled), else
  in the round-robin order (interpret mode)."""
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


def _queue_depth(stages: int) -> int:
  return stages + QUEUE_SLACK


def queue_smem(stages: int) -> dict:
  """The queue's shared memory, as `pl.run_scoped` keyword arguments
  (`claimed_smem`, `queue_smem`, `tile_ready`, `tile_taken`) for a ring of
  `stages` stages."""
  depth = _queue_depth(stages)
  return dict(claimed_smem=plgpu.SMEM((1,), jnp.int32),
              queue_smem=plgpu.SMEM((depth,), jnp.int32),
              tile_ready=plgpu.Barrier(num_arrivals=1, num_barriers=depth),
              tile_taken=plgpu.Barrier(num_arrivals=NUM_CONSUMERS,
                                       num_barriers=depth))


def queue_bytes(stages: int) -> int:
  """The shared memory of `queue_smem(stages)`: the claim and the queue's
  int32 slots, and two 8-byte barriers per slot."""
  depth = _queue_depth(stages)
  return 4 * (1 + depth) + 2 * 8 * depth


def _fetch_add_into(counter_gmem, claimed_smem, count: int):
  """One thread of the warpgroup adds `count` to the counter and writes the
  value it held to `claimed_smem[0]`; the warpgroup synchronises before
  (every thread has read the previous claim) and after (the new one is
  written)."""
  # Imported here: Mosaic's own helpers, used only when compiling.
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import memref
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fetch_add(_, counter, claimed):
    i32 = ir.IntegerType.get_signless(32)
    mgpu_utils.warpgroup_barrier()
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      held = mgpu_utils.inline_ptx(
          "atom.global.add.u32 $0, [$1], $2;",
          mgpu_utils.memref_ptr(counter), mgpu_utils.c(count, i32),
          result_types=i32, has_side_effects=True)
      memref.store(held, claimed, [mgpu_utils.c(0, ir.IndexType.get())])
    mgpu_utils.warpgroup_barrier()

  fetch_add(counter_gmem, claimed_smem)


def claim(queue: TileQueue, claims, *, counter: int = TILES, count: int = 1):
  """The first of the `count` consecutive units (tiles, or boxes of side
  work) that claim number `claims` of this CTA's producer on `counter`
  takes (at or past the units' count: none left). Interpreted, the
  round-robin deal of `count`-unit blocks."""
  if not queue.on_device:
    cta, num_ctas = index(lax.axis_index("sm")), index(lax.axis_size("sm"))
    return (cta + index(claims) * num_ctas) * index(count)
  _fetch_add_into(queue.counter.at[pl.ds(counter, 1)], queue.claimed, count)
  return index(queue.claimed[0])


def claim_work(queue: TileQueue, total, do_unit, *, per_load: int,
               at_end: int):
  """The producer's side work (`warp_specialised.SideWork`) over `total`
  units (a traced count) claimed on the SIDE_WORK counter: `per_load`
  units after each of its loads and, once its tiles are walked, the rest
  `at_end` at a time (fewer atomics where nothing else is left).
  `do_unit(u)` does unit u. The carry: how many claims so far, and
  whether one came back empty. Interpreted, every claim takes `per_load`
  units (the round-robin blocks must be of one size)."""
  total = index(total)
  if not queue.on_device:
    at_end = per_load

  def take(carry, count):
    claims, done = carry

    def run():
      first = claim(queue, claims, counter=SIDE_WORK, count=count)

      def one(u, _):
        @pl.when(first + u < total)
        def _do():
          do_unit(first + u)

      lax.fori_loop(index(0), index(count), one, None)
      return claims + 1, first + count >= total

    return lax.cond(done, lambda: (claims, done), run)

  def finish(carry):
    lax.while_loop(lambda c: ~c[1], lambda c: take(c, at_end), carry)

  return SideWork(init=(index(0), total <= 0),
                  after_load=lambda carry: take(carry, per_load),
                  finish=finish)


def _hand_over(queue: TileQueue, turn, linear):
  """The producer puts tile `linear` in the queue as the CTA's consumer
  turn number `turn`, once the slot's previous tile was taken."""
  slot = queue.slot(turn)

  @pl.when(turn >= queue.depth)
  def _wait_taken():
    plgpu.barrier_wait(queue.taken.at[slot])

  queue.tiles[slot] = linear
  plgpu.commit_smem()  # every thread's write lands before the arrival
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
    # (Tiles past num_tiles, e.g. the zero tiles claimed as side work,
    # end the walk.)
    linear, claims, turn, carry = state
    hand = handed(linear)

    @pl.when(hand)
    def _hand():
      _hand_over(queue, turn, linear)

    carry = body(linear, turn, carry)
    return (claim(queue, claims + 1), claims + 1,
            turn + hand.astype(jnp.int32), carry)

  _, _, turns, carry = lax.while_loop(
      more, next_tile, (claim(queue, 0), index(0), index(0), carry))
  _hand_over(queue, turns, index(END))

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
  plgpu.commit_smem()  # every thread has read the slot before the release
  plgpu.barrier_arrive(queue.taken.at[slot])
  return linear


def consumer_walk(queue: TileQueue, body, carry):
  """A consumer's walk over the tiles its producer hands over, in turn
  order, up to the END mark: `body(linear, turn, carry)`; returns the
  carry."""
  def more(state):
    return state[0] != END

  def next_tile(state):
    linear, turn, carry = state
    carry = body(linear, turn, carry)
    return _take(queue, turn + 1), turn + 1, carry

  return lax.while_loop(more, next_tile,
                        (_take(queue, 0), index(0), carry))[-1]
