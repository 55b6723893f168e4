"""Every kernel config validates its fields through `config_fields`: a
wrong value raises naming the config, the field and the value."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pallas_gemm.ffi.kernels import MmaSyncConfig
from pallas_gemm.gated_linear_unit import GluConfig
from pallas_gemm.mosaic_backend.config import MosaicConfig, SmallMConfig
from pallas_gemm.mosaic_backend.fp8_config import Fp8Config
from pallas_gemm.ragged_dot.configs import RaggedConfig
from pallas_gemm.triton_backend.common import TritonConfig

#: Invalid values per config field. An int of the right type that is out of
#: range is a ValueError; a value of the wrong type (a float, a string, a
#: bool, an int given to an enum or bool field) is a TypeError.
_INVALID_FIELDS = {
    MosaicConfig: {
        "tile_m": (100, 320, 128.0, True), "tile_n": (300, 100, "128"),
        "tile_k": (48, 256), "max_concurrent_steps": (1, 2.5),
        "epi_tile_m": (32, 0), "epi_tile_n": (48, 0), "grid_band": (0, 8.0),
        "band_dim": ("m", 2), "wg_dimension": (True,),
        "warpgroup_semantics": (1,)},
    SmallMConfig: {
        "tile_n": (12, 64.0), "tile_k": (16,),
        "max_concurrent_steps": (1, False), "k_splits": (0, 2.0)},
    Fp8Config: {
        "promote_group": (0, 1.0), "cluster_dim": (3, True),
        "pingpong": (1,), "alternate_consumers": ("no",),
        "stagger_groups": (1,)},
    GluConfig: {
        "tile_m": (96, 128.0), "tile_n": (96, True), "tile_k": (32,),
        "max_concurrent_steps": (1,), "epi_tile_n": (48,), "grid_band": (0,),
        "wg_dimension": (2,), "fast_math": (1,), "consumer_lag": (4,),
        "x_in_registers": ("yes",), "k_splits": (0, 2.0)},
    RaggedConfig: {
        "tile_m": (96, 64.0), "tile_n": (100,), "tile_k": (16, 96),
        "stages": (1, True), "epi_tile_n": (48,), "grid_band": (0,),
        "out_slots": (3,), "interleave_groups": (1,),
        "piece_rows": (96, -64, 64.0), "largest_first": (1,),
        "cut_groups_first": (1,),
        "empty_last": (1,),
        "ping_pong": (1,), "zeros_by_producer": (1,), "zero_drip": (-1, 17, 1.0),
        "short_items": (1,),
        "cluster_columns": (1,), "group_bands": (1,),
        "swizzled_staging": (1,), "epi_tile_m": (32, 128, 64.0),
        "claim_tiles": (1,), "wide_zero_box": (1,), "cluster_rows": (1,),
        "streamed_zeros": (1,), "double_zero_buffer": (1,),
        "narrow_last_strip": (1,), "spread_zero_tiles": (1,),
        "zero_tiles_evict_first": (1,), "halve_last_round": (1,),
        "token_width_step": (4, 8.0),
        "min_token_width": (8, 128, 64.0)},
    TritonConfig: {
        "block_k": (24, 32.0), "num_warps": (3,), "split_k": (0,),
        "programs_per_sm": (9,), "k_major": (1,)},
    # Its out-of-range values are refused as a whole (not a compiled
    # variant), so only the types are per field.
    MmaSyncConfig: {"block_n": (256.0,), "pipelined": (1,)},
}


def _invalid_field_cases():
  for cls, fields in _INVALID_FIELDS.items():
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for field, values in fields.items():
      for value in values:
        in_range_kind = (type(defaults[field]) is int and type(value) is int)
        yield cls, field, value, ValueError if in_range_kind else TypeError


@pytest.mark.parametrize("cls,field,value,error", list(_invalid_field_cases()))
def test_config_validation_names_the_field_and_value(cls, field, value, error):
  with pytest.raises(error,
                     match=re.escape(f"{cls.__name__}.{field}={value!r}")):
    cls(**{field: value})
