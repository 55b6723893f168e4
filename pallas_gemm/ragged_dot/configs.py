"""The launch config of the Mosaic grouped-GEMM kernels, and its heuristic.

One `RaggedConfig` serves both modes; the fields mean:

  mode "rows" (out (m, n) = lhs rows of g @ rhs[g]):
    tile_m     token rows of one CTA tile (64, 128, or 256 with split_rows:
               wgmma's row groups; 144, 160, 176 or 192 with ping_pong and
               swap_ab, where the tokens are wgmma's N).
    tile_n     output columns of each of the two consumer warpgroups; the CTA
               tile is tile_m x (2 * tile_n).
    tile_k     K depth of one pipeline stage.
  mode "contracting" (out (g, k, n) = lhs rows of g ^T @ dout rows of g):
    tile_m     output rows (the K dim of lhs) of each consumer warpgroup; the
               CTA tile is (2 * tile_m) x tile_n.
    tile_n     output columns (the N dim of dout).
    tile_k     token rows of one pipeline stage (the reduction chunk). The
               token rows are wgmma's K with both operands read
               transposed, which Mosaic takes only in whole swizzle spans:
               64 (or 128) at the 128-byte swizzle, or 32 with the
               operands' stages swizzled by 64 bytes
               (`contracting_operand_swizzle`), so that an expert whose
               rows end mid-chunk computes at most 31 rows of zeros
               instead of 63 (excludes operand_planes, cluster_columns
               and cluster_rows; "rows" mode raises on it).
    split_rows the two consumers split the CTA tile's rows instead of its
               columns: each owns (tile_m / 2) x (2 * tile_n), one m64 x N
               wgmma per step (needs tile_m 128 or 256 and
               tile_m * tile_n <= 128 * 128). A "rows"-mode
               option: "contracting" always splits its rows (K), and raises
               on it.
    halve_last_round
               with split_rows: where the last round of the tiles' round-
               robin deal over the CTAs fills at most half of them, run
               each of its tiles as two tiles of half its columns, on two
               CTAs, so that the round takes about half a tile's time. The
               tile count follows the routing (a group's rows past a whole
               item add one), so any layer may end on a short round. A
               "rows"-mode option (no clusters, swap_ab or ping_pong).
    interleave_groups
               walk the tiles with the group index fastest, so that the
               CTAs in flight hold tiles of many groups at once: with
               uneven sizes the compute of large groups' tiles overlaps
               the output writes of small ones' (a "contracting"-mode
               option; "rows" raises on it).
    piece_rows cut each group of more than this many token rows (a
               multiple of tile_k) at the multiples of it inside the group,
               counted from row 0 (every piece then holds at most this many
               rows, and each past a group's first starts on a whole
               chunk), run each piece as its own set of output tiles, and
               add the pieces' sums after the kernel: a group that holds most
               tokens then spreads over the SMs instead of leaving them
               idle while its few long tiles run (a "contracting"-mode
               option; 0, the default, never cuts). The partial sums are
               rounded to the output dtype before they are added.
    largest_first
               walk the groups (or pieces) in order of their row counts,
               largest first, and deal the tiles to the CTAs (with
               ping_pong, to the CTAs' consumers) in a snake, so that
               uneven groups load the SMs evenly (a "contracting"-mode
               option; "rows" raises on it).
    cut_groups_first
               with piece_rows, walk the pieces beyond the groups' first
               (those that start at a multiple of piece_rows, all but a
               group's last piece_rows long) first, then the groups'
               first pieces by group size, largest first (the cut groups
               first), and deal the tiles in a snake as largest_first
               does: where one group holds most tokens all its pieces
               start in the first wave, and uneven groups start largest
               first, in an order ranked on the group sizes alone, with no
               sort of the table on each call (excludes largest_first,
               empty_last and zero_drip; a "contracting"-mode option).
    empty_last walk the entries (groups or pieces) that have rows first, in
               table order, and the empty ones after them: the order the
               claimed zero drip (claim_tiles with zero_drip) needs,
               without sorting by size, which puts the long tiles of large
               groups all first and the store-bound short ones all last
               (excludes largest_first; a "contracting"-mode option).
    claim_tiles
               each CTA claims its next tile from a counter in global
               memory (an atomic add by its producer, which hands the tile
               to its consumers through a queue in shared memory) instead
               of running a fixed round-robin share of the tiles
               (`mosaic_backend.tile_claims`): where a few tiles carry long
               reductions (one group holding most tokens), the other CTAs
               go on taking short tiles and zero tiles meanwhile, rather
               than each CTA waiting out its share. With largest_first the
               groups are claimed largest first (no snake deal). With
               zero_drip (which then needs largest_first or empty_last)
               the empty groups' zero tiles are claimed apart, zero_drip
               boxes after each load, from a second counter. With
               cluster_columns or cluster_rows a cluster claims each tile
               once, for both its CTAs (its first passes the tile to the
               second through a mailbox in global memory); the zero boxes
               are claimed per CTA. A "contracting"-mode option. In GPU
               interpret mode the claims follow the round-robin order.
    cluster_columns
               two CTAs of a 2-CTA cluster run the neighbouring column
               strips of one tile row in lockstep ("contracting": of one
               (group, K strip); "rows": of one row item), and each TMA-
               multicasts half of the lhs tile they share into both: a
               quarter less operand traffic from L2 at 128 x 128 tiles,
               where the weight gradient of small experts is bound by L2
               bandwidth, and in "rows" mode the two strips that read the
               same lhs rows stay together, so that lhs is not fetched
               from HBM again once the CTAs drift apart (both modes).
    cluster_rows
               the weight gradient's other pairing: two CTAs of a 2-CTA
               cluster run the neighbouring K strips (output row strips)
               of one (group, column strip) in lockstep, and each
               TMA-multicasts half of the dout chunk they share into both.
               dout's strip is tile_n wide and lhs's only the CTA's rows,
               so at the short-reduction tile (128 x 256) sharing dout
               saves twice the L2 reads that sharing lhs does (a
               "contracting"-mode option; excludes cluster_columns).
    short_items
               with ping_pong in "rows" mode: an item whose rows all lie in
               its tile's first SHORT_ITEM_ROWS (the short last item of a
               group whose size is not a multiple of tile_m) runs one
               64-row wgmma per step instead of the tile's two, so that the
               rows past the group's end cost no tensor-core time (needs
               ping_pong and tile_m=128; a "rows"-mode option, as
               "contracting" has no row items, and raises there).
    zeros_by_producer
               the producer warpgroup stores the zero output tiles of empty
               groups (TMA stores of one zeroed box, `zero_box`, never
               awaited until the end) and the consumers skip them, so that
               writing the zeros overlaps the consumers' wgmmas instead of
               taking their turns: it matters where one group holds most
               tokens and the others' zero tiles are most of the output
               (a "contracting"-mode option; "rows" raises on it). Needs
               the zero box's shared memory, and out_slots dividing
               the stores per tile (tile_n / epi_tile_n): otherwise a
               tile's staging slot depends on its number, and a skipped
               tile would have two stores in a row use the same slot.
    zero_drip  with zeros_by_producer: where some group is empty, the
               producer stores at most this many zero boxes of its
               CTA's zero tiles after each of its loads (a cursor over the
               CTA's tiles, apart from its walk), and the rest after its
               last load, instead of each tile's zeros when its walk meets
               them: a CTA's zeros and its long tiles then share the same
               stretch of time wherever in the walk either lies, so the
               write bandwidth and the tensor cores work together (0, the
               default: as the walk meets them; a "contracting"-mode option).
    wide_zero_box
               with zeros_by_producer: the zero box spans the CTA tile's
               columns (up to 256) in WIDE_ZERO_BOX_BYTES (`zero_box`), so
               that each of its rows is one run of up to 512 consecutive
               16-bit output bytes rather than ZERO_BOX's 128 (a
               "contracting"-mode option).
    streamed_zeros
               with claim_tiles and zero_drip: each claimed zero unit is a
               run of an empty group's contiguous output (whole rows, the
               zero box's bytes) stored by one bulk copy under an L2
               evict-first policy (`mosaic_backend.bulk_stores`), instead
               of a 2-D box of a zero tile by a TMA store, which takes no
               cache policy: the zeros then leave L2 before the operand
               chunks that the long tiles beside them read again (excludes
               cluster_columns and cluster_rows; a "contracting"-mode
               option; the interpreter stores the boxes).
    double_zero_buffer
               with streamed_zeros and wide_zero_box: a zero buffer of
               twice WIDE_ZERO_BOX_BYTES, so that each streamed run is
               twice as long and half as many are claimed (a
               "contracting"-mode option).
    operand_planes
               hold each stage of lhs and dout as planes of 64 columns (one
               128-byte swizzle span per row), one TMA copy and one wgmma
               operand per plane: a tile is then (tile_m / 64) x
               (tile_n / 64) wgmmas of 64 x 64 per step. A plane's rows are
               plain swizzled rows, so, compiled, operands whose row count
               is not a whole number of 8-row tiles are read as they are,
               instead of padded copies (`mosaic_contracting.
               operands_in_place`). Needs 16-bit inputs; excludes
               cluster_columns (a "contracting"-mode option).
    ping_pong  the two consumer warpgroups take turns at whole tiles of
               tile_m x tile_n (the CTA tile is then the consumer tile)
               instead of splitting one tile: while one stores a finished
               tile, the other's wgmmas keep the tensor cores busy, which
               matters where a tile's main loop is short next to its output
               store (few token rows per expert in "contracting" mode), and
               each SM has two tiles' loads in flight. Needs tile_m *
               tile_n <= 128 * 192 (a whole tile's accumulator in one
               warpgroup's registers, `TURN_TILE_MAX_ELEMS`; above
               128 * 128 only as "rows" mode's swap_ab tiles of 192
               tokens x 128 columns or 128 x 192, or "contracting" mode's
               128 x 192), and excludes split_rows.
    group_bands
               the bands of `grid_band` row items restart at each group (and
               at each stretch of rows of no group), so that a band never
               mixes two experts' weights and a group of many items is
               walked in bands of grid_band items, whatever the routing: the
               column strips of an expert's weights are then read once per
               grid_band of its items (a "rows"-mode option, as
               "contracting" walks each group's tiles on their own already,
               and raises on it).
    swizzled_staging
               the epilogue stages its output tile swizzled, so that the
               registers' wgmma layout is written without shared-memory
               bank conflicts; the partial stores of an item's rows, which
               may start at any row, read it through a second, untiled view
               of the same bytes (see `mosaic.row_staging_smem`). Needs a
               staged row of epi_tile_n output elements to be 128 bytes
               (64 columns of a 16-bit output; a "rows"-mode option, as
               "contracting" stages whole swizzled tiles already, and raises
               on it).
    swap_ab    compute each tile transposed, out^T = rhs[g]^T x lhs^T, so
               that the token rows are wgmma's N (steps of 8 rows) instead
               of its M (groups of 64): an item runs the narrowest of the
               static token widths of `swap_ab_widths` (multiples of an
               eighth of a consumer's tokens, a power of two, at least 8)
               that holds its rows. Each group is cut into equally long
               items (as many as with tile_m rows each), so a group of 273
               rows is three items of 96 rows, not 128, 128 and 17. The
               accumulator is (columns, tokens), written to the staging
               tile through a transposed view. With split_rows the
               consumers split the item's tokens (the first tile_m / 2
               rows, then the rest), sharing the weight strip: at
               tile_m=256 a 273-row group is two items of 144 rows, each
               loading the weights once. With ping_pong,
               tile_m may be 144 to 192 (`SWAP_AB_TURN_TOKENS`): a
               turn-taking consumer holds up to 128 columns x tile_m
               tokens, and a group of 273 rows is two items of 144. A
               "rows"-mode option; needs a consumer accumulator of at most
               128 x 128 f32 (128 x 192 as above) and swizzled_staging (so
               a 16-bit output), and excludes short_items, cluster_columns
               and epi_tile_m.
    token_width_step
               with swap_ab, the step between the static token widths: 0
               (the default) is an eighth of the consumer's tokens (a
               power of two, at least 8: 16 at 128 tokens); 8 is wgmma's N
               step (an item pads its rows to the next 8: a 273-row
               group's third item of 81 rows runs at 88, not 96); 32 or 64
               pad more and keep fewer widths. Each width is a copy of the
               main loop, the epilogue and the producer's lhs load (a
               "rows"-mode option).
    min_token_width
               with swap_ab, the narrowest static token width (0: the
               step): an item of fewer rows runs at it. A narrow item still
               loads its expert's whole weight strip, which then weighs
               more than its wgmmas, so a narrower width saves little,
               while each width is a copy of the loop (a "rows"-mode
               option).
    epi_tile_m rows of one staged output store: 0 (the default) stages a
               consumer's whole rows at once; 64 stages them in 64-row
               halves, so that two staging slots take the shared memory of
               one (with out_slots=2 the ring keeps its depth) and the
               stored rows stay 128 bytes (a "rows"-mode option; needs
               out_slots dividing tile_n / epi_tile_n).
    shared_staging
               with ping_pong, one staging buffer for both consumers
               instead of one each: they write it in the order of their
               turns, each handing it over through a barrier once its
               stores have read it. The ring may take the shared memory
               freed (a 144-token swap_ab tile then has 6 stages, a
               192-token one 5). Excludes cluster_columns.
    split_k    cut each tile's reduction into up to split_k shares of
               whole K steps (`k_splits`), one tile of the walk each, that
               store float32 partial sums to an output of their own; one
               XLA fusion adds them, applies the activation to the groups'
               rows and casts. For walks of few tiles over a long reduction
               (one expert's short dlhs, a decode step over few experts),
               where a tile per CTA leaves most SMs idle. Excludes swap_ab
               and swizzled_staging (the float32 rows are not one swizzle
               span), halve_last_round and cluster_columns (a "rows"-mode
               option).
    work_list_kernel
               build the item table (`mosaic_schedule.row_items`) in one
               Pallas-Triton launch (`work_list_kernel.row_items`) instead
               of a chain of small XLA kernels, which on short calls (small
               experts) is a share of the call's time. Needs at most
               `work_list_kernel.MAX_GROUPS` groups (a "rows"-mode option,
               as the "contracting" kernel lists no row items, and raises
               on it).
    narrow_last_strip
               where the output's columns (rounded up to epi_tile_n) end
               inside the last column strip, that strip's tiles compute
               only the columns it holds (`last_strip_columns`: a
               narrower wgmma, accumulator and store count) instead of the
               whole tile_n, so that a wide tile pads the columns by no
               more than a narrow one: 1408 columns are seven strips of 192
               and one of 64, where without it the eighth computes 192
               (excludes cluster_columns; a "contracting"-mode option).
    spread_zero_tiles
               with empty_last, each CTA visits its share of the empty
               groups' zero tiles spread evenly between its tiles with
               rows (`mosaic_schedule.spread_zero_visits`), rather than
               after them: where one group holds most tokens, a consumer
               then stores zero tiles while the other computes a long
               tile, so that the zeros' writes overlap the long
               reductions instead of following them. The order of the
               tiles with rows is kept, so an even routing walks as
               without it (excludes claim_tiles, zeros_by_producer,
               piece_rows, interleave_groups and clusters; a
               "contracting"-mode option).
    zero_tiles_evict_first
               with spread_zero_tiles, compiled, a consumer stores an empty
               group's zero tile as its share of the runs of contiguous
               output that cover the group (`bulk_stores.zero_runs`), from
               a zeroed staging slot under an L2 evict-first policy, so
               that the zeros' lines do not evict the operands the long
               tiles read again from L2 (the interpreter stores the tiles).
  both:
    stages     pipeline stages resident in shared memory (>= 2).
    epi_tile_n columns of one staged output store (divides tile_n).
    grid_band  tile order: tiles are walked in bands `grid_band` tiles tall
               (along the row items in "rows" mode, along K in
               "contracting"), every other band backwards (a snake), so that
               the CTAs in flight share operand tiles in L2.

Every field is validated at construction: a non-int raises TypeError, a
value out of range ValueError, each naming the field.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from pallas_gemm.config_fields import (Requirement, at_least, checked,
                                       in_range, multiple_dividing, one_of,
                                       validate)
from pallas_gemm.devices import NOMINAL_INTERPRET_SMS as NOMINAL_SMS
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.mosaic_backend import tile_claims
from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES,
                                                NUM_CONSUMERS,
                                                SMEM_SLACK_BYTES)
from pallas_gemm.mosaic_backend.tma import WGMMA_SWIZZLES
from pallas_gemm.problem import cdiv, power_of_two_at_most
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot import work_list_kernel
from pallas_gemm.ragged_dot.problem import RaggedProblem

#: 16-bit elements in one 128-byte swizzle span: every operand tile's minor
#: dimension (and each consumer's share of it) spans whole spans.
SWIZZLE_ELEMS_16BIT = 64
#: Rows of one tile of a 16-bit lhs's swizzled shared-memory layout: a row
#: item's tile starts on a multiple of it (`mosaic.lhs_row_align`).
LHS_ROW_TILE = 8
#: Rows of the plain row item (the 128 x 128 tile's), which the balanced
#: items of the token-transposed tiles are weighed against
#: (`_balanced_items_pad_less`).
PLAIN_ITEM_ROWS = 128
MAX_STAGES = 6
#: The most shares `RaggedConfig.split_k` cuts a reduction into.
MAX_SPLIT_K = 32
#: Rows of the short-item wgmma of `RaggedConfig.short_items` (wgmma's
#: row group).
SHORT_ITEM_ROWS = 64
#: The zero source of `RaggedConfig.zeros_by_producer`: one TMA box of the
#: output (rows, columns), stored as often as an empty tile needs; it
#: divides every CTA tile.
ZERO_BOX = (64, 64)
#: The widest zero box of `RaggedConfig.wide_zero_box` (a TMA box's
#: dimension holds at most 256 elements), and its bytes: ZERO_BOX's at a
#: 16-bit output, so that it takes no more shared memory.
WIDE_ZERO_BOX_MAX_COLS = 256
WIDE_ZERO_BOX_BYTES = math.prod(ZERO_BOX) * 2
#: The narrowest token width of `RaggedConfig.swap_ab` (wgmma's N step).
SWAP_AB_MIN_WIDTH = 8
#: How many static token widths a `RaggedConfig.swap_ab` tile of a
#: power-of-two tile_m has (a 192-token tile has 12, at the 128-token one's
#: step).
SWAP_AB_WIDTHS = 8
#: The most token rows of a turn-taking `RaggedConfig.swap_ab` consumer
#: (`tile_m` with `ping_pong`): its accumulator (tile_n <= 128 columns x
#: tokens) is then at most 128 x 192 f32, 192 registers per thread of the
#: 232 a consumer takes. Fewer, longer items than the 128-token tile's
#: (the weight strip is loaded once per item), on a shallower ring: faster
#: above 512 rows per expert (three items instead of five), slower at
#: 129-512 rows, where the ring's depth counted for more (`BALANCED_
#: ITEMS_TILE_M`).
SWAP_AB_MAX_TOKENS = 192
#: Token widths between 128 and SWAP_AB_MAX_TOKENS that only a turn-taking
#: `RaggedConfig.swap_ab` consumer runs, in the width step of
#: `swap_ab_widths` above 128 (16). A tile of exactly the width its items
#: need stages fewer rows than the 192-token one, so its ring is deeper.
#: The heuristic takes 192 where `BALANCED_ITEMS_TILE_M` says so and,
#: on the GPUs of `SHARED_STAGING_DEVICES`, a narrower one where it cuts
#: the average group into fewer items on a ring as deep
#: (`_fewest_turn_items`).
SWAP_AB_TURN_TOKENS = (144, 160, 176, SWAP_AB_MAX_TOKENS)
#: A consumer warpgroup's f32 accumulator, in elements, wherever nothing
#: below allows more: 128 x 128, 128 registers per thread.
ACCUMULATOR_MAX_ELEMS = 128 * 128
#: The largest tile a turn-taking consumer (`RaggedConfig.ping_pong`) holds
#: whole in registers, in f32 elements: 128 x 192, 192 per thread. Above
#: ACCUMULATOR_MAX_ELEMS only as a `swap_ab` tile ("rows" mode: up to 192
#: tokens by 128 columns, or 128 tokens by 192 columns, three of wgmma's
#: 64-row groups) or as 128 x 192 weight-gradient tiles ("contracting"
#: mode, `check_mode`).
TURN_TILE_MAX_ELEMS = 128 * SWAP_AB_MAX_TOKENS


def swap_ab_widths(tile_m: int, step: int = 0,
                   narrowest: int = 0) -> tuple[int, ...]:
  """The static token widths of a `RaggedConfig.swap_ab` tile, widest
  first: the multiples of a step up to tile_m, from `narrowest`
  (`RaggedConfig.min_token_width`) up. The step is `step`
  (`RaggedConfig.token_width_step`) or by default the power of two at or
  below tile_m / SWAP_AB_WIDTHS (at least SWAP_AB_MIN_WIDTH), so that a
  192-token tile also has the 128- and 144-token widths. Each is a copy of
  the main loop, the epilogue and the producer's lhs load, so the list
  stays short; an item runs the narrowest that holds its rows (or the
  narrowest of all)."""
  if not step:
    step = power_of_two_at_most(max(tile_m // SWAP_AB_WIDTHS,
                                    SWAP_AB_MIN_WIDTH))
  return tuple(w for w in range(tile_m, 0, -step)
               if w >= min(narrowest, tile_m))


def _balanced_items(rows: int, tile_m: int) -> tuple[int, int]:
  """(items, width): a group of `rows` rows, from a tile's first row, cut
  into balanced items (`mosaic_schedule.piece_items(balanced=True)`: as
  many as tile_m-row tiles, each the same whole number of a 16-bit lhs's
  8-row tiles) and the narrowest `swap_ab` width of a tile_m-token tile
  that holds one."""
  _, items, per_item = (int(x) for x in schedule.piece_items(
      0, rows, tile_m=tile_m, row_align=LHS_ROW_TILE, balanced=True, xp=np))
  return max(items, 1), min(w for w in swap_ab_widths(tile_m)
                            if w >= per_item)


#: Pieces of whole reduction steps, so that the cuts inside a group need no
#: masking.
_WHOLE_STEPS = Requirement(
    lambda rows, config: rows >= 0 and rows % config.tile_k == 0,
    lambda config: f"0 or a positive multiple of tile_k={config.tile_k}")


#: The options only one mode has: for each mode, its own options and why
#: the other mode's kernel has none (read after "the <other> kernel").
MODE_ONLY_OPTIONS = {
    # An option that needs another one comes before it, so that the error
    # names the option a config set on purpose (halve_last_round rather
    # than the split_rows it needs).
    "rows": {
        "halve_last_round": "cuts a group's long reductions into pieces "
                            "instead (piece_rows)",
        "split_rows": "always splits its K strip",
        "group_bands": "walks each group's tiles on their own",
        "short_items": "has no row items",
        "epi_tile_m": "stages whole tiles",
        "token_width_step": "multiplies whole chunks of token rows",
        "min_token_width": "multiplies whole chunks of token rows",
        "swap_ab": "multiplies whole chunks of token rows",
        "swizzled_staging": "stores whole tiles from swizzled staging "
                            "already",
        "work_list_kernel": "lists no row items",
        "shared_staging": "stages each consumer's tiles in its own buffer",
        "split_k": "cuts a group's long reductions into pieces instead "
                   "(piece_rows)",
    },
    "contracting": {
        "interleave_groups": "walks its row items in order",
        "largest_first": "gives each item's tiles equal work",
        "cut_groups_first": "has no reduction over token rows",
        "empty_last": "gives each item's tiles equal work",
        "piece_rows": "has no reduction over token rows",
        "zeros_by_producer": "stores the rows of no group with its items",
        "wide_zero_box": "stores the rows of no group with its items",
        "streamed_zeros": "stores the rows of no group with its items",
        "double_zero_buffer": "stores the rows of no group with its items",
        "claim_tiles": "deals its row items round-robin (claims are built "
                       "for the weight gradient's long reductions)",
        "short_tile_lookahead": "keeps its whole ring in flight",
        "operand_planes": "reads rows in place through one swizzle span "
                          "already",
        "cluster_rows": "pairs row items only by their columns "
                        "(cluster_columns)",
        "narrow_last_strip": "computes its last column strip at the "
                             "tile's width",
        "spread_zero_tiles": "stores the rows of no group with its items",
        "zero_tiles_evict_first": "stores the rows of no group with its "
                                  "items",
    },
}


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
  tile_m: int = checked(
      128, one_of(64, 128, *SWAP_AB_TURN_TOKENS, 256).because(
          "wgmma's 64-row groups; a consumer keeps at most 128 rows in "
          "registers, or with ping_pong and swap_ab up to 192 token rows"))
  tile_n: int = checked(128, one_of(64, 128, 192, 256).because(
      "whole 128-byte swizzle spans, wgmma's N range"))
  tile_k: int = checked(64, one_of(32, 64, 128).because(
      "whole swizzle spans of 16-bit elements; 32 only in \"contracting\" "
      "mode, at the 64-byte swizzle"))
  stages: int = checked(4, in_range(2, 8))
  epi_tile_n: int = checked(64, multiple_dividing(SWIZZLE_ELEMS_16BIT,
                                                  "tile_n"))
  grid_band: int = checked(8, at_least(1))
  out_slots: int = checked(1, one_of(1, 2))
  split_rows: bool = False
  interleave_groups: bool = False
  piece_rows: int = checked(0, _WHOLE_STEPS)
  largest_first: bool = False
  cut_groups_first: bool = False
  empty_last: bool = False
  ping_pong: bool = False
  zeros_by_producer: bool = False
  zero_drip: int = checked(0, in_range(0, 16))
  short_items: bool = False
  cluster_columns: bool = False
  group_bands: bool = False
  swizzled_staging: bool = False
  epi_tile_m: int = checked(0, one_of(0, 64).because(
      "0 stages a consumer's whole rows; 64 is wgmma's row group"))
  swap_ab: bool = False
  short_tile_lookahead: int = checked(0, in_range(0, 8))
  work_list_kernel: bool = False
  operand_planes: bool = False
  shared_staging: bool = False
  claim_tiles: bool = False
  wide_zero_box: bool = False
  cluster_rows: bool = False
  streamed_zeros: bool = False
  double_zero_buffer: bool = False
  narrow_last_strip: bool = False
  spread_zero_tiles: bool = False
  zero_tiles_evict_first: bool = False
  halve_last_round: bool = False
  min_token_width: int = checked(0, one_of(0, 16, 32, 48, 64).because(
      "0 for the step, else multiples of 16 up to the 128-token tile's "
      "half"))
  token_width_step: int = checked(0, one_of(0, 8, 16, 32, 64).because(
      "0 for an eighth of the consumer's tokens, else a multiple of "
      "wgmma's N step (8)"))
  split_k: int = checked(1, in_range(1, MAX_SPLIT_K))

  def __post_init__(self):
    validate(self)
    if self.largest_first and self.empty_last:
      raise ValueError("RaggedConfig.largest_first and empty_last exclude "
                       "each other (two orders of the table's entries)")
    if self.cut_groups_first:
      if not self.piece_rows:
        raise ValueError("RaggedConfig.cut_groups_first needs piece_rows "
                         "(it orders the groups' pieces)")
      self._exclude("cut_groups_first",
                    ("largest_first", "empty_last", "zero_drip"),
                    " (the walk lists the further pieces first, then the "
                    "groups by size, empty or not)")
    if self.spread_zero_tiles:
      if not self.empty_last:
        raise ValueError("RaggedConfig.spread_zero_tiles needs "
                         "empty_last=True (the tiles with rows are then the "
                         "walk's first, and the zero tiles are spread "
                         "between them)")
      self._exclude("spread_zero_tiles",
                    ("claim_tiles", "zeros_by_producer", "piece_rows",
                     "interleave_groups", "cluster_columns", "cluster_rows"),
                    " (it reorders each CTA's round-robin share of whole "
                    "groups' tiles, which the consumers store, zeros "
                    "included)")
    if self.zero_tiles_evict_first and not self.spread_zero_tiles:
      raise ValueError("RaggedConfig.zero_tiles_evict_first needs "
                       "spread_zero_tiles=True (the consumers' zero tiles "
                       "it stores as runs of the empty group's output)")
    if self.claim_tiles and self.zero_drip and not self.reorders_entries:
      raise ValueError("RaggedConfig.claim_tiles with zero_drip needs "
                       "largest_first=True or empty_last=True (the empty "
                       "groups' zero tiles, claimed apart, are then the "
                       "walk's last)")
    if self.short_tile_lookahead and not (
        2 <= self.short_tile_lookahead < self.stages):
      raise ValueError(
          f"RaggedConfig.short_tile_lookahead={self.short_tile_lookahead} "
          f"must be 0 (off) or from 2 (a step is released once the next "
          f"one is loaded) to stages - 1 = {self.stages - 1} (fewer steps in "
          f"flight than the ring holds)")
    # Options under which a tile's first staging slot must not depend on
    # its number.
    for option, why in (("zeros_by_producer", "the consumers skip the zero "
                         "tiles"),
                        ("epi_tile_m", "a tile's store count then depends "
                         "on its rows")):
      if getattr(self, option) and not self.slots_divide_stores():
        raise ValueError(f"RaggedConfig.{option} needs out_slots="
                         f"{self.out_slots} to divide the stores of a tile "
                         f"row, tile_n / epi_tile_n = "
                         f"{self.tile_n // self.epi_tile_n} ({why})")
    if self.narrow_chunks:
      for option, why in (("operand_planes", "a plane is one 128-byte "
                           "swizzle span"),
                          ("cluster_columns", "not built for the 64-byte "
                           "swizzle's stages"),
                          ("cluster_rows", "not built for the 64-byte "
                           "swizzle's stages")):
        if getattr(self, option):
          raise ValueError(f"RaggedConfig.tile_k={self.tile_k} excludes "
                           f"{option} ({why})")
    if self.wide_zero_box and not self.zeros_by_producer:
      raise ValueError("RaggedConfig.wide_zero_box needs "
                       "zeros_by_producer=True (it shapes the box the "
                       "producer stores the zero tiles with)")
    if self.double_zero_buffer and not (self.streamed_zeros
                                        and self.wide_zero_box):
      raise ValueError("RaggedConfig.double_zero_buffer needs "
                       "streamed_zeros=True and wide_zero_box=True (it "
                       "lengthens the streamed runs of the wide box)")
    if self.streamed_zeros and not (self.claim_tiles and self.zero_drip
                                    and not self.clustered):
      raise ValueError(f"RaggedConfig.streamed_zeros needs claim_tiles=True "
                       f"and zero_drip > 0 (it streams the claimed zero "
                       f"units) and no clusters (each CTA of a cluster "
                       f"stores its own strips' boxes), got claim_tiles="
                       f"{self.claim_tiles}, zero_drip={self.zero_drip}, "
                       f"cluster_columns={self.cluster_columns}, "
                       f"cluster_rows={self.cluster_rows}")
    if self.zero_drip and not self.zeros_by_producer:
      raise ValueError(f"RaggedConfig.zero_drip={self.zero_drip} needs "
                       f"zeros_by_producer=True (the producer stores the "
                       f"zero tiles it spreads over its loads)")
    if self.short_items and not (self.ping_pong and self.tile_m == 128):
      raise ValueError(f"RaggedConfig.short_items needs ping_pong=True and "
                       f"tile_m=128 (a consumer's whole tile, of which a "
                       f"short item uses the first {SHORT_ITEM_ROWS} rows), "
                       f"got ping_pong={self.ping_pong}, "
                       f"tile_m={self.tile_m}")
    if self.tile_m in SWAP_AB_TURN_TOKENS and not (self.ping_pong
                                                  and self.swap_ab):
      raise ValueError(f"RaggedConfig.tile_m={self.tile_m} needs "
                       f"ping_pong=True and swap_ab=True (a turn-taking "
                       f"consumer holding its tile's tokens as wgmma's N; "
                       f"otherwise 64, 128 or 256), got "
                       f"ping_pong={self.ping_pong}, swap_ab={self.swap_ab}")
    if self.ping_pong and self.tile_m * self.tile_n > TURN_TILE_MAX_ELEMS:
      raise ValueError(f"RaggedConfig.ping_pong needs a consumer tile "
                       f"tile_m x tile_n of at most 128 x "
                       f"{SWAP_AB_MAX_TOKENS} f32 (one warpgroup's registers "
                       f"hold a whole tile), got tile_m={self.tile_m}, "
                       f"tile_n={self.tile_n}")
    accumulator = self.tile_m * self.tile_n
    if self.split_rows and (self.tile_m < 128
                            or accumulator > ACCUMULATOR_MAX_ELEMS):
      raise ValueError(f"RaggedConfig.split_rows needs tile_m 128 or 256 (two "
                       f"halves of whole 64-row groups) and a consumer "
                       f"accumulator (tile_m / 2) x (2 * tile_n) of at most "
                       f"128 x 128 f32 (registers; wgmma's N <= 256), got "
                       f"tile_m={self.tile_m}, tile_n={self.tile_n}")
    if self.shared_staging and not self.can_share_staging:
      raise ValueError(f"RaggedConfig.shared_staging needs ping_pong=True "
                       f"(the consumers' epilogues take turns) and no "
                       f"clusters, got ping_pong={self.ping_pong}, "
                       f"cluster_columns={self.cluster_columns}, "
                       f"cluster_rows={self.cluster_rows}")
    if self.ping_pong and self.split_rows:
      raise ValueError("RaggedConfig.ping_pong and split_rows exclude each "
                       "other: with ping_pong each consumer runs whole tiles")
    if self.swap_ab:
      if (accumulator > ACCUMULATOR_MAX_ELEMS and not self.split_rows
          and not self.ping_pong):
        raise ValueError(f"RaggedConfig.swap_ab needs a consumer accumulator "
                         f"tile_n x tile_m of at most 128 x 128 f32 (one "
                         f"warpgroup's registers), or with ping_pong "
                         f"{TURN_TILE_MAX_ELEMS} elements (128 x "
                         f"{SWAP_AB_MAX_TOKENS} either way), got "
                         f"tile_m={self.tile_m}, tile_n={self.tile_n}")
      if not self.swizzled_staging:
        raise ValueError("RaggedConfig.swap_ab needs swizzled_staging=True: "
                         "Mosaic writes the transposed accumulator only "
                         "through a swizzled staging tile (16-bit outputs)")
      self._exclude("swap_ab", ("short_items", "cluster_columns",
                                "epi_tile_m"),
                    ": the transposed tile's token rows are wgmma's N, "
                    "which swap_ab narrows to each item's rows itself")
    for option in ("token_width_step", "min_token_width"):
      if getattr(self, option) and not self.swap_ab:
        raise ValueError(f"RaggedConfig.{option}={getattr(self, option)} "
                         f"needs swap_ab=True (the token widths are wgmma's "
                         f"N only in a transposed tile)")
    if self.narrow_last_strip and self.cluster_columns:
      raise ValueError("RaggedConfig.narrow_last_strip excludes "
                       "cluster_columns (a cluster's two CTAs run "
                       "neighbouring column strips in lockstep, at one "
                       "width)")
    if self.operand_planes and self.clustered:
      raise ValueError("RaggedConfig.operand_planes excludes cluster_columns "
                       "and cluster_rows (the cluster multicasts whole "
                       "stages of an operand)")
    if self.cluster_columns and self.cluster_rows:
      raise ValueError("RaggedConfig.cluster_columns and cluster_rows "
                       "exclude each other (a cluster shares one operand: "
                       "lhs between neighbouring column strips, or dout "
                       "between neighbouring K strips)")
    if self.halve_last_round:
      if not self.split_rows:
        raise ValueError("RaggedConfig.halve_last_round needs "
                         "split_rows=True (both consumers keep their rows "
                         "of a half tile, each at half its columns)")
      self._exclude("halve_last_round", ("swap_ab", "cluster_columns"),
                    " (a half tile runs the consumers' whole rows at half "
                    "their columns, one CTA alone)")
    if self.split_k > 1:
      self._exclude("split_k", ("halve_last_round", "cluster_columns"),
                    " (each share of the reduction runs whole tiles, one "
                    "CTA each)")
      self._exclude("split_k", ("swap_ab", "swizzled_staging"),
                    ": the shares store float32 partial sums, whose 64 "
                    "columns are not one 128-byte swizzle span")
    if self.tile_m == 256 and not self.split_rows:
      raise ValueError("RaggedConfig.tile_m=256 needs split_rows=True (each "
                       "consumer keeps 128 of the rows)")

  def _exclude(self, option: str, others: tuple[str, ...],
               why: str) -> None:
    """Raises ValueError naming `option` and the first of `others` set,
    followed by `why` (its own leading space or colon)."""
    for other in others:
      if getattr(self, other):
        raise ValueError(f"RaggedConfig.{option} excludes {other}{why}")

  def check_mode(self, mode: str) -> None:
    """Raises ValueError naming the first option set here that only the
    other mode's kernel has (`MODE_ONLY_OPTIONS`), or a tile that mode's
    kernel does not take."""
    if (mode == "rows" and self.ping_pong
        and self.tile_m * self.tile_n > ACCUMULATOR_MAX_ELEMS
        and not self.swap_ab):
      raise ValueError(f"RaggedConfig.ping_pong in \"rows\" mode holds a "
                       f"consumer tile above 128 x 128 f32 only transposed "
                       f"(swap_ab: up to {SWAP_AB_MAX_TOKENS} token rows "
                       f"by 128 columns, or 128 by {SWAP_AB_MAX_TOKENS}), "
                       f"got tile_m={self.tile_m}, tile_n={self.tile_n}, "
                       f"swap_ab={self.swap_ab}")
    if mode == "rows" and self.narrow_chunks:
      raise ValueError(f"RaggedConfig.tile_k={self.tile_k} is a "
                       f"\"contracting\"-mode chunk: the \"rows\" kernel's "
                       f"K steps are whole 128-byte swizzle spans "
                       f"({SWIZZLE_ELEMS_16BIT} 16-bit elements)")
    other = "contracting" if mode == "rows" else "rows"
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    for option, why in MODE_ONLY_OPTIONS[other].items():
      if getattr(self, option) != defaults[option]:
        raise ValueError(f"RaggedConfig.{option} is a \"{other}\"-mode "
                         f"option: the \"{mode}\" kernel {why}")

  def slots_divide_stores(self, out_slots: int | None = None) -> bool:
    """Whether `out_slots` staging slots (by default the config's) divide a
    tile's output stores (tile_n / epi_tile_n): then every tile starts on
    the same slot, whatever its number, and a consumer may skip a tile."""
    slots = self.out_slots if out_slots is None else out_slots
    return (self.tile_n // self.epi_tile_n) % slots == 0

  @property
  def narrow_chunks(self) -> bool:
    """Whether a reduction chunk (`tile_k`) is narrower than one 128-byte
    swizzle span of 16-bit elements: the weight gradient's 32-row chunks,
    staged at the 64-byte swizzle."""
    return self.tile_k < SWIZZLE_ELEMS_16BIT

  @property
  def clustered(self) -> bool:
    """Whether the grid is of 2-CTA clusters sharing an operand
    (`cluster_columns` or `cluster_rows`)."""
    return self.cluster_columns or self.cluster_rows

  @property
  def can_share_staging(self) -> bool:
    """Whether the consumers' epilogues alternate, one whole tile each
    (turns, not clusters), so that they may share a staging buffer
    (`shared_staging`)."""
    return self.ping_pong and not self.clustered

  @property
  def staging_buffers(self) -> int:
    """Staging buffers of the "rows" epilogue: one per consumer, or one
    they take turns at (`shared_staging`)."""
    return 1 if self.shared_staging else NUM_CONSUMERS

  def cta_tile(self, mode: str) -> tuple[int, int]:
    """(rows, columns) of one CTA's output tile."""
    if self.ping_pong:
      return self.tile_m, self.tile_n
    if mode == "contracting":
      return NUM_CONSUMERS * self.tile_m, self.tile_n
    return self.tile_m, NUM_CONSUMERS * self.tile_n

  def consumer_tile(self, mode: str) -> tuple[int, int]:
    """(rows, columns) of one consumer warpgroup's accumulator."""
    if mode == "rows" and self.split_rows:
      return self.tile_m // NUM_CONSUMERS, NUM_CONSUMERS * self.tile_n
    return self.tile_m, self.tile_n

  def token_widths(self) -> tuple[int, ...]:
    """With swap_ab: the static token widths a consumer's share of a tile
    runs at, widest first (`swap_ab_widths` of its rows, at
    `token_width_step` from `min_token_width` up)."""
    return swap_ab_widths(self.consumer_tile("rows")[0],
                          self.token_width_step, self.min_token_width)

  def staged_rows(self, mode: str) -> int:
    """Rows of one staged output store (`epi_tile_m`, or the consumer's)."""
    rows = self.consumer_tile(mode)[0]
    return min(self.epi_tile_m, rows) if self.epi_tile_m else rows

  def smem_bytes(self, problem: RaggedProblem) -> int:
    in_size = jnp.dtype(problem.in_dtype).itemsize
    out_size = jnp.dtype(kernel_problem(problem, self).out_dtype).itemsize
    cta_m, cta_n = self.cta_tile(problem.mode)
    stage = (cta_m + cta_n) * self.tile_k * in_size
    staging = (self.staging_buffers * self.out_slots
               * self.staged_rows(problem.mode) * self.epi_tile_n * out_size)
    zeros = (math.prod(self.zero_box(problem.out_dtype)) * out_size
             if self.zeros_by_producer else 0)
    claims = (tile_claims.queue_bytes(self.stages) if self.claim_tiles
              else 0)
    return (self.stages * stage + staging + zeros + claims
            + SMEM_SLACK_BYTES)

  @property
  def reorders_entries(self) -> bool:
    """Whether the kernel walks its table's entries in an order of their
    own (`largest_first`, `cut_groups_first`, `empty_last`), each with
    its output group."""
    return self.largest_first or self.cut_groups_first or self.empty_last

  @property
  def snake_deal(self) -> bool:
    """Whether the tiles are dealt to the CTAs in a snake
    (`mosaic_schedule.snake_deal`): where the walk lists its long tiles
    first (`largest_first`, `cut_groups_first`) and the CTAs walk
    round-robin shares (no claims)."""
    return ((self.largest_first or self.cut_groups_first)
            and not self.claim_tiles)

  def zero_box(self, out_dtype) -> tuple[int, int]:
    """(rows, columns) of the zero box `zeros_by_producer` stores: ZERO_BOX,
    or with `wide_zero_box` the CTA tile's columns (at most
    WIDE_ZERO_BOX_MAX_COLS) and as many rows as fit in WIDE_ZERO_BOX_BYTES
    (a power of two, at least one), so that each of its rows is a longer
    run of consecutive output bytes."""
    if not self.wide_zero_box:
      return ZERO_BOX
    cta_m, cta_n = self.cta_tile("contracting")
    cols = min(cta_n, WIDE_ZERO_BOX_MAX_COLS)
    buffer_bytes = WIDE_ZERO_BOX_BYTES * (2 if self.double_zero_buffer
                                          else 1)
    rows = max(buffer_bytes // (cols * jnp.dtype(out_dtype).itemsize), 1)
    return min(1 << (rows.bit_length() - 1), cta_m), cols

  def last_strip_columns(self, out_cols: int) -> int:
    """Columns the tiles of the last column strip compute over an output
    `out_cols` wide (as staged, `staged_columns`: whole epi_tile_n stores):
    tile_n, or with `narrow_last_strip` the columns that strip holds (whole
    staged stores, so whole swizzle spans of the operand too)."""
    if out_cols % self.epi_tile_n:
      raise ValueError(f"out_cols={out_cols} must be a multiple of "
                       f"epi_tile_n={self.epi_tile_n}")
    if not self.narrow_last_strip:
      return self.tile_n
    return out_cols - (cdiv(out_cols, self.tile_n) - 1) * self.tile_n

  def fits(self, problem: RaggedProblem) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES


def staging_swizzle(epi_tile_n: int, out_dtype) -> int | None:
  """The swizzle (bytes) of `RaggedConfig.swizzled_staging`'s staging rows,
  or None where it cannot apply: a staged row of epi_tile_n output elements
  must be exactly one swizzle span, so that the tiled layout the registers
  are written in lays the rows one after another, and 128 bytes, so that a
  partial store starting at any row starts on a 128-byte boundary."""
  row_bytes = epi_tile_n * jnp.dtype(out_dtype).itemsize
  return row_bytes if row_bytes == 128 else None


def _swizzled_where_possible(config: RaggedConfig,
                             problem: RaggedProblem) -> RaggedConfig:
  """`config` with the "rows" epilogue staged swizzled wherever a staged row
  is one swizzle span (16-bit outputs): written without bank conflicts, it
  measured as fast or faster on every case (experiments/results/
  nvidia_h100/ragged_swizzled_staging)."""
  if (problem.mode != "rows"
      or staging_swizzle(config.epi_tile_n, problem.out_dtype) is None):
    return config
  return dataclasses.replace(config, swizzled_staging=True)


def _swapped_where_possible(config: RaggedConfig,
                            problem: RaggedProblem) -> RaggedConfig:
  """`config` with token rows as wgmma's N (`swap_ab`) where its staging is
  swizzled (16-bit outputs), which swap_ab needs; otherwise unchanged."""
  config = _swizzled_where_possible(config, problem)
  if not config.swizzled_staging:
    return config
  return dataclasses.replace(config, swap_ab=True)


def _most_stages(config: RaggedConfig, problem: RaggedProblem,
                 slot_choices: tuple[int, ...] = (2, 1)) -> RaggedConfig:
  """The deepest ring that fits; a second output slot only where it costs
  no stage (the main loop's latency hiding matters more). `slot_choices`,
  the out_slots tried at each depth in order (one to keep a given
  count)."""
  # zeros_by_producer needs the slots to divide a tile's stores.
  slot_counts = [slots for slots in slot_choices
                 if not config.zeros_by_producer
                 or config.slots_divide_stores(slots)]
  # A capped lookahead needs a deeper ring than its cap.
  for stages in range(MAX_STAGES, max(1, config.short_tile_lookahead), -1):
    for slots in slot_counts:
      candidate = dataclasses.replace(config, stages=stages, out_slots=slots)
      if candidate.fits(problem):
        return candidate
  return dataclasses.replace(config, stages=2, out_slots=1,
                             short_tile_lookahead=0)


#: Output-element throughput of a 128 x 128 CTA tile relative to a
#: 128 x 256 one on a compute-bound grouped GEMM: the narrower tile moves
#: more operand bytes per flop, which the heuristic weighs against the
#: padding and the last-wave idling it saves.
NARROW_TILE_EFFICIENCY = 0.92


def _padded_cost(groups: int, rows: int, cols: int, sms: int, cta_m: int,
                 cta_n: int, efficiency: float) -> float:
  """Relative time of a grid of (cta_m x cta_n) CTA tiles over `groups`
  outputs of rows x cols each, on `sms` SMs: every CTA runs whole tiles
  (ragged edges computed in full) and the busiest one sets the time."""
  tiles = groups * cdiv(rows, cta_m) * cdiv(cols, cta_n)
  return cdiv(tiles, sms) * cta_m * cta_n / efficiency


#: Token rows per expert up to which the consumers take turns at whole
#: 128 x 128 tiles (`RaggedConfig.ping_pong`), in both modes. In the weight
#: gradient a reduction of at most this many rows is short next to its
#: tile's output store, which the other consumer's wgmmas then hide; in
#: "rows" mode a group of a few row items gains two tiles' loads in flight
#: per SM. With more rows the work is compute-bound and the 128 x 256 CTA
#: tile's lower operand traffic per flop wins (clearly on the H100). The
#: 64 x 256 weight-gradient tiles of at most two chunks per expert gained as
#: often as they lost, and stay split (experiments/results/nvidia_h200/
#: ragged_ping_pong, and nvidia_h100/ragged_ping_pong for the H100).
PING_PONG_MAX_ROWS = 512


#: Row items per band of the "rows"-mode tile walk (`RaggedConfig.
#: grid_band`): 64-row tiles, the 128 x 128 CTA tile, the 128 x 256 one.
SHORT_ROWS_BAND, NARROW_TILE_BAND, WIDE_TILE_BAND = 16, 4, 8


#: Token rows per expert up to which "rows" mode (above 96, where its
#: tiles are 128 rows) runs the transposed 256-token tile (`swap_ab`,
#: `split_rows`) ...
SWAP_AB_TALL_MAX_ROWS = 128
#: ... on these GPUs (`DeviceInfo.key`) only: the tile measured faster than
#: the 128-row split tile on the H100 and slower on the H200, on the same
#: DeepSeek-V3 cases (experiments/results/nvidia_h100/ragged_swap_ab and
#: nvidia_h200/ragged_swap_ab). Elsewhere the 128-row tile, the long-
#: standing default, stays.
SWAP_AB_TALL_DEVICES = ("nvidia_h100",)


#: GPUs (`DeviceInfo.key`) on which the heuristic's "rows"-mode turns share
#: one staging buffer (`RaggedConfig.shared_staging`) wherever that buys
#: the ring a stage, run each expert at the `SWAP_AB_TURN_TOKENS`
#: width that cuts it into the fewest items at a ring as deep as the
#: 128-token tile's (`_fewest_turn_items`), and, where that width stays
#: 128, run 192 columns where those pad little (`_wide_column_turns_pay`),
#: and keep no token width below TURN_MIN_TOKEN_WIDTH.
#: Measured on the H200 only (experiments/results/nvidia_h200/
#: ragged_options, "One staging buffer for both consumers", "128 x 192
#: turns in the forward and dlhs", "Fewer token widths").
SHARED_STAGING_DEVICES = ("nvidia_h200",)
#: The narrowest token width of the heuristic's transposed turns
#: (`RaggedConfig.min_token_width`). Turns run where the average expert has
#: more than 128 rows, so only the small experts of an uneven routing have
#: items this narrow, and there a turn is bound by its weight strip's
#: loads more than by its wgmmas; each width it drops is a copy of the
#: loop fewer.
TURN_MIN_TOKEN_WIDTH = 64


def _deeper_with_shared_staging(config: RaggedConfig,
                                problem: RaggedProblem) -> RaggedConfig:
  """`config` with the deepest ring that fits, sharing one staging buffer
  between its turn-taking consumers where that makes the ring deeper (a
  stage stalls both consumers' main loops; the shared buffer only orders
  their epilogues, which alternate anyway)."""
  own = _most_stages(config, problem)
  if not config.can_share_staging:
    return own
  shared = _most_stages(dataclasses.replace(config, shared_staging=True),
                        problem)
  return shared if shared.stages > own.stages else own


#: How much longer than the 128-token turns a wider turn may be predicted
#: to run where one expert holds every token (`_one_hot_turn_rows`) and
#: still be taken: the prediction's error on the one-hot pairs measured on
#: the H200, with room (experiments/results/nvidia_h200/ragged_options,
#: "The 144-token turns off the suite").
ONE_HOT_WAVE_MARGIN = 1.05


def _one_hot_turn_rows(config: RaggedConfig, problem: RaggedProblem,
                       sms: int) -> int:
  """Token rows each SM computes, in the worst wave, where one expert
  holds all of `problem`'s rows: its balanced items of at most
  `config.tile_m` rows (run at the narrowest `swap_ab` width that holds
  them) times the column tiles, dealt over `sms` SMs. Routing is runtime
  data; this is the one routing whose items a static shape fixes, and
  where a wider item's fewer tiles can still need as many waves."""
  items, width = _balanced_items(problem.m, config.tile_m)
  return cdiv(items * cdiv(problem.n, config.tile_n), sms) * width


def _fewest_turn_items(base: RaggedConfig, rows_per_group: float,
                       problem: RaggedProblem, sms: int) -> RaggedConfig:
  """The turn-taking `swap_ab` tile (`base`, 128 tokens) at the token
  width of SWAP_AB_TURN_TOKENS that cuts the average group into fewer
  balanced items than 128 tokens do, the fewest, on a ring as deep as
  `base`'s (with shared staging); `base` where none does. Each item loads
  its weight strip and runs the ring's handshakes once, so fewer items
  computing the same token rows are faster (a 274-row group: two items of
  137 at width 144, not three of 92 at 96), while a shallower ring costs
  more than an item saves (the 192-token tile at 129-512 rows). A width
  is also passed over where one expert holding every token would need as
  many waves of its wider tiles (`_one_hot_turn_rows`, beyond
  ONE_HOT_WAVE_MARGIN): on 132 SMs, 8704 rows over 1408 columns are six
  waves at 128 tokens and six at 144."""
  best = _deeper_with_shared_staging(base, problem)
  best_items = math.ceil(rows_per_group / base.tile_m)
  one_hot_limit = ONE_HOT_WAVE_MARGIN * _one_hot_turn_rows(base, problem,
                                                           sms)
  for tokens in SWAP_AB_TURN_TOKENS:
    wide = _deeper_with_shared_staging(
        dataclasses.replace(base, tile_m=tokens), problem)
    items = math.ceil(rows_per_group / tokens)
    if (wide.stages >= best.stages and items < best_items
        and _one_hot_turn_rows(wide, problem, sms) <= one_hot_limit):
      best, best_items = wide, items
  return best


#: Time per output element of the "rows"-mode turn-taking tile at 128
#: tokens x 192 columns relative to 128 x 128, where neither pads: each
#: turn loads half again as many weight columns per token row, a sixth
#: fewer operand bytes per flop from L2, which bounds these short-reduction
#: tiles. Rounded down from the pairs measured on the H200 (experiments/
#: results/nvidia_h200/ragged_options, "128 x 192 turns in the forward and
#: dlhs"), so that the rule below takes the wide tile only where it pads
#: the columns by less than about 4 %.
WIDE_COLUMN_TURN_TIME = 0.96


def _wide_column_turns_pay(config: RaggedConfig,
                           problem: RaggedProblem) -> bool:
  """Whether the 128-token turn-taking `swap_ab` tile (`config`) is faster
  at 192 columns than at 128: its columns padded to whole tiles, at
  WIDE_COLUMN_TURN_TIME. The token items are the same either way (a
  consumer holds 128 x 192 only at 128 tokens), so the walk over them
  does not enter."""
  padded_columns = lambda width: cdiv(problem.n, width) * width
  return (config.tile_m == 128 and config.tile_n == 128
          and padded_columns(SWAP_AB_MAX_TOKENS) * WIDE_COLUMN_TURN_TIME
          < padded_columns(config.tile_n))


def _takes_turns(rows_per_group: float) -> bool:
  """Whether the heuristic has the consumers take turns at whole 128 x 128
  tiles: experts of more than one and at most PING_PONG_MAX_ROWS / 128
  128-row tiles, in either mode."""
  return 128 < rows_per_group <= PING_PONG_MAX_ROWS


#: The token-transposed tiles' speed relative to the 128 x 256 split-rows
#: tile where neither pads (whole 128-row items): measured on Mixtral's
#: 4096-row experts for the turn-taking tile (experiments/results/
#: nvidia_h200/ragged_options, "The queued pairs") and on Phi-3.5-MoE's
#: one-hot routing for the 256-token one (experiments/results/nvidia_h100/
#: ragged_options, "Tall balanced items"), and rounded down, so that the
#: rule below switches only on a clear padding gain.
BALANCED_TILE_EFFICIENCY = 0.95
#: Above PING_PONG_MAX_ROWS, the token-transposed tile (its token rows,
#: `tile_m`) whose balanced items `_balanced_items_pad_less` weighs against
#: 128-row items, per GPU (`DeviceInfo.key`). On the H100, on Phi-3.5-MoE's
#: 513-row experts, the turn-taking 128-token tile was slower than 128-row
#: items (experiments/results/nvidia_h100/ragged_options, "Turns above 512
#: rows") and the 256-token tile, whose two consumers split an item's
#: tokens and share its weight strip, faster ("Tall balanced items"). On
#: the H200 the turn-taking tile was faster, and at 192 tokens (three items
#: of 171 there, each loading the weight strip once) faster again than at
#: 128 (five of 104) on every routing and direction measured (experiments/
#: results/nvidia_h200/ragged_options, "192-token turns and 128 x 192
#: weight-gradient turns"). At 129-512 rows, where it computes as many rows
#: as the 128-token tile or more, the 128-token tile and its deeper ring
#: were the faster, so the 192-token one runs only above
#: PING_PONG_MAX_ROWS. Other GPUs keep the 128-row items.
BALANCED_ITEMS_TILE_M = {"nvidia_h200": SWAP_AB_MAX_TOKENS,
                         "nvidia_h100": 256}


def _balanced_items_pad_less(rows_per_group: float, tile_m: int) -> bool:
  """Whether the balanced items of a token-transposed tile of `tile_m`
  token rows (`mosaic_schedule.row_items(balanced=True)`: as many items as
  tile_m-row tiles, equally long, each run at the narrowest `swap_ab`
  width that holds it) compute fewer rows per expert, at
  BALANCED_TILE_EFFICIENCY, than 128-row items, whose last item is padded
  to 128 rows. An expert of 513 rows is five items of 128 (640 rows
  computed), five of 104 run at width 112 on the 128-token tile (560), or
  three of 171 run at width 192 on the 256-token one (576): either wins.
  Group sizes are runtime data, so the estimate takes every group at the
  average."""
  rows = math.ceil(rows_per_group)
  items, width = _balanced_items(rows, tile_m)
  return (items * width / BALANCED_TILE_EFFICIENCY
          < cdiv(rows, PLAIN_ITEM_ROWS) * PLAIN_ITEM_ROWS)


#: Column tiles of the weight gradient's short-reduction tile (64 x 256 per
#: consumer) up to which its walk takes one K strip at a time
#: (`grid_band=1`): it measured faster on outputs 8 tiles wide on both GPUs
#: and slower on one 28 tiles wide, so the line sits at the widths measured
#: to gain.
NARROW_OUTPUT_STRIPS = 8


#: Ring steps the producer keeps in flight while it loads a weight-gradient
#: tile of at most that many reduction chunks (`RaggedConfig.
#: short_tile_lookahead`), set on the short-reduction tile: a producer that
#: runs the whole ring ahead into the next tiles adds loads in flight to the
#: output stores that bound these tiles; capped, the even routing of
#: DeepSeek-V3's up projection ran as fast as on a two-stage ring, while the
#: long tiles of uneven routings keep the whole ring (experiments/results/
#: nvidia_h100/ragged_options, "Producer lookahead").
SHORT_TILE_LOOKAHEAD = 2

#: Output bytes from which the weight gradient of short reductions (at most
#: two chunks per expert) takes the short, wide tile and its claimed
#: tiles. Its wide stores pay on a large output, but its tables (the
#: claims' entries reordered empty last) are more small launches, a few
#: microseconds: on smaller outputs the plain tile taking turns ran faster.
#: The bound lies between the sizes where the two measured even and where
#: the short tile won (experiments/results/nvidia_h200/moe_edges, "The
#: short tile's size").
SHORT_TILE_MIN_OUTPUT_BYTES = 192 * 2**20


#: Time per output element of the weight gradient's 128 x 192 turn-taking
#: tile relative to the 128 x 128 one, where neither pads nor idles SMs: a
#: wider tile reads fewer operand bytes from L2 per flop. Fitted between
#: the layers measured (experiments/results/nvidia_h200/ragged_options,
#: "192-token turns and 128 x 192 weight-gradient turns"), where the
#: wider tile's padded columns decided: faster at 1408 columns (to 1536),
#: slower at 1024 (to 1152).
WIDE_TURN_TILE_TIME = 0.9
#: The GPUs (`DeviceInfo.key`) the wide turn tile was measured on; elsewhere
#: the 128 x 128 turns stay until it is (weight-gradient tiles have gained
#: on one Hopper and lost on the other before: `cluster_columns`).
WIDE_TURN_TILE_DEVICES = ("nvidia_h200",)


#: The GPUs (`DeviceInfo.key`) on which the weight gradient's
#: short-reduction tile has its CTAs claim their tiles, the empty groups'
#: last, and its producer store those zero tiles in boxes as wide as the
#: tile (`claim_tiles`, `empty_last`, `zeros_by_producer`, `wide_zero_box`;
#: the zero buffer costs no ring stage there): a CTA that drew a long tile
#: no longer holds a fixed share of the others, so uneven routings spread
#: over the SMs, and the zeros are written by whichever CTAs are free. It
#: replaced the producer's zero drip over a dealt share (`zero_drip` alone),
#: which it measured faster than on nearly every DeepSeek-V3, g128 and
#: decode-batch case (experiments/results/nvidia_h200/ragged_options,
#: "Claimed tiles"). The groups with rows are claimed in table order, not
#: largest first: sorted, all the long, compute-bound tiles of the large
#: groups ran first and the short, store-bound ones after them, where in
#: table order (experts of any size side by side) both run together (same
#: notes, "The short tiles' order and zero box"). The H100 never took the
#: drip (experiments/results/nvidia_h100/ragged_zero_drip), and claims are
#: not measured on it.
CLAIMED_TILES_DEVICES = ("nvidia_h200",)
#: Zero boxes of the empty groups' zero tiles each producer claims after
#: each of its loads on that tile (`zero_drip` with `claim_tiles`), where
#: one group's tiles would keep most SMs busy (`_one_group_fills_the_sms`):
#: with (nearly) every CTA on a long tile, few are left to write the zeros
#: meanwhile, and claimed after the long tiles the zeros wait for them.
#: Where a group's tiles leave many SMs free, those write the zeros beside
#: the long tiles already, and the drip only slowed the long tiles. The
#: line lies between the layers measured on either side; the 2048-token
#: decode batch, whose long tiles are short, is a loss it cannot tell
#: apart. Routings with no empty group do not change (experiments/results/
#: nvidia_h200/ragged_options, "Claimed tiles"). Those zeros are stored as
#: runs of the empty groups' contiguous output under an L2 evict-first
#: policy (`streamed_zeros`): faster than the TMA boxes wherever many
#: groups are empty, and the same elsewhere, as only the zeros' stores
#: change (same notes, "Streamed zeros"). Where the doubled zero buffer
#: fits at the same ring depth (`double_zero_buffer`), the drip is
#: CLAIMED_ZERO_DRIP_DOUBLED runs of it: the same bytes after each load in
#: half as many copies, faster on the one-hot routing; more bytes a load,
#: or fewer, were slower (same notes, "Rows listed largest first, the
#: hint's share, the doubled zero buffer, claim streams").
CLAIMED_ZERO_DRIP = 4
CLAIMED_ZERO_DRIP_DOUBLED = CLAIMED_ZERO_DRIP // 2
#: ... where one group's tiles are at least this share of the SMs.
CLAIMED_ZERO_DRIP_MIN_TILES_PER_SM = 0.5


def _wide_turn_tile_pays(problem: RaggedProblem, sms: int) -> bool:
  """Whether the weight gradient's turn-taking tiles are 128 x 192 rather
  than 128 x 128: faster (`WIDE_TURN_TILE_TIME`, columns padded to whole
  tiles, whole waves of tiles on `sms` SMs) both with every group at the
  average and with one group holding every row. The second is the one-hot
  routing, where only that group's tiles carry a reduction: wider tiles are
  fewer, and where they fill no fewer waves than the narrow ones they
  only make each wave longer (Qwen3-30B's 2048 x 768 experts: 64 wide or
  96 narrow tiles, one wave of 132 SMs either way)."""
  return all(
      _padded_cost(groups, problem.k, problem.n, sms, 128,
                   SWAP_AB_MAX_TOKENS, 1 / WIDE_TURN_TILE_TIME)
      < _padded_cost(groups, problem.k, problem.n, sms, 128, 128, 1.0)
      for groups in {max(problem.groups, 1), 1})


def _turns_fill_idle_sms(problem: RaggedProblem, config: RaggedConfig,
                         sms: int) -> bool:
  """Whether the weight gradient takes turns (each consumer's tile a CTA
  tile: twice `config`'s CTA tiles) because its output at `config`'s tiles
  would leave at least half the `sms` SMs idle, whatever the routing: the
  turns' tiles are still at most one per SM, and neither tile cuts the
  reductions into pieces, which fill idle SMs their own way (the turns
  were measured against `config` without pieces: experiments/results/
  nvidia_h200/moe_edges, "Turns on small long reductions")."""
  if 2 * problem.groups * group_output_tiles(problem, config) > sms:
    return False
  return not any(
      _cut_where_one_group_idles_the_sms(_most_stages(tile, problem), problem,
                                        sms).piece_rows
      for tile in (config, dataclasses.replace(config, ping_pong=True)))


def _contracting_heuristic(problem: RaggedProblem,
                           device: DeviceInfo) -> RaggedConfig:
  chunk = 64
  rows_per_group = problem.m / max(problem.groups, 1)
  base = RaggedConfig(tile_m=128, tile_n=128, tile_k=chunk, epi_tile_n=64,
                      grid_band=8)
  short = rows_per_group <= 2 * chunk
  if short and problem.out_bytes >= SHORT_TILE_MIN_OUTPUT_BYTES:
    # A tile's reduction is a chunk or two: its cost is writing its output
    # tile, in bursts as large as possible: a short, wide tile stored by
    # each consumer in one piece (rows of 512 bytes) rather than a deep
    # ring (experiments/results/nvidia_h200/ragged_sweep).
    base = dataclasses.replace(base, tile_m=64, tile_n=256, epi_tile_n=256)
    if cdiv(problem.n, base.tile_n) <= NARROW_OUTPUT_STRIPS:
      # A tile of one or two chunks is mostly its output store: with a
      # narrow output, walking each K strip's few column tiles in turn has
      # the CTAs in flight write whole output rows side by side
      # (experiments/results/nvidia_h200/ragged_options, "Store order").
      base = dataclasses.replace(base, grid_band=1)
    base = dataclasses.replace(base, short_tile_lookahead=SHORT_TILE_LOOKAHEAD)
  elif (short or _takes_turns(rows_per_group)
        or _turns_fill_idle_sms(problem, base, device.planning_sms)):
    # (Short reductions come here on outputs below the short tile's size;
    # long ones where the split tiles would idle half the SMs.)
    # Each consumer keeps the tile it had, now a whole CTA tile: twice as
    # many tiles, which also spreads a group that holds most tokens over
    # more SMs. Or, where it pays, the widest tile a consumer holds whole.
    base = dataclasses.replace(base, ping_pong=True)
    if (device.key in WIDE_TURN_TILE_DEVICES
        and _wide_turn_tile_pays(problem, device.planning_sms)):
      base = dataclasses.replace(base, tile_n=SWAP_AB_MAX_TOKENS)
  # Group sizes are runtime data, so one config serves every routing. Two
  # options for the routing where one group holds most tokens stay off:
  # cutting its reduction into pieces (`piece_rows`, see
  # `filling_piece_rows`; except where one group's tiles would leave most
  # SMs idle, `_cut_where_one_group_idles_the_sms`) and, except on the
  # short-reduction tile below, having the producer store the other groups'
  # zero tiles (`zeros_by_producer`, `zero_drip`) measured slower on the
  # even and Zipf routings, or on the one-hot routing itself, than they
  # gained (experiments/results/nvidia_h200/ragged_options). So do 2-CTA
  # clusters sharing lhs (`cluster_columns`): on the short-reduction tile
  # they removed a large slowdown of one DeepSeek-V3 projection on the H200
  # and caused one as large on the other projection on the H100. Claimed
  # tiles (`claim_tiles`) gain on the one-hot routing of the longer
  # reductions' turns too, but cost more than that on their even routing
  # (same notes, "Claimed tiles"), so they are kept to the short-reduction
  # tile below.
  config = _most_stages(base, problem)
  if config.short_tile_lookahead and device.key in CLAIMED_TILES_DEVICES:
    claiming = _most_stages(
        dataclasses.replace(config, zeros_by_producer=True, claim_tiles=True,
                            empty_last=True, wide_zero_box=True), problem)
    if claiming.stages == config.stages:
      config = claiming
      if _one_group_fills_the_sms(problem, config, device.planning_sms):
        config = dataclasses.replace(config, zero_drip=CLAIMED_ZERO_DRIP,
                                     streamed_zeros=True)
        doubled = dataclasses.replace(config, double_zero_buffer=True,
                                      zero_drip=CLAIMED_ZERO_DRIP_DOUBLED)
        if doubled.fits(problem):
          config = doubled
  config = _cut_where_one_group_idles_the_sms(config, problem,
                                              device.planning_sms)
  if planes_read_in_place(config, problem):
    # Rows not in whole 8-row tiles (tokens x top-k often are not): read
    # in place through 64-column planes rather than padded, two full
    # copies of the operands.
    config = dataclasses.replace(config, operand_planes=True)
  config = _spread_where_zero_tiles_pay(config, problem)
  # The output's columns may end inside the last strip: its tiles then
  # compute only the columns it holds. 1408 columns at 128 x 192 are seven
  # wide strips and one of 64 instead of eight wide ones; it measured
  # faster there on even and Zipf routings, and as fast on one-hot
  # (experiments/results/nvidia_h200/ragged_options, "The narrow last
  # strip"). It computes less wherever it applies, so it is not kept to
  # the GPUs measured. The tile's width is still chosen on whole padded
  # strips (`_wide_turn_tile_pays`): the one-hot routing's waves, not
  # the padding, keep OLMoE's 1024 columns at 128.
  return _narrowed_where_possible(config, problem)


def _narrowed_where_possible(config: RaggedConfig,
                             problem: RaggedProblem) -> RaggedConfig:
  """`config` with `narrow_last_strip` where the weight gradient's last
  column strip holds fewer columns than tile_n (and no cluster pairs
  strips); otherwise `config`."""
  if config.cluster_columns:
    return config
  narrow = dataclasses.replace(config, narrow_last_strip=True)
  held = narrow.last_strip_columns(staged_columns(problem.n, config))
  return narrow if held < config.tile_n else config


def _cut_where_one_group_idles_the_sms(config: RaggedConfig,
                                      problem: RaggedProblem,
                                      sms: int) -> RaggedConfig:
  """`config` with the reductions cut into pieces (`filling_piece_rows`)
  and the entries walked largest first, where one group holding every row
  would run its tiles on at most 1 / PIECES_IDLE_SHARE of the SMs and leave
  the rest idle, and the pieces hold at least PIECES_MIN_ROWS rows (or
  the only group has at least ONE_GROUP_PIECES_MIN_ROWS); otherwise
  `config`. Group sizes are runtime data, so this is decided on
  the layer's shape alone: it pays the pieces' work list and merge on
  every routing, which only a group's time on a small share of the SMs
  outweighs."""
  if group_output_tiles(problem, config) * PIECES_IDLE_SHARE > sms:
    return config
  rows = filling_piece_rows(problem, config, sms)
  one_long_group = (problem.groups == 1
                    and problem.m >= ONE_GROUP_PIECES_MIN_ROWS)
  if not rows or (rows < PIECES_MIN_ROWS and not one_long_group):
    return config
  cut = _most_stages(dataclasses.replace(
      config, piece_rows=rows, largest_first=True, empty_last=False),
      problem, slot_choices=(config.out_slots,))
  return cut if cut.fits(problem) else config


#: The flops (2 x rows x K x N) from which the weight gradient spreads the
#: empty groups' zero tiles between each CTA's tiles with rows
#: (`spread_zero_tiles`): the table's entries reordered empty last is a few
#: more small XLA launches on every call, a few microseconds, which only a
#: call this long makes small beside what the spread gains where one group
#: holds most tokens (experiments/results/nvidia_h200/ragged_options,
#: "Zero tiles spread between the long tiles").
SPREAD_ZERO_TILES_MIN_FLOPS = 1.5e11


def _spread_where_zero_tiles_pay(config: RaggedConfig,
                                 problem: RaggedProblem) -> RaggedConfig:
  """`config` with the empty groups' zero tiles spread between each CTA's
  tiles with rows (`spread_zero_tiles`, in empty_last's order), and with
  turns or operand planes stored evicted from L2 first
  (`zero_tiles_evict_first`), where the
  consumers store the zero tiles (no claims, producer-stored zeros, pieces
  or clusters), the tiles carry long reductions (not the short-reduction
  tile, whose tiles are mostly their stores: nothing to overlap the zeros
  with) and the call does at least SPREAD_ZERO_TILES_MIN_FLOPS; otherwise
  `config`. It changes no walk where no group is empty."""
  if (config.claim_tiles or config.zeros_by_producer or config.piece_rows
      or config.clustered or config.interleave_groups
      or config.largest_first or config.short_tile_lookahead):
    return config
  if (problem.groups < 2  # no other group to be empty beside one with rows
      or 2 * problem.m * problem.k * problem.n < SPREAD_ZERO_TILES_MIN_FLOPS):
    return config
  # The zero tiles as runs under an evict-first policy, so that they do not
  # evict the long tiles' operands from L2 (same notes, same section):
  # where the consumers take turns or read operand planes. The split tile
  # reading whole stages (Mixtral 8x7B, g8) was as fast or slower with it.
  return dataclasses.replace(
      config, empty_last=True, spread_zero_tiles=True,
      zero_tiles_evict_first=config.ping_pong or config.operand_planes)


def kernel_problem(problem: RaggedProblem,
                   config: RaggedConfig) -> RaggedProblem:
  """The problem the kernel itself runs under `config`: with split_k in
  "rows" mode, float32 partial sums and no activation (both applied once
  the shares are added)."""
  if config.split_k == 1 or problem.mode != "rows":
    return problem
  return dataclasses.replace(problem, out_dtype="float32", activation=None)


def k_splits(config: RaggedConfig, k_iters: int) -> tuple[int, int]:
  """(shares, K steps per share) of a reduction of `k_iters` steps under
  split_k: split_k shares or fewer, every one with at least one step."""
  per_share = cdiv(k_iters, min(config.split_k, max(k_iters, 1)))
  return cdiv(k_iters, per_share), per_share


def staged_columns(n: int, config: RaggedConfig) -> int:
  """An output's columns as the kernels stage them, in either mode: `n`
  rounded up to whole staged stores (epi_tile_n)."""
  return cdiv(n, config.epi_tile_n) * config.epi_tile_n


def _one_group_fills_the_sms(problem: RaggedProblem, config: RaggedConfig,
                             sms: int) -> bool:
  """Whether one group's output tiles (a weight gradient's K x N at the CTA
  tile) are at least CLAIMED_ZERO_DRIP_MIN_TILES_PER_SM of the SMs: then,
  where one group holds most tokens, most CTAs run its long tiles and few
  are left free."""
  return (group_output_tiles(problem, config)
          >= CLAIMED_ZERO_DRIP_MIN_TILES_PER_SM * sms)


def group_output_tiles(problem: RaggedProblem, config: RaggedConfig) -> int:
  """One group's output tiles in a weight gradient: its K x N output at the
  CTA tile."""
  cta_m, cta_n = config.cta_tile("contracting")
  return cdiv(problem.k, cta_m) * cdiv(problem.n, cta_n)


def contracting_operand_swizzle(config: RaggedConfig, dtype) -> int | None:
  """The swizzle (bytes) of the weight gradient's lhs and dout stages:
  None, the widest their columns allow (128 bytes), or, for a chunk
  narrower than that span's elements (tile_k=32 of 16-bit inputs), the
  span the chunk fills, the widest at which Mosaic's wgmma takes it as K
  (experiments/lab/chunk32_probe.py)."""
  span = config.tile_k * jnp.dtype(dtype).itemsize
  return span if span < max(WGMMA_SWIZZLES) else None


def planes_read_in_place(config: RaggedConfig,
                         problem: RaggedProblem) -> bool:
  """Whether `operand_planes` lets the compiled weight gradient read lhs
  and dout as they are where `config` without it pads them: rows not a
  whole number of 8-row tiles (at least a chunk of them), 16-bit inputs,
  and columns that need no padding of their own (whole 64-column planes,
  at least a tile's)."""
  if (problem.mode != "contracting" or config.clustered
      or config.narrow_chunks
      or jnp.dtype(problem.in_dtype).itemsize != 2):
    return False
  cta_m = config.cta_tile("contracting")[0]
  return (problem.m % 8 != 0 and problem.m >= config.tile_k
          and all(cols % SWIZZLE_ELEMS_16BIT == 0 and cols >= width
                  for cols, width in ((problem.k, cta_m),
                                      (problem.n, config.tile_n))))


def heuristic(problem: RaggedProblem, device: DeviceInfo) -> RaggedConfig:
  """A config from the shapes alone (pure; group sizes are runtime data)."""
  if problem.mode == "contracting":
    return _contracting_heuristic(problem, device)
  config = _split_where_few_tiles(problem, _rows_heuristic(problem, device),
                                  device.planning_sms)
  if device.is_gpu and work_list_kernel.supports(problem.groups):
    # One launch for the item table instead of XLA's chain of small
    # kernels; in the interpreter (CPU) the XLA ops are the faster path.
    config = dataclasses.replace(config, work_list_kernel=True)
  return config


def _rows_heuristic(problem: RaggedProblem, device: DeviceInfo
                    ) -> RaggedConfig:
  sms = device.planning_sms
  groups = max(problem.groups, 1)
  rows_per_group = problem.m / groups
  # Few tokens per expert: a 128-row tile would be mostly rows of other
  # groups, each computed and thrown away, while every expert's weights are
  # streamed once either way.
  tile_m = 64 if rows_per_group <= 96 else 128
  tile_n = 128
  if tile_m == 128:
    # 128 x 256 or 128 x 128 CTA tiles: the narrower one where the columns
    # padded up to 256 and the idle part of the last wave cost more than
    # its lower efficiency, with every group at the average size.
    rows = cdiv(problem.m, groups)
    wide = _padded_cost(groups, rows, problem.n, sms, 128, 256, 1.0)
    narrow = _padded_cost(groups, rows, problem.n, sms, 128, 128,
                          NARROW_TILE_EFFICIENCY)
    if narrow < wide:
      tile_n = 64
  n_tiles = -(-problem.n // (NUM_CONSUMERS * tile_n))
  if n_tiles * max(problem.m // tile_m, 1) < sms and problem.n <= 1024:
    tile_n = 64  # too few tiles to fill the machine
  # Consecutive tiles walk `grid_band` row items for one column strip: the
  # row tiles of one (group, column strip) run together, so an expert's
  # weight tile is fetched from HBM once and the other row tiles of the
  # group find it in L2.
  # A shorter band suits the narrow 128 x 128 CTA tile: twice as many
  # column strips share the same weight bytes (experiments/results/
  # nvidia_h200/ragged_sweep).
  band = (SHORT_ROWS_BAND if tile_m == 64 else
          NARROW_TILE_BAND if tile_n == 64 else WIDE_TILE_BAND)
  # Weight strips are shared only by the row items of one group: a band
  # taller than a group's items buys no weight reuse, and spreads the
  # column strips of each item (which share its lhs rows) further apart,
  # so that lhs is fetched from HBM again (experiments/results/nvidia_h100/
  # moe_profile/README.md). Where the average group has fewer items than
  # the band, the bands restart at each group instead (`group_bands`):
  # a band then never crosses into the next expert whatever the routing,
  # and a group far above the average (Zipf) is still walked `band` items
  # at a time (experiments/results/nvidia_h100/ragged_group_bands).
  group_bands = (tile_m == 128
                 and math.ceil(rows_per_group / tile_m) < band)
  balanced_tile_m = BALANCED_ITEMS_TILE_M.get(device.key, 0)
  balanced = (rows_per_group > PING_PONG_MAX_ROWS and balanced_tile_m
              and _balanced_items_pad_less(rows_per_group, balanced_tile_m)
              and _swapped_where_possible(RaggedConfig(), problem).swap_ab)
  balanced_turns = balanced and balanced_tile_m in (128, SWAP_AB_MAX_TOKENS)
  if _takes_turns(rows_per_group) or balanced_turns:
    # Experts of a few row items: the consumers take turns at whole
    # 128 x 128 tiles, so that each SM has two tiles' loads in flight and
    # one consumer's output store overlaps the other's wgmmas. At one item
    # per expert and fewer (memory-bound DeepSeek-V3) it measured slower
    # (experiments/results/nvidia_h200/ragged_ping_pong).
    # Its 128 x 128 CTA tile is the narrow one.
    # The tokens are wgmma's N (`swap_ab`), each group cut into equal
    # items near a multiple of 8 rows: faster where experts' sizes are not
    # multiples of 128 (Qwen1.5-MoE, even and Zipf routings), as fast at
    # 256 rows, slightly slower where one expert holds every token and
    # nothing is padded (H100: experiments/results/nvidia_h100/
    # ragged_swap_ab). Above PING_PONG_MAX_ROWS the same tile where its
    # balanced items pad far less than 128-row ones
    # (`_balanced_items_pad_less`), at the token rows BALANCED_ITEMS_TILE_M
    # gives.
    base = _swapped_where_possible(RaggedConfig(
        tile_m=128, tile_n=128, tile_k=64, epi_tile_n=64,
        grid_band=min(band, NARROW_TILE_BAND), ping_pong=True,
        group_bands=group_bands), problem)
    if balanced_turns:
      base = dataclasses.replace(base, tile_m=balanced_tile_m)
    # Shared staging only on the transposed tiles' epilogue: on the plain
    # tiles of a float32 output it won on some routings of a layer and
    # lost on others (experiments/results/nvidia_h200/ragged_options,
    # "The shared buffer on float32 outputs").
    if device.key not in SHARED_STAGING_DEVICES or not base.swap_ab:
      return _most_stages(base, problem)
    base = dataclasses.replace(base, min_token_width=TURN_MIN_TOKEN_WIDTH)
    if balanced_turns:
      return _deeper_with_shared_staging(base, problem)
    turns = _fewest_turn_items(base, rows_per_group, problem,
                               device.planning_sms)
    if _wide_column_turns_pay(turns, problem):
      # Where the token width stayed at 128 (more would cut no group into
      # fewer items), wider column strips instead.
      wide = _deeper_with_shared_staging(
          dataclasses.replace(turns, tile_n=SWAP_AB_MAX_TOKENS), problem)
      if wide.fits(problem):
        return wide
    return turns
  if (balanced and balanced_tile_m == 256) or (
      tile_m == 128 and rows_per_group <= SWAP_AB_TALL_MAX_ROWS
      and device.key in SWAP_AB_TALL_DEVICES):
    # About one 128-row item per expert (DeepSeek-V3): 256-token items,
    # transposed, whose consumers split the tokens (the second idle where a
    # group has at most 128) and share the weight strip: with uneven
    # routings a group's rows are one item at a width near them, where
    # 128-row items padded each group's last (experiments/results/
    # nvidia_h100/ragged_swap_ab). On the GPUs of SWAP_AB_TALL_DEVICES only.
    # The same tile above PING_PONG_MAX_ROWS where its balanced items pad
    # far less than 128-row ones (a 513-row expert: three items of 171 at
    # width 192), where BALANCED_ITEMS_TILE_M says so.
    tall = _swapped_where_possible(RaggedConfig(
        tile_m=256, tile_n=64, tile_k=64, epi_tile_n=64, grid_band=band,
        split_rows=True, group_bands=True), problem)
    if tall.swap_ab:
      return _most_stages(tall, problem)
  # A 128-row tile is split into two 64-row halves, one 64 x (2 * tile_n)
  # wgmma each per step, as the dense `mosaic/ws_persistent` does at its
  # best. Neither tile runs as 2-CTA clusters sharing lhs
  # (`cluster_columns`): slower on both, most with turns
  # (experiments/results/nvidia_h200/ragged_options).
  # The tile count follows the routing, so the deal may end on a round
  # that leaves most SMs idle for a whole tile's time; where that round
  # fills at most half of them, its tiles run as half-width tiles on twice
  # as many (`halve_last_round`; experiments/results/nvidia_h200/
  # ragged_options, "The last round in half tiles").
  base = RaggedConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, epi_tile_n=64,
                      grid_band=band, split_rows=tile_m == 128,
                      group_bands=group_bands,
                      halve_last_round=tile_m == 128)
  return _most_stages(_swizzled_where_possible(base, problem), problem)


#: The "rows" kernel splits its tiles' reductions (`split_k`) where its
#: tiles, likely, fill at most this share of the SMs ...
SPLIT_K_MAX_SM_SHARE = 0.5
#: ... into shares of at least this many K steps (tile_k deep), so that a
#: share fills the ring and its partial sums' store and the pass adding
#: them stay small beside its loads ...
SPLIT_K_MIN_STEPS = 8


def _likely_tiles(problem: RaggedProblem, config: RaggedConfig) -> int:
  """The "rows" walk's tiles under `config` for a likely routing: an item
  per group that has rows, or per tile_m rows, whichever is more, times
  the column strips (a routing that cuts the rows into more items gets
  more tiles)."""
  cta_m, cta_n = config.cta_tile("rows")
  items = max(cdiv(problem.m, cta_m), min(problem.groups, problem.m))
  return items * cdiv(problem.n, cta_n)


def _split_where_few_tiles(problem: RaggedProblem, unsplit: RaggedConfig,
                           sms: int) -> RaggedConfig:
  """A split_k config where few output tiles meet a long reduction (one
  expert's dlhs of a few dozen rows, a decode step over few experts): a
  tile per CTA would leave most SMs idle while a few stream the weights,
  so each tile's reduction is cut into shares, one CTA each, and the
  float32 partial sums are added afterwards. `unsplit` elsewhere.

  First on the 64 x 64 tile (two consumers: 128-column strips), where its
  likely tiles (`_likely_tiles`) fill at most SPLIT_K_MAX_SM_SHARE of the
  SMs; else on `unsplit`'s own wider strips where those do (DeepSeek-V3's
  one-token step: 8 experts x 8 strips of 256 columns), where `unsplit`
  has no option the split excludes."""
  if problem.mode != "rows" or 0 in (problem.m, problem.k, problem.n,
                                     problem.groups):
    return unsplit
  narrow = RaggedConfig(tile_m=64, tile_n=64, tile_k=64, epi_tile_n=64,
                        grid_band=SHORT_ROWS_BAND)
  bases = [narrow]
  if not (unsplit.swap_ab or unsplit.halve_last_round
          or unsplit.cluster_columns or unsplit.ping_pong):
    bases.append(dataclasses.replace(unsplit, swizzled_staging=False))
  for base in bases:
    tiles = _likely_tiles(problem, base)
    if tiles > SPLIT_K_MAX_SM_SHARE * sms:
      continue
    shares = min(sms // tiles,
                 cdiv(problem.k, base.tile_k) // SPLIT_K_MIN_STEPS,
                 MAX_SPLIT_K)
    if shares >= 2:
      return _most_stages(dataclasses.replace(base, split_k=shares), problem)
  return unsplit


#: The heuristic cuts a weight gradient's reductions into pieces where one
#: group's tiles are at most 1 / PIECES_IDLE_SHARE of the SMs
#: (`_cut_where_one_group_idles_the_sms`). Where a group's tiles were a
#: small share of the SMs (Granite-3.0-1B's 1024 x 512 experts), cutting
#: and walking largest first made the one-hot routing's gradient several
#: times faster and the Zipf routing's faster, and cost the even routing
#: the pieces' work list and merge; where they were most of the SMs
#: (Qwen3-30B), it gained nothing on the one-hot routing and lost on the
#: others (experiments/results/nvidia_h200/ragged_options, "Pieces where
#: one group leaves the SMs idle").
PIECES_IDLE_SHARE = 4
#: ... and only into pieces of at least this many rows: below that even the
#: uncut group is short beside the pieces' work list and merge, which every
#: call pays (a few small launches).
PIECES_MIN_ROWS = 2048
#: ... except for a single group (a device holding one expert) of at least
#: this many rows, whose pieces may be shorter: its routing is known, every
#: row is in the group that is cut, so no routing pays the pieces without
#: using them, and a reduction this long outweighs their fixed cost
#: (experiments/results/nvidia_h200/moe_edges, "One expert's pieces").
ONE_GROUP_PIECES_MIN_ROWS = 4096
#: The most pieces `filling_piece_rows` cuts a group into: each costs an
#: extra output tile set (zeros when unused) and its share of the merge.
MAX_PIECES = 8
#: ... except a single group, which every routing fills: up to this many
#: pieces, each at least ONE_GROUP_MIN_PIECE_ROWS rows (shorter pieces ran
#: slower than fewer long ones; experiments/results/nvidia_h200/moe_edges,
#: "More pieces for one expert").
ONE_GROUP_MAX_PIECES = 32
ONE_GROUP_MIN_PIECE_ROWS = 512
#: ... and cuts only where that shortens the group's time to this share or
#: less: a group's tiles that fill the SMs gain only wave rounding.
PIECES_WORTH = 0.8


def filling_piece_rows(problem: RaggedProblem, config: RaggedConfig,
                       sms: int) -> int:
  """`piece_rows` for "contracting" mode under which one group holding
  every token finishes soonest on `sms` SMs: cut into P pieces, its
  P x (tiles per group) tiles run in ceil(P x tiles / sms) waves of tiles
  1 / P as long; the fewest pieces (up to MAX_PIECES; for a single group,
  up to ONE_GROUP_MAX_PIECES of at least ONE_GROUP_MIN_PIECE_ROWS rows) of
  the shortest such time. 0 where that saves less than 1 - PIECES_WORTH
  (a group's tiles fill the SMs already). The heuristic takes it only
  where a group's tiles leave most SMs idle
  (`_cut_where_one_group_idles_the_sms`); it is also a candidate of
  `candidates`."""
  tiles = group_output_tiles(problem, config)

  def group_time(pieces):
    return -(-tiles * pieces // max(sms, 1)) / pieces

  most = MAX_PIECES
  if problem.groups == 1:
    most = max(most, min(ONE_GROUP_MAX_PIECES,
                         problem.m // ONE_GROUP_MIN_PIECE_ROWS))
  pieces = min(range(1, most + 1), key=lambda p: (group_time(p), p))
  if group_time(pieces) > PIECES_WORTH * group_time(1):
    return 0
  rows = -(-problem.m // pieces)
  return -(-rows // config.tile_k) * config.tile_k


def candidates(problem: RaggedProblem) -> list[RaggedConfig]:
  """A few configs around the heuristic's, for a GPU sweep (each with the
  deepest ring that fits)."""
  if problem.mode == "contracting":
    shapes = [dict(tile_m=128, tile_n=128), dict(tile_m=64, tile_n=128),
              dict(tile_m=128, tile_n=64), dict(tile_m=64, tile_n=256),
              # Turns at whole tiles, at the two shapes whose accumulator
              # one warpgroup holds.
              dict(tile_m=128, tile_n=128, ping_pong=True),
              dict(tile_m=64, tile_n=256, epi_tile_n=256, ping_pong=True),
              # ... and the widest whole tile a consumer holds (fewer operand
              # bytes per flop read from L2).
              dict(tile_m=128, tile_n=192, ping_pong=True)]
  else:
    shapes = [dict(tile_m=128, tile_n=128, split_rows=True,
                   halve_last_round=True),
              dict(tile_m=128, tile_n=128, split_rows=True),
              dict(tile_m=256, tile_n=64, split_rows=True),
              dict(tile_m=128, tile_n=128),
              dict(tile_m=128, tile_n=64, split_rows=True),
              dict(tile_m=64, tile_n=128),
              dict(tile_m=64, tile_n=64),
              dict(tile_m=128, tile_n=128, split_rows=True, grid_band=16),
              dict(tile_m=128, tile_n=128, ping_pong=True),
              dict(tile_m=64, tile_n=256, ping_pong=True),
              # Bands restarting at each group, as the heuristic walks
              # experts of fewer row items than a band.
              dict(tile_m=128, tile_n=128, split_rows=True, group_bands=True),
              dict(tile_m=128, tile_n=128, ping_pong=True, group_bands=True,
                   grid_band=4),
              # ... also staged in 64-row halves: two slots, as deep a ring.
              dict(tile_m=128, tile_n=128, ping_pong=True, group_bands=True,
                   grid_band=4, epi_tile_m=64),
              # 2-CTA clusters sharing each item's lhs tile (the split-rows
              # tile only: with turns the pairs' lockstep costs more).
              dict(tile_m=128, tile_n=128, split_rows=True,
                   cluster_columns=True)]
  out = []
  for fields in shapes:
    config = _most_stages(_swizzled_where_possible(
        RaggedConfig(**{"grid_band": 8, **fields}), problem), problem)
    if config.fits(problem) and config not in out:
      out.append(config)
  if problem.mode == "rows":
    # Turns at whole tiles of the narrowest and the widest wider token
    # counts (wgmma's N): fewer items per expert, the consumers sharing one
    # staging buffer where that deepens the ring. Only with token rows
    # transposed, which a 16-bit output allows.
    turns = _swapped_where_possible(RaggedConfig(
        tile_m=128, tile_n=128, ping_pong=True, group_bands=True,
        grid_band=4), problem)
    widths = (SWAP_AB_TURN_TOKENS[0], SWAP_AB_MAX_TOKENS)
    for tokens in (widths if turns.swap_ab else ()):
      wide = _deeper_with_shared_staging(
          dataclasses.replace(turns, tile_m=tokens), problem)
      if wide.fits(problem) and wide not in out:
        out.append(wide)
    if turns.swap_ab:
      # ... and the 128-token turns without the narrowest token widths.
      fewer = _deeper_with_shared_staging(dataclasses.replace(
          turns, min_token_width=TURN_MIN_TOKEN_WIDTH), problem)
      if fewer.fits(problem) and fewer not in out:
        out.append(fewer)
  if problem.mode == "contracting" and out:
    # For uneven group sizes: the heuristic's tile walked largest group
    # first, and (where one group's tiles leave SMs idle) also cut.
    out.append(dataclasses.replace(out[0], largest_first=True))
    zeros = _most_stages(dataclasses.replace(out[0], zeros_by_producer=True),
                         problem)
    if zeros.fits(problem):
      out.append(zeros)
    # ... and claimed by the CTAs as each is free, largest group first.
    out.append(_most_stages(dataclasses.replace(
        out[0], claim_tiles=True, largest_first=True), problem))
    # Not 32-row reduction chunks (`tile_k=32`): slower on every layer
    # measured, padded or not (experiments/results/nvidia_h200/
    # ragged_options, "32-row reduction chunks timed").
    rows = filling_piece_rows(problem, out[0], NOMINAL_SMS)
    if rows:
      out.append(dataclasses.replace(out[0], piece_rows=rows))
      out.append(dataclasses.replace(out[0], piece_rows=rows,
                                     largest_first=True))
    # Rows not in whole 8-row tiles: each candidate reads them in place, as
    # the heuristic's does, so the sweep compares tiles, not paddings.
    out = [dataclasses.replace(c, operand_planes=True)
           if planes_read_in_place(c, problem) else c for c in out]
    # ... and computes only the columns its last strip holds, as the
    # heuristic's does.
    out = [_narrowed_where_possible(c, problem) for c in out]
  return out
