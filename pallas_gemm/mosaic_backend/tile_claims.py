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

In a grid of 2-CTA clusters whose CTAs run the same tiles in lockstep
(each its own strip of the output, sharing the multicast loads of one
operand), the cluster claims once: the leader (cluster rank 0) takes the
tile from the counter and publishes it in the cluster's mailbox in global
memory, a ring of MAILBOX_SLOTS words, and its partner reads it from there
(`_claim_for_cluster`). Two counts beside the ring, each raised with a
release and awaited with an acquire, order the two: how many claims the
leader has published, and how many the partner has read (the leader reuses
a slot only once the partner has read the claim that was in it). The
side work is claimed per CTA of the cluster, on a counter of each rank,
since each rank stores its own strips.

In GPU interpret mode (no atomics) the claims follow the round-robin deal
(over the clusters, both CTAs of one drawing the same tiles), so the queue
and its barriers are exercised and the result is the same.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend.configs import CLUSTER_CTAS, NUM_CONSUMERS
from pallas_gemm.mosaic_backend.warp_specialised import SideWork, index

#: Queue slots beyond the ring's stages: the producer, at most `stages` ring
#: steps ahead, has at most that many tiles of at least one step in flight,
#: and a tile being claimed and the end mark need a slot each.
QUEUE_SLACK = 2


#: The queue's end mark: no tile number is negative.
END = -1
#: The CTAs of a cluster that claims together (`TileQueue.cluster`).
CLUSTER_RANKS = CLUSTER_CTAS
#: The counters of a kernel's claims (`TileQueue.counter`): its tiles, then
#: the producer's own work between loads (`claim_work`), one counter per
#: cluster rank (`SIDE_WORK + rank`; rank 0 without clusters).
TILES, SIDE_WORK = range(2)
COUNTERS = SIDE_WORK + CLUSTER_RANKS
#: Slots of a cluster's mailbox: the claims its leader may publish ahead of
#: its partner's reads. The producers of a cluster share their ring stages,
#: so they drift apart by little more than a ring's tiles, and then only
#: over tiles without steps (zero tiles).
MAILBOX_SLOTS = 8
#: A cluster's words after the counters: the mailbox's slots, the claims
#: published, the claims read.
MAILBOX_WORDS = MAILBOX_SLOTS + 2
_PUBLISHED, _READ = MAILBOX_SLOTS, MAILBOX_SLOTS + 1
#: Words of `TileQueue.claimed`: the last claim's first unit, and for the
#: cluster's claims the claim's number, the cluster's first mailbox word in
#: the counter buffer, and the count this CTA awaits (the leader the
#: partner's reads, the partner the leader's publications) as last read, so
#: that it reads the count again only when the value last read does not
#: yet let it go on.
_CLAIMED, _CLAIM_NUMBER, _MAILBOX, _COUNT_SEEN = range(4)
CLAIMED_WORDS = 4


#: The PTX the claims inline (operands $0, $1, ... as
#: `mgpu_utils.inline_ptx` numbers them; an atom or ld returns $0). The
#: tests assemble each for sm_90a with nvcc, so that a slip in one shows on
#: a CPU, not at a GPU's first compile.
PTX_FETCH_ADD = "atom.global.add.u32 $0, [$1], $2;"
PTX_LOAD_RELAXED = "ld.relaxed.gpu.global.b32 $0, [$1];"
PTX_STORE_RELAXED = "st.relaxed.gpu.global.b32 [$0], $1;"
PTX_ADD_RELEASE = "red.release.gpu.global.add.u32 [$0], $1;"
# acq_rel, which every PTX version since sm_70's takes, rather than acquire
# alone, which only recent ones do: no weaker, and valid whatever PTX
# version Mosaic emits.
PTX_FENCE_ACQUIRE = "fence.acq_rel.gpu;"
INLINE_PTX = (PTX_FETCH_ADD, PTX_LOAD_RELAXED, PTX_STORE_RELAXED,
              PTX_ADD_RELEASE, PTX_FENCE_ACQUIRE)


def counter_words(num_clusters: int = 0) -> int:
  """Words of the counter buffer (int32, zero at launch): the counters,
  and with `num_clusters` 2-CTA clusters claiming together each cluster's
  mailbox."""
  return COUNTERS + num_clusters * MAILBOX_WORDS


