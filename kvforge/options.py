"""How an engine option is declared: once, as a config dataclass field with its help text and bounds.

    @dataclass(frozen=True, slots=True)
    class CacheConfig:
        block_size: int = option(16, "tokens per KV cache block", choices=(1, 2, 4, ...))

From these fields `kvforge.engine_args` derives the keyword arguments of `LLM(...)`, the command-line
flags (`--block-size`) and their `--help`; each config's `__post_init__` calls `check_options`, which
enforces the declared choices and minimum. Adding an engine option is adding one such field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_KEY = "kvforge.option"


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """What the CLI and the checks need to know of one option beyond its name, type and default.

    flag: the command-line flag (default: --field-name; a `--no-...` flag on a field that defaults
    to True turns it off); choices: the allowed values (listed by --help when show_choices);
    minimum: the smallest allowed value (None always allowed where the default is None);
    parse: turns a keyword or CLI value into the stored one (e.g. '2GiB' -> bytes);
    cli: False for options of `LLM(...)` only."""

    help: str
    flag: str | None = None
    choices: Sequence[Any] | None = None
    show_choices: bool = True
    minimum: int | float | None = None
    parse: Callable[[Any], Any] | None = None
    cli: bool = True


def option(default: Any, help: str, *, default_factory: Callable[[], Any] | None = None,
           **spec: Any) -> Any:
    """A dataclass field declaring an engine option (see OptionSpec for the keywords)."""
    metadata = {_KEY: OptionSpec(help, **spec)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def spec_of(field: dataclasses.Field) -> OptionSpec | None:
    return field.metadata.get(_KEY)


def option_fields(config_class: type) -> list[tuple[dataclasses.Field, OptionSpec]]:
    """The declared options of a config class, in declaration order."""
    return [(f, spec) for f in dataclasses.fields(config_class) if (spec := spec_of(f)) is not None]


def check_options(config: object) -> None:
    """Raise ValueError naming the option, the bound and the value for a value outside its declaration."""
    for field, spec in option_fields(type(config)):
        value = getattr(config, field.name)
        if value is None and field.default is None:
            continue
        if spec.choices is not None and value not in spec.choices:
            raise ValueError(f"{field.name} must be one of {tuple(spec.choices)}, got {value!r}")
        if spec.minimum is not None and value < spec.minimum:
            raise ValueError(f"{field.name} must be >= {spec.minimum}, got {value}")
