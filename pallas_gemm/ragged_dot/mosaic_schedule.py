"""The per-call work lists of the Mosaic grouped-GEMM kernels.

They are computed by a few XLA ops on the device from `group_sizes` (no host
sync, and no recompilation when the sizes change: the lists have static
upper-bound shapes, and the kernels read how many entries are valid).

"rows" mode. The m rows are cut into consecutive pieces: the rows before the
first group, one piece per group, and the rows after the last group. Each
piece is cut into tiles of tile_m rows counted from its first row, rounded
down to a multiple of `row_align` (a TMA load of lhs starts on a whole row
tile of its swizzled layout: Mosaic divides the start by the tile's 8 rows).
A group of s rows so costs cdiv(s + up to 7, tile_m) tiles wherever it
starts; cut at absolute tile_m-row blocks instead, a group that starts
mid-block costs one tile more (experiments/results/nvidia_h100/moe_items).
An item is one piece's rows in one of its tiles; the tile may reach into
the neighbouring groups' rows, is computed with the item's own group's
weights, and stores only the item's rows. Items of the no-group
pieces are zeros (no product is computed). Items are listed in row order, so
the items of one group are consecutive.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.problem import cdiv

#: Rows of the "rows"-mode item table: the item's group (-1: no group),
#: its rows [lo, hi), and its piece's first item and item count.
(ITEM_GROUP, ITEM_ROW_LO, ITEM_ROW_HI, ITEM_PIECE_FIRST,
 ITEM_PIECE_ITEMS) = range(5)
#: Rows of the "contracting"-mode group table: the group's rows [lo, hi),
#: the first row of its first chunk, and its chunk count.
GROUP_ROW_LO, GROUP_ROW_HI, GROUP_FIRST_ROW, GROUP_CHUNKS = range(4)
#: The row a reordered table (`largest_first`, `empty_last`,
#: `contracting_pieces(cut_groups_first=True)`) adds: each entry's output
#: group.
GROUP_OUTPUT = 4
#: Rows of the table of pieces beyond the groups' first (`contracting_pieces`).
EXTRA_GROUP, EXTRA_FIRST, EXTRA_COUNT = range(3)


def read_entry(table_ref, column):
  """Inside a kernel: entry `column` of a work-list table (a ref to the
  (rows, entries) int32 array), as a tuple of its rows in table order
  (ITEM_* or GROUP_*)."""
  return tuple(table_ref[row, column] for row in range(table_ref.shape[0]))


#: Entries up to which `inclusive_sum` is one masked reduction. Its work
#: grows as the square of the count, and vmap folds a batch into the
#: groups, so a long list takes the scan instead.
MASKED_SUM_MAX_ENTRIES = 1024


def inclusive_sum(values):
  """cumsum of a short int32 vector as one masked reduction: XLA fuses it
  into a single small kernel where a scan takes several, and these lists
  are built on every call. Above MASKED_SUM_MAX_ENTRIES, jnp.cumsum."""
  count = values.shape[0]
  if count > MASKED_SUM_MAX_ENTRIES:
    return jnp.cumsum(values, dtype=jnp.int32)
  below = (jnp.arange(count, dtype=jnp.int32)[None, :]
           <= jnp.arange(count, dtype=jnp.int32)[:, None])
  return jnp.sum(jnp.where(below, values[None, :], 0), axis=1,
                 dtype=jnp.int32)


def group_rows(group_sizes, row_offset, m: int):
  """(start, end) row of each group, clipped to [0, m), int32 on device."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = row_offset.astype(jnp.int32)[0] + inclusive_sum(sizes)
  starts = ends - sizes
  return jnp.clip(starts, 0, m), jnp.clip(ends, 0, m)


def max_row_items(m: int, groups: int, tile_m: int, row_align: int) -> int:
  """A bound on the item count. Each of the at most groups + 2 non-empty
  pieces, of l rows that together sum to m, has cdiv(l + d, tile_m) items
  with d < row_align (its start rounded down), which is at most
  (l + row_align - 1) / tile_m + 1."""
  pieces = groups + 2
  return cdiv(m + pieces * (row_align - 1), tile_m) + pieces