class TileQueue(NamedTuple):
  """The claimed tiles' counters and hand-over queue (`queue_smem` makes its
  shared memory). `counter` is a (`counter_words`,) int32 ref in global
  memory, zero at launch; `on_device`: claim with an atomic add
  (compiled), else in the round-robin order (interpret mode); `cluster`:
  the grid's 2-CTA clusters (axis "cluster") claim together, their CTAs
  running the same tiles."""
  counter: Any
  claimed: Any
  tiles: Any
  ready: Any
  taken: Any
  on_device: bool
  cluster: bool = False

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
  return dict(claimed_smem=plgpu.SMEM((CLAIMED_WORDS,), jnp.int32),
              queue_smem=plgpu.SMEM((depth,), jnp.int32),
              tile_ready=plgpu.Barrier(num_arrivals=1, num_barriers=depth),
              tile_taken=plgpu.Barrier(num_arrivals=NUM_CONSUMERS,
                                       num_barriers=depth))


def queue_bytes(stages: int) -> int:
  """The shared memory of `queue_smem(stages)`: the claim's and the
  queue's int32 words, and two 8-byte barriers per slot."""
  depth = _queue_depth(stages)
  return 4 * (CLAIMED_WORDS + depth) + 2 * 8 * depth


def _fetch_add(ptr, count: int):
  """Inside `inline_mgpu`, in one thread: the atomic add of `count` to the
  int32 at `ptr`; returns the value it held."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  i32 = ir.IntegerType.get_signless(32)
  return mgpu_utils.inline_ptx(PTX_FETCH_ADD, ptr, mgpu_utils.c(count, i32),
                               result_types=i32, has_side_effects=True)


def _fetch_add_into(counter_gmem, claimed_smem, count: int):
  """One thread of the warpgroup adds `count` to the counter and writes the
  value it held to `claimed_smem[_CLAIMED]`; the warpgroup synchronises
  before (every thread has read the previous claim) and after (the new one
  is written)."""
  # Imported here: Mosaic's own helpers, used only when compiling.
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import memref
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fetch_add(_, counter, claimed):
    mgpu_utils.warpgroup_barrier()
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      held = _fetch_add(mgpu_utils.memref_ptr(counter), count)
      memref.store(held, claimed,
                   [mgpu_utils.c(_CLAIMED, ir.IndexType.get())])
    mgpu_utils.warpgroup_barrier()

  fetch_add(counter_gmem, claimed_smem)


def _word(ref, offset):
  """A pointer to int32 word `offset` (an i32 value) of a 1-D ref."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  at = arith.index_cast(ir.IndexType.get(), offset)
  return mgpu_utils.memref_ptr(
      mgpu_utils.memref_slice(ref, mgpu_utils.ds(at, 1)))


