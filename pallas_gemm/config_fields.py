"""Field validation shared by every kernel's frozen launch config.

A config (`MosaicConfig`, `GluConfig`, `RaggedConfig`, `TritonConfig`,
`MmaSyncConfig`, ...) declares what each field may hold next to the field,
and its `__post_init__` calls `validate`, which checks, field by field:

  * the type its annotation names. An `int` field takes any integer
    (numpy's included, stored back as a Python int) but not a bool, float
    or string; a `bool` field only True or False; other annotations (the
    Mosaic configs' `Dim`) go through the converters the config passes;
  * then the `Requirement` of a field declared with `checked(default,
    requirement)`, built from the constructors below (`one_of`,
    `at_least`, `in_range`, ...).

Every error is "<Config>.<field>=<value> must be ...", naming the field
and the value. Checks that tie several fields together (a register budget,
an option that needs another) stay in the config's `__post_init__`.

The problems' dataclasses check their dimensions with `check_sizes`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any


def field_error(config, name: str, value, requirement: str) -> str:
  """The error of every field check: "<Config>.<field>=<value> must be
  <requirement>"."""
  return f"{type(config).__name__}.{name}={value!r} must be {requirement}"


def _as_int(config, name: str, value) -> int:
  if isinstance(value, bool):
    raise TypeError(field_error(config, name, value, "an int, not a bool"))
  try:
    return operator.index(value)
  except TypeError:
    raise TypeError(field_error(config, name, value, "an int, got "
                                 f"{type(value).__name__}")) from None


def _as_bool(config, name: str, value) -> bool:
  if not isinstance(value, bool):
    raise TypeError(field_error(config, name, value, "a bool"))
  return value


#: Field annotation -> converter(config, name, value), returning the value
#: to store or raising TypeError.
Converter = Callable[[Any, str, Any], Any]
_BASIC_CONVERTERS: dict[str, Converter] = {"int": _as_int, "bool": _as_bool}


def _check_types(config, converters: Mapping[str, Converter] | None):
  """Checks (and normalises, on the frozen instance) every field of the
  dataclass `config` as its annotation says."""
  known = {**_BASIC_CONVERTERS, **(converters or {})}
  for field in dataclasses.fields(config):
    # A string under `from __future__ import annotations`, else the class.
    annotation = (field.type if isinstance(field.type, str)
                  else getattr(field.type, "__name__", repr(field.type)))
    if annotation not in known:
      raise NotImplementedError(f"{type(config).__name__}.{field.name}: no "
                                f"check for a field of type {annotation}")
    value = known[annotation](config, field.name, getattr(config, field.name))
    object.__setattr__(config, field.name, value)


@dataclasses.dataclass(frozen=True)
class Requirement:
  """What an int field must be: `holds(value, config)`, and `describe
  (config)`, the words after "must be" in the error."""

  holds: Callable[[int, Any], bool]
  describe: Callable[[Any], str]

  def because(self, why: str) -> Requirement:
    """The same requirement, its error followed by the reason in brackets."""
    return Requirement(self.holds,
                       lambda config: f"{self.describe(config)} ({why})")


_REQUIREMENT = "requirement"


def checked(default, requirement: Requirement):
  """A dataclass field with this default whose values must meet
  `requirement` (which `validate` checks)."""
  return dataclasses.field(default=default,
                           metadata={_REQUIREMENT: requirement})


def _check_requirements(config):
  """Raises ValueError for the first field that breaks its requirement."""
  for field in dataclasses.fields(config):
    requirement = field.metadata.get(_REQUIREMENT)
    value = getattr(config, field.name)
    if requirement is not None and not requirement.holds(value, config):
      raise ValueError(field_error(config, field.name, value,
                                   requirement.describe(config)))


def _spelled_out(values) -> str:
  """64, 128 or 256."""
  *head, last = [str(v) for v in values]
  return f"{', '.join(head)} or {last}" if head else last


def one_of(*allowed: int) -> Requirement:
  return Requirement(lambda value, _: value in allowed,
                     lambda _: _spelled_out(allowed))


def at_least(low: int) -> Requirement:
  return Requirement(lambda value, _: value >= low, lambda _: f">= {low}")


def in_range(low: int, high: int) -> Requirement:
  return Requirement(lambda value, _: low <= value <= high,
                     lambda _: f"in [{low}, {high}]")


def multiple_in_range(step: int, low: int, high: int) -> Requirement:
  return Requirement(
      lambda value, _: value % step == 0 and low <= value <= high,
      lambda _: f"a multiple of {step} in [{low}, {high}]")


def power_of_two_at_least(low: int) -> Requirement:
  return Requirement(lambda value, _: value >= low and not value & (value - 1),
                     lambda _: f"a power of two >= {low}")


def multiple_dividing(step: int, whole: str) -> Requirement:
  """A positive multiple of `step` that divides the config's field `whole`
  (an epilogue sub-tile of the tile)."""
  return Requirement(
      lambda value, config: (value >= step and value % step == 0
                             and getattr(config, whole) % value == 0),
      lambda config: (f"a multiple of {step} dividing "
                      f"{whole}={getattr(config, whole)}"))


def check_sizes(problem, names, minimum: int) -> None:
  """Each of the fields `names` of `problem` (its dimensions) is an int (not
  a bool) >= minimum; else ValueError naming the field and the value."""
  for name in names:
    value = getattr(problem, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise ValueError(field_error(problem, name, value,
                                   f"an int >= {minimum}"))


def validate(config, converters: Mapping[str, Converter] | None = None):
  """Checks every field of `config` (a frozen dataclass, from its
  `__post_init__`): first each one's type, then each one's requirement,
  in the order the fields are declared."""
  _check_types(config, converters)
  _check_requirements(config)