def row_items(group_sizes, row_offset, *, m: int, tile_m: int,
              row_align: int, balanced: bool = False):
  """The "rows"-mode item table (5, max_row_items + 1) int32 (see the
  module docstring; rows ITEM_*; group -1 marks rows that belong to no
  group): the items in its first columns, zeros past the valid ones, and
  the number of valid items in its last column (`item_count`). Each item's
  tile starts at its first row rounded down to a multiple of `row_align`.

  With `balanced`, a piece's items (as many as with tile_m rows each) are
  all equally long, a whole number of `row_align` rows: a group of 273 rows
  is three items of 96 rather than 128, 128 and 17, for kernels that run an
  item at a width near its rows (`RaggedConfig.swap_ab`), where a short
  last item would still load the expert's whole weight strip for a few
  rows."""
  groups = group_sizes.shape[0]
  starts, ends = group_rows(group_sizes, row_offset, m)
  zero = jnp.zeros((1,), jnp.int32)
  lo = jnp.concatenate([zero, starts, ends[-1:] if groups else zero])
  hi = jnp.concatenate([starts[:1] if groups else zero, ends,
                        jnp.full((1,), m, jnp.int32)])
  piece_group = jnp.concatenate([jnp.full((1,), -1, jnp.int32),
                                 jnp.arange(groups, dtype=jnp.int32),
                                 jnp.full((1,), -1, jnp.int32)])
  first_tile_row, counts, stride = piece_items(
      lo, hi, tile_m=tile_m, row_align=row_align, balanced=balanced)
  counts = counts.astype(jnp.int32)
  ends_incl = inclusive_sum(counts)
  first_item = ends_incl - counts
  # Every entry as one masked sum over the pieces (the piece that holds the
  # item contributes its values, the others zero), the item count in the
  # extra last column: one reduction, which XLA runs as one kernel, where
  # finding each item's piece and then gathering its values took three
  # (the search, the gathers, a copy of the count).
  max_items = max_row_items(m, groups, tile_m, row_align)
  item = jnp.arange(max_items + 1, dtype=jnp.int32)[:, None]
  holds = (first_item <= item) & (item < ends_incl) & (item < max_items)
  tile_row = first_tile_row + (item - first_item) * stride
  count_column = jnp.where(item == max_items, counts, 0)
  entries = jnp.stack([
      jnp.where(holds, piece_group, count_column),
      jnp.where(holds, jnp.maximum(lo, tile_row), 0),
      jnp.where(holds, jnp.minimum(hi, tile_row + stride), 0),
      jnp.where(holds, first_item, 0),
      jnp.where(holds, counts, 0)])
  return jnp.sum(entries, axis=2, dtype=jnp.int32)


def piece_items(lo, hi, *, tile_m: int, row_align: int,
                balanced: bool = False, xp=jnp):
  """(first tile row, item count, rows per item) of pieces of rows
  [lo, hi), 0 <= lo <= hi, as `row_items` cuts them: tiles of tile_m rows
  from lo rounded down to `row_align`, or with `balanced` as many items,
  each the same whole number of `row_align` rows. Plain ops of the array
  module `xp`, so that the work-list kernel (`work_list_kernel`, jnp) and
  the heuristic's estimate (`configs`, NumPy on Python ints) run the same
  definition."""
  if tile_m % row_align:
    raise ValueError(f"tile_m={tile_m} must be a multiple of "
                     f"row_align={row_align}")

  def ceil_div(a, b):  # a >= 0 here
    return (a + b - 1) // b

  first_row = lo // row_align * row_align
  count = xp.where(hi > lo, ceil_div(hi - first_row, tile_m), 0)
  if balanced:
    per_item = ceil_div(hi - first_row, xp.maximum(count, 1))
    return first_row, count, ceil_div(per_item, row_align) * row_align
  return first_row, count, xp.full_like(count, tile_m)


def item_count(table):
  """The number of valid items of a `row_items` table (a traced array, a
  NumPy array, or inside a kernel a ref)."""
  return table[ITEM_GROUP, table.shape[1] - 1]


def _chunk_table(lo, hi, chunk: int, row_align: int):
  """The (4, entries) "contracting"-mode table of row ranges [lo, hi):
  GROUP_ROW_LO, GROUP_ROW_HI, GROUP_FIRST_ROW (lo rounded down to a
  multiple of `row_align`) and GROUP_CHUNKS, the `chunk`-row chunks from
  there that cover the range (0 for an empty range). Counted from the
  group's own first row, a group of s rows takes cdiv(s + up to
  row_align - 1, chunk) chunks; counted at absolute chunk boundaries, a
  group that starts or ends mid-chunk took up to one more, a whole chunk of
  other groups' rows loaded and multiplied as zeros."""
  return jnp.stack(_chunk_rows(lo, hi, chunk, row_align)).astype(jnp.int32)