def _spin_until_at_least(ptr, value):
  """One thread reads the int32 at `ptr` (relaxed, GPU scope) until it is
  at least `value`, then fences (acquire-release): what was written before
  the release that raised it is visible after. Returns the value read."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  i32 = ir.IntegerType.get_signless(32)
  spin = scf.WhileOp([i32], [value])
  before = spin.before.blocks.append(i32)
  with ir.InsertionPoint(before):
    held = mgpu_utils.inline_ptx(PTX_LOAD_RELAXED, ptr, result_types=i32,
                                 has_side_effects=True)
    scf.condition(arith.cmpi(arith.CmpIPredicate.slt, held, value), [held])
  after = spin.after.blocks.append(i32)
  with ir.InsertionPoint(after):
    scf.yield_([value])
  mgpu_utils.inline_ptx(PTX_FENCE_ACQUIRE, has_side_effects=True)
  return spin.result


def _claim_for_cluster(counter_gmem, claimed_smem, *, leader: bool):
  """The cluster's claim number `claimed_smem[_CLAIM_NUMBER]`, from the
  mailbox at word `claimed_smem[_MAILBOX]` of `counter_gmem`: the leader
  takes one tile from the TILES counter and publishes it, the partner
  reads it; either writes it to `claimed_smem[_CLAIMED]`. One thread of
  the warpgroup works; the warpgroup synchronises before and after, as in
  `_fetch_add_into`."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def claim_in_cluster(_, counter, claimed):
    i32 = ir.IntegerType.get_signless(32)
    at = lambda i: [mgpu_utils.c(i, ir.IndexType.get())]
    const = lambda v: mgpu_utils.c(v, i32)
    mgpu_utils.warpgroup_barrier()
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      number = memref.load(claimed, at(_CLAIM_NUMBER))
      mailbox = memref.load(claimed, at(_MAILBOX))
      word = lambda offset: _word(counter, arith.addi(mailbox,
                                                      const(offset)))
      slot = _word(counter, arith.addi(
          mailbox, arith.remsi(number, const(MAILBOX_SLOTS))))
      number_minus = lambda d: arith.subi(number, const(d))
      # The leader reuses a slot once its previous claim (number -
      # MAILBOX_SLOTS) is read: the partner's read count is then at least
      # number - MAILBOX_SLOTS + 1. The partner reads claim `number` once
      # it is published: the leader's count is then at least number + 1.
      needed, count = ((number_minus(MAILBOX_SLOTS - 1), _READ) if leader
                       else (number_minus(-1), _PUBLISHED))
      seen = memref.load(claimed, at(_COUNT_SEEN))
      stale = scf.IfOp(arith.cmpi(arith.CmpIPredicate.sgt, needed, seen))
      with ir.InsertionPoint(stale.then_block):
        memref.store(_spin_until_at_least(word(count), needed), claimed,
                     at(_COUNT_SEEN))
        scf.yield_([])
      if leader:
        tile = _fetch_add(_word(counter, const(TILES)), 1)
        mgpu_utils.inline_ptx(PTX_STORE_RELAXED, slot, tile,
                              has_side_effects=True)
      else:
        tile = mgpu_utils.inline_ptx(PTX_LOAD_RELAXED, slot,
                                     result_types=i32, has_side_effects=True)
      # A release: the leader's store above is visible to a partner that
      # reads the new count; the partner's read is done before the leader
      # can see the slot free.
      mgpu_utils.inline_ptx(PTX_ADD_RELEASE,
                            word(_PUBLISHED if leader else _READ), const(1),
                            has_side_effects=True)
      memref.store(tile, claimed, at(_CLAIMED))
    mgpu_utils.warpgroup_barrier()

  claim_in_cluster(counter_gmem, claimed_smem)


def claim(queue: TileQueue, claims, *, counter: int = TILES, count: int = 1):
  """The first of the `count` consecutive units (tiles, or boxes of side
  work) that claim number `claims` of this CTA's producer on `counter`
  takes (at or past the units' count: none left). With `queue.cluster`
  the tiles are claimed once per cluster (`_claim_for_cluster`, `count`
  1) and the side work per rank. Interpreted, the round-robin deal of
  `count`-unit blocks over the grid (of clusters)."""
  if not queue.on_device:
    cta, num_ctas = index(lax.axis_index("sm")), index(lax.axis_size("sm"))
    return (cta + index(claims) * num_ctas) * index(count)
  if not queue.cluster:
    _fetch_add_into(queue.counter.at[pl.ds(counter, 1)], queue.claimed,
                    count)
    return index(queue.claimed[_CLAIMED])
  rank = lax.axis_index("cluster")
  if counter == TILES:
    if count != 1:
      raise ValueError(f"a cluster claims one tile at a time, got "
                       f"count={count}")
    claims = jnp.asarray(claims, jnp.int32)
    queue.claimed[_CLAIM_NUMBER] = claims

    @pl.when(claims == 0)
    def _first_claim():
      # The cluster's mailbox, and no count read yet: both hold for the
      # CTA's whole walk.
      queue.claimed[_MAILBOX] = (COUNTERS + lax.axis_index("sm")
                                 * MAILBOX_WORDS).astype(jnp.int32)
      queue.claimed[_COUNT_SEEN] = jnp.int32(0)

    for r in range(CLUSTER_RANKS):
      pl.when(rank == r)(functools.partial(
          _claim_for_cluster, queue.counter, queue.claimed, leader=r == 0))
  else:
    for r in range(CLUSTER_RANKS):
      pl.when(rank == r)(functools.partial(
          _fetch_add_into, queue.counter.at[pl.ds(counter + r, 1)],
          queue.claimed, count))
  return index(queue.claimed[_CLAIMED])


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
