"""Engine options as keyword arguments and command-line flags, and the EngineConfig they build.

Nothing here names an option: each is declared once, as a field of a sub-config of EngineConfig
(`kvforge.config`, with `kvforge.options.option`), and the keyword arguments of `LLM(...)`, the
flags, their defaults and their `--help` are read off those fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from kvforge.config import EngineConfig
from kvforge.options import OptionSpec, option_fields, spec_of

_CLI_TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True, slots=True)
class EngineOption:
    """One engine option: its keyword name, where it lives in EngineConfig, its default and spec."""

    name: str
    section: str | None  # the EngineConfig field of its sub-config; None for EngineConfig's own
    annotation: str
    default: Any
    spec: OptionSpec

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")

    def to_value(self, value: Any) -> Any:
        """A keyword or CLI value as the config stores it."""
        if value is None:
            return None
        if self.spec.parse is not None:
            return self.spec.parse(value)
        return tuple(value) if self.annotation.startswith("tuple") else value


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _collect() -> tuple[EngineOption, ...]:
    options = []
    for section in dataclasses.fields(EngineConfig):
        sub_config = section.default_factory
        if dataclasses.is_dataclass(sub_config):
            options += [EngineOption(f.name, section.name, str(f.type), _default(f), spec)
                        for f, spec in option_fields(sub_config)]
        elif (spec := spec_of(section)) is not None:
            options.append(EngineOption(section.name, None, str(section.type), _default(section), spec))
    names = [o.name for o in options]
    assert len(set(names)) == len(names), f"engine option declared twice: {names}"
    return tuple(options)


ENGINE_OPTIONS: tuple[EngineOption, ...] = _collect()
ENGINE_ARG_NAMES = tuple(o.name for o in ENGINE_OPTIONS if o.spec.cli)  # the ones with a flag


def engine_signature() -> inspect.Signature:
    """The keyword arguments every engine entry point takes: `LLM(model=None, dtype="auto", ...)`."""
    return inspect.Signature([inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                                annotation=o.annotation) for o in ENGINE_OPTIONS])


def build_engine_config(**engine_kwargs: Any) -> EngineConfig:
    """EngineConfig from engine options given by name (see engine_signature); unknown names raise TypeError."""
    unknown = set(engine_kwargs) - {o.name for o in ENGINE_OPTIONS}
    if unknown:
        raise TypeError(f"unknown engine option(s) {sorted(unknown)}; the options are "
                        f"{[o.name for o in ENGINE_OPTIONS]}")
    sections: dict[str | None, dict[str, Any]] = {}
    for o in ENGINE_OPTIONS:
        if o.name in engine_kwargs:
            sections.setdefault(o.section, {})[o.name] = o.to_value(engine_kwargs[o.name])
    own = sections.pop(None, {})
    subconfigs = {f.name: f.default_factory(**sections.get(f.name, {}))
                  for f in dataclasses.fields(EngineConfig) if f.name in sections}
    return EngineConfig(**subconfigs, **own)


def _add_flag(group: argparse._ArgumentGroup, o: EngineOption) -> None:
    spec = o.spec
    if o.annotation == "bool":
        action = "store_false" if o.default else "store_true"
        group.add_argument(o.flag, dest=o.name, action=action, help=spec.help)
        return
    kwargs: dict[str, Any] = {"dest": o.name, "default": o.default, "help": spec.help}
    if spec.parse is None:
        base = o.annotation.removesuffix(" | None")
        if base.startswith("tuple["):
            base, kwargs["nargs"] = base.removeprefix("tuple[").split(",")[0], "+"
        if base in ("int", "float"):
            kwargs["type"] = _CLI_TYPES[base]
    if spec.choices is not None and spec.show_choices:
        kwargs["choices"] = spec.choices
    group.add_argument(o.flag, **kwargs)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, one per declared option, in an "engine" group."""
    group = parser.add_argument_group("engine")
    for o in ENGINE_OPTIONS:
        if o.spec.cli:
            _add_flag(group, o)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}