def _chunk_rows(lo, hi, chunk: int, row_align: int):
  """`_chunk_table`'s four rows as a list, on any (broadcastable) shape."""
  first_row = lo // row_align * row_align
  chunks = jnp.where(hi > lo, (hi - first_row + chunk - 1) // chunk, 0)
  return [lo, hi, first_row, chunks]


def tile_first_row(row_lo, *, row_align: int, lhs_rows: int, tile_m: int):
  """The first row of a "rows"-mode item's tile (traced or NumPy): its
  first row rounded down to `row_align` rows, as `row_items` cut it, held
  back to the last tile_m of lhs's `lhs_rows` rows (at least tile_m; read
  in place, any count, else padded to whole row_align tiles), so that no
  load reaches past lhs; the item's rows then still lie in the tile."""
  return jnp.minimum(row_lo // row_align * row_align, lhs_rows - tile_m)


def contracting_groups(group_sizes, row_offset, *, m: int, chunk: int,
                       row_align: int):
  """The "contracting"-mode group table (4, groups) int32: each group's
  rows [lo, hi), the first row of its first `chunk`-row chunk (lo rounded
  down to `row_align`, where a TMA load may start) and how many chunks
  cover its rows (0 for an empty group)."""
  return _chunk_table(*group_rows(group_sizes, row_offset, m), chunk,
                      row_align)


def max_extra_pieces(m: int, piece_rows: int) -> int:
  """The pieces beyond the groups' first (`contracting_pieces`): one per
  multiple of `piece_rows` strictly inside [0, m), the rows where a cut
  may fall."""
  return max(m - 1, 0) // piece_rows


def contracting_pieces(group_sizes, row_offset, *, m: int, chunk: int,
                       row_align: int, piece_rows: int,
                       cut_groups_first: bool = False):
  """The "contracting"-mode table of `RaggedConfig.piece_rows`: every group
  of more than `piece_rows` rows cut at the multiples of `piece_rows`
  (counted from row 0) inside it, so that every piece beyond a group's first
  starts at a multiple of piece_rows, a whole chunk. The x-th multiple,
  (x + 1) * piece_rows, is the x-th further piece where it cuts a group:
  cuts fall in distinct groups' rows, so no ranking of the pieces is
  needed: the table and `extras` are masked sums over the groups after the
  groups' cumulative sum, fewer small XLA kernels than cutting each group
  from its own first row took (experiments/results/nvidia_h200/
  ragged_options, "Pieces cut at multiples of `piece_rows`").

  Returns (table, extras):
    table   (4, groups + E) int32, as `contracting_groups`: entry g < groups
            is group g's first piece (all its rows when it is not cut; an
            empty group stays empty, and its output zero); entry
            groups + x is the piece that starts at the x-th multiple, or no
            rows where that multiple cuts no group. With
            `cut_groups_first`, (5, E + groups): the E further pieces
            first (each piece_rows long but a group's last), then the
            groups' first pieces by group size, largest first, with each
            entry's output (groups + x, or g) as a fifth row, as
            `largest_first` lists them: where one group holds most rows all
            its pieces come first, and uneven groups come largest first,
            in an order ranked on the group sizes alone, with no sort of
            the table.
    extras  (3, E) int32: for each further piece (rows EXTRA_*), its group
            (-1 where unused), the index x of its group's first such piece,
            and how many such pieces its group has.
  """
  groups = group_sizes.shape[0]
  extra_count = max_extra_pieces(m, piece_rows)
  starts, ends = group_rows(group_sizes, row_offset, m)
  cut = ends - starts > piece_rows
  # A cut group's first further piece, and how many it has: the multiples
  # of piece_rows strictly inside its rows.
  group = jnp.arange(groups, dtype=jnp.int32)
  first_extra = starts // piece_rows
  extra = jnp.where(cut, (ends - 1) // piece_rows - first_extra, 0)
  first_hi = jnp.where(cut, jnp.minimum(ends, (first_extra + 1) * piece_rows),
                       ends)
  x = jnp.arange(extra_count, dtype=jnp.int32)
  at = (x + 1) * piece_rows
  per_group = dict(start=starts, end=ends, cut=cut, first=first_extra,
                   count=extra, first_hi=first_hi, index=group)
  # Each group's first piece's column among the first pieces: in group
  # order, or with cut_groups_first by the group's size, largest first
  # (ties in group order; the cut groups so come first). Ranked on the
  # sizes as given, so that the rank is a masked sum over the same
  # (groups, groups) as the cumulative sum's; any order is a valid walk.
  if cut_groups_first and groups:
    place = _rank_largest_first(jnp.maximum(group_sizes.astype(jnp.int32), 0))
  else:
    place = group
  masked = 0 < groups and groups + extra_count <= MASKED_SUM_MAX_ENTRIES
  if masked:
    # Every entry as one masked sum over the groups, as `row_items` builds
    # its items, so that the table is one small XLA kernel: each entry's
    # values are computed with every group as its owner, and only the
    # owner (at most one) contributes; values that hold without an owner
    # come from group 0 alone.
    def column(values):  # a value per entry, against every group
      return values[:, None]

    owner_of_extra = owner_of_first = {k: v[None, :]
                                       for k, v in per_group.items()}
    owns_first = group[:, None] == place[None, :]  # (column, group)
    lead = group[None, :] == 0

    def entries(owned, rows, defaults):
      # The owner adds its value less the default, group 0 the default.
      return jnp.stack([jnp.where(owned, r - d, 0) + jnp.where(lead, d, 0)
                        for r, d in zip(rows, defaults)])

    def fold(parts):
      return jnp.sum(parts, axis=-1, dtype=jnp.int32)
  else:
    # A long list: each multiple's owner found by a search and gathered,
    # with no (entries, groups) array.
    def column(values):
      return values

    owner = jnp.clip(jnp.searchsorted(ends, at, side="right"), 0,
                     max(groups - 1, 0))
    owner_of_extra = ({k: v[owner] for k, v in per_group.items()} if groups
                      else dict(start=at, end=at, cut=at < 0, first=x,
                                count=x, index=x))
    owner_of_first, owns_first = per_group, True

    def entries(owned, rows, defaults):
      return jnp.stack([jnp.where(owned, r, d) for r, d in zip(rows,
                                                              defaults)])

    def fold(parts):
      return parts.astype(jnp.int32)

  def table_rows(lo, hi, output):
    rows = _chunk_rows(lo, hi, chunk, row_align)
    return rows + [output] if cut_groups_first else rows

  at_entry, own = column(at), owner_of_extra
  owns_extra = own["cut"] & (own["start"] < at_entry) & (at_entry < own["end"])
  extra_output = column(groups + x)
  extra_part = entries(
      owns_extra,
      table_rows(at_entry, jnp.minimum(own["end"], at_entry + piece_rows),
                 extra_output),
      [0, 0, 0, 0, extra_output])
  own = owner_of_first
  first_part = entries(owns_first,
                       table_rows(own["start"], own["first_hi"], own["index"]),
                       [0] * 5)
  if not masked:  # group g's first piece to its column
    first_part = jnp.zeros_like(first_part).at[:, place].set(first_part)
  table = fold(jnp.concatenate([extra_part, first_part] if cut_groups_first
                               else [first_part, extra_part], axis=1))
  extras = fold(entries(owns_extra, [owner_of_extra["index"],
                                     owner_of_extra["first"],
                                     owner_of_extra["count"]], [-1, 0, 0]))
  return table, extras


def entry_counts(table, groups: int):
  """(2,) int32 of a "contracting"-mode table (`contracting_groups`,
  `contracting_pieces`, or either reordered): how many of the `groups`
  groups have no rows (their first piece has no chunk, so their output is
  zeros), and how many entries have rows. Counted by each entry's output
  (the fifth row where the table has one, else the entry's column), so
  that any order of the entries gives the same counts."""
  chunks = table[GROUP_CHUNKS]
  output = (table[GROUP_OUTPUT] if table.shape[0] > GROUP_OUTPUT
            else jnp.arange(table.shape[1], dtype=jnp.int32))
  return jnp.stack([jnp.sum((chunks == 0) & (output < groups),
                            dtype=jnp.int32),
                    jnp.sum(chunks > 0, dtype=jnp.int32)])


def largest_first(table):
  """A "contracting"-mode table (4, entries) with its entries sorted by row
  count, largest first (ties in entry order), and a fifth row: each sorted
  entry's original index, the output group its tiles store to.

  Up to MASKED_SUM_MAX_ENTRIES entries, as two masked reductions (each
  entry's rank: the entries with more rows, and the earlier ones with as
  many; then each rank's entry) instead of a stable sort and a gather: XLA
  runs them as two short kernels, where its sort kernel alone took longer
  than both (experiments/results/nvidia_h200/ragged_options)."""
  return _sorted_entries(table, table[GROUP_ROW_HI] - table[GROUP_ROW_LO])


def empty_last(table):
  """`largest_first`'s table, but only the entries without rows moved,
  after the others (both in entry order): a stable sort on whether an
  entry has rows."""
  return _sorted_entries(
      table, (table[GROUP_ROW_HI] > table[GROUP_ROW_LO]).astype(jnp.int32))


def _sorted_entries(table, key):
  """`table` with a fifth row, each entry's original index, its entries
  stably sorted by `key` (one int32 per entry), largest first."""
  entries = table.shape[1]
  index = jnp.arange(entries, dtype=jnp.int32)
  # The table with each entry's index as its fifth row, to be reordered.
  source = jnp.concatenate([table.astype(jnp.int32), index[None, :]])
  if entries > MASKED_SUM_MAX_ENTRIES:
    return source[:, jnp.argsort(-key, stable=True)]
  rank = _rank_largest_first(key)
  # Column r of the result is the entry of rank r (ranks are a permutation).
  lands = rank[None, :] == index[:, None]  # (rank, entry)
  return jnp.sum(jnp.where(lands[None], source[:, None, :], 0), axis=2,
                 dtype=jnp.int32)


def _rank_largest_first(key):
  """Each entry's position when `key` (one int32 per entry) is stably
  sorted largest first: up to MASKED_SUM_MAX_ENTRIES one masked reduction
  (the entries with a larger key, and the earlier ones with the same),
  above that two argsorts."""
  entries = key.shape[0]
  if entries > MASKED_SUM_MAX_ENTRIES:
    return jnp.argsort(jnp.argsort(-key, stable=True)).astype(jnp.int32)
  index = jnp.arange(entries, dtype=jnp.int32)
  other, this = key[None, :], key[:, None]
  ahead = (other > this) | ((other == this)
                            & (index[None, :] < index[:, None]))
  return jnp.sum(ahead, axis=1, dtype=jnp.int32)


def snake_deal(linear, num_ctas, num_tiles):
  """The tile that the `linear`-th slot of a round-robin deal runs
  (`warp_specialised.for_each_tile` gives CTA c the slots c, c + num_ctas,
  ...): every other whole round of num_ctas slots reversed, so that the CTA
  dealt the longest tile of one round is dealt the shortest of the next
  when tiles come longest first. A partial last round is dealt in order.
  A permutation of [0, num_tiles); works on traced or NumPy ints."""
  deal_round = linear // num_ctas
  backwards = (deal_round * num_ctas + (num_ctas - 1 - linear % num_ctas))
  whole = (deal_round + 1) * num_ctas <= num_tiles
  return jnp.where((deal_round % 2 == 1) & whole, backwards, linear)


def spread_zero_visits(*, tiles, with_rows, unit: int):
  """A function from a CTA's visit number to the tile that visit runs, as
  its number in the CTA's round-robin share of `tiles`, of which the first
  `with_rows` have rows (a table in `empty_last`'s order) and the rest are
  zero tiles: the zero tiles spread evenly between the others rather than
  after them, so that their output stores are written while the tiles with
  rows compute.

  Visits go in units of `unit` (a CTA's consumers taking turns at whole
  tiles: 2), so that the tiles with rows still alternate between the
  consumers. The units holding tiles with rows are spread over the CTA's
  whole units, the first and the last of them included: a CTA starts on a
  long tile, and what follows its last long tile is only what no other
  long tile could cover. A partial last unit holds zero tiles. Where the
  tiles with rows reach into that partial unit, or every unit holds them,
  the visits keep their order. The per-CTA quantities are computed here,
  once; the function does a visit's share. Each is a permutation of
  [0, tiles); works on traced or NumPy ints (non-negative)."""
  whole_units = tiles // unit
  row_units = (with_rows + unit - 1) // unit
  # Row units at u = 0 and where floor(u * gaps / span) steps up: row unit
  # j lands near j * span / gaps, the last at span.
  span = jnp.maximum(whole_units - 1, 1)
  gaps = jnp.maximum(row_units - 1, 0)
  spreads = (row_units > 0) & (row_units < whole_units)

  def tile_of(visit):
    u, lane = visit // unit, visit % unit
    before = jnp.maximum(u - 1, 0) * gaps // span
    rows_unit = (u < whole_units) & ((u == 0) | ((u * gaps) // span > before))
    row_units_before = jnp.where(u == 0, 0, jnp.minimum(1 + before,
                                                        row_units))
    rank = row_units_before * unit + lane
    rows_before = jnp.minimum(
        with_rows, row_units_before * unit + jnp.where(rows_unit, lane, 0))
    tile = jnp.where(rows_unit & (rank < with_rows), rank,
                     with_rows + visit - rows_before)
    return jnp.where(spreads, tile, visit)

  return spreads, tile_of
